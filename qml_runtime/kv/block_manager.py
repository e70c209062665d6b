"""Allocation of KV pages to sequences, with reuse of full pages by content (prefix caching).

A page holds ``block_size`` tokens of K/V for every layer. Pages are reference-counted:
sequences that share a prefix share its pages. A full page whose K/V is computed is
registered under its chained content name (``kv.prefix``) with its tokens; when no
sequence uses it any more it stays in the cache, at the young end of an LRU list of
free pages, until a new allocation needs the room. So a conversation's history stays
on the GPU between turns for as long as memory allows, and the next turn finds it by
name. Pages of conversations that asked for retention (a session id) wait in a second
LRU list that is only drawn on once the first is empty.

A page's tokens are kept packed (``kv.prefix.pack``), and handed so to the lower tiers when it
is evicted or kept. A new turn over a 27k-token history finds its ~1,700 pages by name and checks
all their tokens with one comparison of the joined packed bytes, rather than a tuple built and
compared per block (~0.3 ms); pages restored from the tiers below are registered from the turn's
packed tokens (``register_run``), without a tuple per block either. And the runs found are kept
until a named page is taken: the next turn of the conversation compares its tokens with the run's,
once, and looks up only the blocks after it (the scheduler's prefix lookup of a 27k-token history
on CI's CPU: 167 -> 53 us).
"""

from __future__ import annotations

import itertools
import operator
from collections import OrderedDict, deque
from typing import Callable

from qml_runtime.kv.prefix import TOKEN_BYTES, as_packed

MAX_RUNS_PER_KEY = 4  # runs ``lookup_run`` keeps that begin with the same block (a shared system prompt)


class Evicted:
    """The cached pages ``BlockManager.take`` handed out, in the order taken: three parallel lists (no tuple
    per page: ~1,700 of them took ~0.25 ms of a restoring turn's scheduling on CPU). Iterating gives
    (page, name, packed tokens)."""

    __slots__ = ("pages", "names", "packed")

    def __init__(self, pages: list[int], names: list[bytes], packed: list[bytes]):
        self.pages, self.names, self.packed = pages, names, packed

    def __len__(self) -> int:
        return len(self.pages)

    def __iter__(self):
        return zip(self.pages, self.names, self.packed)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref = [0] * num_blocks
        self._name: list[bytes | None] = [None] * num_blocks
        self._packed: list[bytes | None] = [None] * num_blocks  # its tokens, packed
        self._by_name: dict[bytes, int] = {}
        # free pages, oldest first: cached pages are evicted in LRU order, empty ones first;
        # retained ones (sessions) only when no other free page is left
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._retained: OrderedDict[int, None] = OrderedDict()
        # Pages a sequence took back from the cache (``acquire``) stay where they were in these lists,
        # held (ref > 0), until ``take`` meets them and drops them or ``release`` makes them the youngest
        # again: a turn over a 27k-token history re-takes ~1,700 pages, and taking each out of an
        # OrderedDict cost 0.18 ms of the turn's 0.52 ms scheduling on CPU, where counting the holds
        # costs 0.07. ``_lingering``: how many such held pages they hold.
        self._lingering = 0
        # called with the ``Evicted`` pages, once per ``grow``, for the cached pages it takes, before
        # they are overwritten (spilled to a lower tier): a turn restoring a 27k-token history takes ~1,700
        self.on_evict: Callable[[Evicted], None] | None = None
        # runs ``lookup_run`` found, by their first block's name, the most recent first: (names, packed tokens,
        # pages). A name stays on its page until ``take`` hands the page out cached, so until then the next turn
        # of a conversation, whose blocks begin with the same tokens, finds those pages with one comparison of
        # the tokens, without looking up and checking ~1,700 blocks again; ``take`` and ``forget`` drop them all
        self._runs: OrderedDict[bytes, list[tuple[list[bytes], bytes, list[int]]]] = OrderedDict()
        self._run_blocks = 0  # blocks in them, at most twice the pool's (as ``kv.prefix.KnownChains``)

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._retained) - self._lingering

    @property
    def num_cached(self) -> int:
        return len(self._by_name)

    @property
    def usage(self) -> float:
        """Fraction of pages held by running sequences (cached free pages count as free)."""
        return 1.0 - self.num_free / self.num_blocks

    def blocks_needed(self, block_table: list[int], num_tokens: int) -> int:
        """Pages to add so that ``block_table`` covers ``num_tokens`` tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(block_table))

    def can_grow(self, block_table: list[int], num_tokens: int) -> bool:
        return self.blocks_needed(block_table, num_tokens) <= self.num_free

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Append fresh pages to ``block_table`` in place until it covers ``num_tokens`` tokens."""
        evicted = self.take(block_table, num_tokens)
        if evicted:
            if self.on_evict is not None:  # (their names still registered while it runs)
                self.on_evict(evicted)
            self.forget(evicted)

    def take(self, block_table: list[int], num_tokens: int) -> Evicted:
        """``grow``'s first half: fresh pages appended to ``block_table`` (held), and the cached ones among
        them returned (their pages, names and packed tokens), still registered under their names. The caller hands
        those to the tiers before anything overwrites the pages, then ``forget``s them, before any lookup
        or registration. A restore from host RAM launches its copy in between: a 27k-token history takes
        ~1,700 pages, and the turn waits for the copy, not for the bookkeeping of what those pages held
        (``Scheduler._admit``; benchmarks/restore_admit_cpu.py)."""
        need = self.blocks_needed(block_table, num_tokens)
        if need > self.num_free:
            raise MemoryError(f"KV cache: {need} pages needed, {self.num_free} free")
        # the oldest free pages, then retained ones; each step below is one C loop over the ~1,700 pages a
        # restored history takes (consumed by zero-length deques), not a Python step per page
        taken, ref = [], self.ref
        for pool in (self._free, self._retained):
            while len(taken) < need and pool:
                some = list(itertools.islice(pool, need - len(taken)))
                deque(map(pool.__delitem__, some), maxlen=0)
                idle = list(itertools.compress(some, map(operator.not_, map(ref.__getitem__, some))))
                self._lingering -= len(some) - len(idle)  # held ones met on the way: out of the list now
                taken += idle
        deque(map(ref.__setitem__, taken, itertools.repeat(1)), maxlen=0)
        block_table.extend(taken)
        # the cached ones: those with a name (a name is never empty)
        names = list(map(self._name.__getitem__, taken))
        if not any(names):
            return Evicted([], [], [])
        self._drop_runs()  # (these pages lose their names: runs found before may hold them)
        return Evicted(list(itertools.compress(taken, names)), list(filter(None, names)),
                       list(itertools.compress(map(self._packed.__getitem__, taken), names)))

    def forget(self, evicted: Evicted) -> None:
        """Drop the names of pages ``take`` handed out cached (its return value)."""
        deque(map(self._by_name.__delitem__, evicted.names), maxlen=0)
        self._drop_runs()
        for page in evicted.pages:
            self._name[page] = self._packed[page] = None

    def release(self, block_table: list[int], retain: bool = False) -> None:
        """Drop a sequence's hold on its pages. Its last pages become the oldest free ones:
        the start of a conversation is the part most likely to be asked for again.
        ``retain``: named pages go to the retained list, evicted only after all others."""
        ref, free, retained = self.ref, self._free, self._retained
        for page in reversed(block_table):
            ref[page] -= 1
            if ref[page] == 0:
                pool, other = (retained, free) if retain and self._name[page] is not None else (free, retained)
                if page in pool:  # taken back from the cache and left in place: the youngest now
                    pool.move_to_end(page)
                    self._lingering -= 1
                elif page in other:
                    del other[page]
                    pool[page] = None
                    self._lingering -= 1
                else:
                    pool[page] = None
        block_table.clear()

    # --- prefix cache -----------------------------------------------------------------

    def lookup(self, name: bytes, tokens) -> int | None:
        """The page cached under ``name`` if its tokens are ``tokens`` (packed, or the ids; a hash collision
        is a miss): one block (the scheduler looks a whole history up at once, ``lookup_run``)."""
        page = self._by_name.get(name)
        if page is None or self._packed[page] != as_packed(tokens):
            return None
        return page

    def lookup_run(self, names: list[bytes], packed: bytes) -> list[int]:
        """Pages of the longest run of leading blocks cached: block i under ``names[i]``, with the tokens
        of ``packed``'s block i (``kv.prefix.pack``). A name whose page holds other tokens (a hash
        collision) is a miss, and the run ends before it."""
        if not names or names[0] not in self._by_name:  # (a history gone to the tiers below: ~1,700 names)
            return []
        pages = self._known_run(names, packed)
        if pages is None:
            pages = self._lookup(names, packed)
        if len(pages) > 1:
            self._remember_run(names, packed, pages)
        return pages

    def _known_run(self, names: list[bytes], packed: bytes) -> list[int] | None:
        """``lookup_run`` from a run found before that these blocks begin, or begin with (None: none)."""
        B = self.block_size * TOKEN_BYTES
        for run_names, run_packed, run_pages in self._runs.get(names[0], ()):
            m = min(len(names), len(run_names))
            # the same m names with the same tokens: the same blocks, on the pages found then (their tokens were
            # checked then, and are these); the last name first, as most runs that differ differ there
            if names[m - 1] != run_names[m - 1] or names[:m] != run_names[:m]:
                continue
            if m == len(run_names):  # the run, and blocks after it (a conversation's next turn)
                if packed.startswith(run_packed):
                    return run_pages + self._lookup(names[m:], packed[m * B:])
            elif run_packed.startswith(packed[:m * B]):  # a part of the run
                return run_pages[:m]
        return None

    def _remember_run(self, names: list[bytes], packed: bytes, pages: list[int]) -> None:
        n = len(pages)
        key = names[0]
        bucket = self._runs.pop(key, [])
        if any(len(r[0]) >= n and r[0][n - 1] == names[n - 1] for r in bucket):
            self._runs[key] = bucket  # a part of a run kept already: only its recency changes
            return
        # the newest first; those it covers (the same conversation's earlier turns) go
        kept = [r for r in bucket if not (len(r[0]) <= n and r[0][-1] == names[len(r[0]) - 1])][:MAX_RUNS_PER_KEY - 1]
        self._run_blocks += n - sum(len(r[2]) for r in bucket) + sum(len(r[2]) for r in kept)
        B = self.block_size * TOKEN_BYTES
        self._runs[key] = [(names[:n], bytes(packed[:n * B]), pages[:])] + kept
        while self._run_blocks > 2 * self.num_blocks and len(self._runs) > 1:
            _, dropped = self._runs.popitem(last=False)
            self._run_blocks -= sum(len(r[2]) for r in dropped)

    def _drop_runs(self) -> None:
        if self._runs:
            self._runs.clear()
            self._run_blocks = 0

    def _lookup(self, names: list[bytes], packed: bytes) -> list[int]:
        """``lookup_run`` block by block: each name's page, its tokens checked (all at once)."""
        if not names:
            return []
        pages = list(map(self._by_name.get, names))
        if None in pages:
            pages = pages[:pages.index(None)]
        B = self.block_size * TOKEN_BYTES
        if b"".join(map(self._packed.__getitem__, pages)) != packed[:len(pages) * B]:
            pages = pages[:next(i for i, p in enumerate(pages) if self._packed[p] != packed[i * B:(i + 1) * B])]
        return pages

    def acquire(self, pages: list[int]) -> None:
        """Take a hold on each of ``pages``, distinct cached pages found by ``lookup_run`` (a 27k-token history
        is ~1,700 of them): the free ones among them stay in the free lists, held (``_lingering``)."""
        ref, idle = self.ref, 0
        for page in pages:  # (a plain loop: 0.06 ms for 1,700 pages on CI's CPU, list.__setitem__ through map 0.12)
            if ref[page]:
                ref[page] += 1
            else:
                ref[page] = 1
                idle += 1
        self._lingering += idle

    def register(self, page: int, name: bytes, tokens) -> None:
        """Name a full, computed page; ``tokens``: packed, or the ids. If another page already holds this
        content, keep that one."""
        self.register_run([page], [name], as_packed(tokens))

    def register_run(self, pages: list[int], names: list[bytes], packed: bytes | bytearray) -> None:
        """``register`` page i under ``names[i]`` with the tokens of ``packed``'s block i, for each i (a
        turn's restored history: ~1,700 pages)."""
        B = self.block_size * TOKEN_BYTES
        if len(packed) != len(pages) * B or len(names) != len(pages):
            raise ValueError(f"{len(pages)} pages, {len(names)} names, {len(packed)} bytes of tokens")
        packed = bytes(packed)  # (its slices are then bytes: immutable, as kept)
        by_name, page_name, page_packed = self._by_name, self._name, self._packed
        for i, (page, name) in enumerate(zip(pages, names)):
            if name in by_name or page_name[page] is not None:
                continue
            by_name[name] = page
            page_name[page] = name
            page_packed[page] = packed[i * B:(i + 1) * B]

    def named(self, page: int) -> tuple[bytes, bytes] | None:
        """(name, packed tokens) of a registered page, else None."""
        name = self._name[page]
        return None if name is None else (name, self._packed[page])
