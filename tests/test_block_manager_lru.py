"""``BlockManager``'s free lists keep pages a sequence took back from the cache in place (``acquire`` only counts
its holds): whatever the order of calls, it hands out the same pages, in the same order, as free lists that
take each such page out at once (the model below, the manager's behaviour before that change)."""

from __future__ import annotations

from collections import OrderedDict

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from qml_runtime.kv.block_manager import BlockManager

PAGES, S = 24, 4


class Model:
    """Free lists as the manager kept them before: a page taken back from the cache leaves them at once."""

    def __init__(self):
        self.ref = [0] * PAGES
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(PAGES))
        self.retained: OrderedDict[int, None] = OrderedDict()
        self.named: set[int] = set()

    def take(self, n: int) -> list[int]:
        taken = []
        for pool in (self.free, self.retained):
            while pool and len(taken) < n:
                taken.append(pool.popitem(last=False)[0])
        for page in taken:
            self.ref[page] = 1
            self.named.discard(page)
        return taken

    def acquire(self, pages: list[int]) -> None:
        for page in pages:
            if self.ref[page] == 0:
                (self.free if page in self.free else self.retained).pop(page)
            self.ref[page] += 1

    def release(self, table: list[int], retain: bool) -> None:
        for page in reversed(table):
            self.ref[page] -= 1
            if self.ref[page] == 0:
                (self.retained if retain and page in self.named else self.free)[page] = None


class Lists(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.blocks = BlockManager(PAGES, S)
        self.model = Model()
        self.tables: list[tuple[list[int], bool]] = []  # the live sequences' pages, and whether they retain
        self.names = 0

    @rule(n=st.integers(1, 8), retain=st.booleans(), name=st.booleans())
    def new_sequence(self, n, retain, name):
        """A sequence gets ``n`` fresh pages (evicting the oldest free ones), named when full."""
        n = min(n, self.blocks.num_free)
        table: list[int] = []
        evicted = self.blocks.take(table, n * S)
        self.blocks.forget(evicted)
        assert table == self.model.take(n)
        if name:
            for page in table:
                self.names += 1
                self.blocks.register(page, self.names.to_bytes(8, "little"), [page] * S)
                self.model.named.add(page)
        self.tables.append((table, retain))

    @precondition(lambda self: self.blocks.num_cached)
    @rule(data=st.data(), retain=st.booleans())
    def reuse(self, data, retain):
        """A sequence takes back some cached pages (held or free), as a prefix hit does."""
        named = sorted(self.model.named)
        pages = data.draw(st.lists(st.sampled_from(named), min_size=1, max_size=len(named), unique=True))
        self.blocks.acquire(pages)
        self.model.acquire(pages)
        self.tables.append((list(pages), retain))

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def finish(self, data):
        table, retain = self.tables.pop(data.draw(st.integers(0, len(self.tables) - 1)))
        self.model.release(list(table), retain)
        self.blocks.release(table, retain)

    @invariant()
    def same_state(self):
        b, m = self.blocks, self.model
        assert b.ref == m.ref
        assert b.num_free == len(m.free) + len(m.retained) == b.ref.count(0)
        # the free lists in order, less the held pages left in place in them
        assert [p for p in b._free if b.ref[p] == 0] == list(m.free)
        assert [p for p in b._retained if b.ref[p] == 0] == list(m.retained)


TestLists = Lists.TestCase
TestLists.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
