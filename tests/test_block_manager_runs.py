"""``BlockManager.lookup_run`` keeps the runs it found and answers the next turn of a conversation from them: whatever
the order of lookups, registrations, evictions and releases, it finds the same pages as looking every block up and
checking its tokens (``_lookup``, what it did before), including after a page was named with other tokens (a hash
collision, made here by hand) and across tenants and conversations that share their first blocks."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule

from qml_runtime.kv.block_manager import BlockManager
from qml_runtime.kv.prefix import chain, pack

PAGES, S = 24, 4
SYSTEM = [7, 7, 7, 7, 1, 2, 3, 4]  # two blocks every conversation of a tenant begins with


class Runs(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.blocks = BlockManager(PAGES, S)
        # conversations: (tenant salt, tokens); they grow by turns
        self.convs: list[tuple[bytes, list[int]]] = [(salt, list(SYSTEM)) for salt in (b"", b"", b"t2")]

    def _names(self, c: int, blocks: int) -> tuple[list[bytes], bytes]:
        salt, tokens = self.convs[c]
        return chain(tokens[:blocks * S], S, b"fp", salt), pack(tokens[:blocks * S])

    def _check(self, names: list[bytes], packed: bytes) -> list[int]:
        expected = self.blocks._lookup(names, packed) if names and names[0] in self.blocks._by_name else []
        got = self.blocks.lookup_run(names, packed)
        assert got == expected, (got, expected)
        return got

    @rule(c=st.integers(0, 2), new=st.lists(st.integers(0, 5), min_size=1, max_size=12), release=st.booleans())
    def turn(self, c, new, release):
        """A turn: the conversation's history looked up, its new full blocks computed on fresh pages and named."""
        salt, tokens = self.convs[c]
        tokens.extend(new)
        full = len(tokens) // S
        names, packed = self._names(c, full)
        table = self._check(names, packed)
        self.blocks.acquire(table)
        if self.blocks.num_free < full - len(table):
            self.blocks.release(table)
            return
        found = len(table)
        self.blocks.grow(table, full * S)
        self.blocks.register_run(table[found:full], names[found:full], packed[found * S * 4:full * S * 4])
        if release:
            self.blocks.release(table)

    @rule(c=st.integers(0, 2), cut=st.integers(1, 40))
    def lookup(self, c, cut):
        """A prompt that is a part of a conversation (a regenerated turn, a shorter request)."""
        names, packed = self._names(c, min(cut, len(self.convs[c][1]) // S))
        self._check(names, packed)

    @rule(n=st.integers(1, PAGES))
    def evict(self, n):
        """Another request takes the oldest free pages, named ones among them."""
        table: list[int] = []
        n = min(n, self.blocks.num_free)
        if n:
            self.blocks.grow(table, n * S)
            self.blocks.release(table)

    @rule(c=st.integers(0, 2))
    def collide(self, c):
        """A free page named like the conversation's next block, with other tokens: the run ends before it."""
        salt, tokens = self.convs[c]
        full = len(tokens) // S
        names = chain(tokens[:full * S] + [9] * S, S, b"fp", salt)
        if names[-1] in self.blocks._by_name or not self.blocks.num_free:
            return
        table: list[int] = []
        self.blocks.grow(table, S)
        self.blocks.register(table[0], names[-1], [8] * S)
        self.blocks.release(table)
        tokens.extend([9] * (S - len(tokens) % S) if len(tokens) % S else [])
        tokens.extend([9] * S)
        self._check(*self._names(c, len(tokens) // S))


TestRuns = Runs.TestCase
TestRuns.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_a_conversations_next_turn_is_found_from_its_last_run():
    """The next turn's history is the run found at the last turn, then the blocks named since: looked up one by
    one only past it."""
    blocks = BlockManager(64, S)
    tokens = list(range(40))
    names, packed = chain(tokens, S, b"fp", b""), pack(tokens)
    table: list[int] = []
    blocks.grow(table, 40)
    blocks.register_run(table, names, packed)
    assert blocks.lookup_run(names[:8], packed[:8 * S * 4]) == table[:8]
    looked = []
    real = blocks._lookup
    blocks._lookup = lambda n, p: looked.append(len(n)) or real(n, p)
    assert blocks.lookup_run(names, packed) == table  # the 8 blocks found before, then 2 looked up
    assert looked == [2]
    assert blocks.lookup_run(names[:5], packed[:5 * S * 4]) == table[:5] and looked == [2]  # a part of it
    # the same first 9 blocks, then another (an edited last message): every block looked up
    other = chain(tokens[:36] + [99, 98, 97, 96], S, b"fp", b"")
    assert blocks.lookup_run(other, pack(tokens[:36] + [99, 98, 97, 96])) == table[:9] and looked == [2, 10]
    blocks.release(table)
    blocks.grow([], 64 * S)  # takes the named pages too: every run kept goes
    assert blocks._runs == {}
