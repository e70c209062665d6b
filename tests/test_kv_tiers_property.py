"""``KVTiers`` bookkeeping under any order of the engine's calls (hypothesis state machine, CPU).

Pages are filled with blocks whose every element is the block's id. In any order, requests end and keep
their pages (``persist``, copies deferred); the pump copies them down between steps or beside one
(``pump``, by ``page_save`` or by the spill path); pages are evicted for new blocks (``spill``, then
``flush_spills``); and host blocks are restored into pages (``restore_host``, or as a split's tail:
``start_load`` with ``prefetch``, applied or dropped). The host tier is kept
smaller than the pool, so its LRU evicts too. Whatever the order:
- a host slot whose copy is not still waiting holds exactly its block's bytes;
- a restore gives back exactly the block asked for.
"""

from __future__ import annotations

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from qml_kernels.kv_codec import decode_chunks_ref, encoded_chunk_bytes
from qml_runtime.kv.cache import KVCache
from qml_runtime.kv.host_tier import HostTier
from qml_runtime.kv.prefix import as_packed
from qml_runtime.kv.tiers import KVTiers
from qml_runtime.presets import PRESETS

PAGES, HOST_SLOTS, BLOCK = 5, 3, 4


def _name(block: int) -> bytes:
    return b"block-%d" % block


def _tokens(block: int, size: int = BLOCK) -> bytes:
    return bytes(as_packed((block,) * size))


class TiersMachine(RuleBasedStateMachine):
    DTYPE, CODEC, SIZE = torch.float32, False, BLOCK

    def __init__(self):
        super().__init__()
        cfg = PRESETS["tiny-llama"].config
        self.kv = KVCache(cfg, PAGES, self.SIZE, "cpu", self.DTYPE, codec=self.CODEC)
        assert self.kv.codec == self.CODEC
        self.kv.data.zero_()
        self.tiers = KVTiers(self.kv, HostTier(self.kv.row_bytes, HOST_SLOTS * self.kv.row_bytes, pin=False),
                             None)
        self.tiers.defer_persist = True  # the GPU's defaults (CPU turns them off)
        self.tiers.pump_pages = 2
        self.page_block: dict[int, int] = {}  # page -> the block it holds (cached on the "GPU")
        self.next_block = 1

    def _evict(self, page: int) -> None:
        """The engine's eviction of a cached page about to be reused: spill, then copy out before reuse."""
        block = self.page_block.pop(page, None)
        if block is not None:
            self.tiers.spill(page, _name(block), _tokens(block, self.SIZE))
        self.tiers.flush_spills()

    @rule(page=st.integers(0, PAGES - 1))
    def new_block(self, page):
        self._evict(page)
        block, self.next_block = self.next_block, self.next_block + 1
        self.kv.data[:, :, page] = float(block)
        self.page_block[page] = block

    @rule(page=st.integers(0, PAGES - 1))
    def request_ends(self, page):
        block = self.page_block.get(page)
        if block is not None:
            self.tiers.persist([(page, _name(block), _tokens(block, self.SIZE), None)])

    @rule(pages=st.none() | st.integers(1, 4), beside=st.booleans(), in_place=st.booleans())
    def pump(self, pages, beside, in_place):
        self.tiers.save_in_place = in_place
        self.tiers.pump(pages, beside_step=beside)

    @rule(pick=st.integers(0, 10**6), page=st.integers(0, PAGES - 1))
    def restore(self, pick, page):
        self._evict(page)  # (first: its spill may push a block out of host RAM)
        held = list(self.tiers.host._lru)
        if not held:
            return
        name = held[pick % len(held)]
        block = int(name.split(b"-")[1])
        assert self.tiers.restore_host([name], _tokens(block, self.SIZE), [page]) == 1
        self.kv.settle()
        got = self.kv.data[:, :, page]
        assert bool((got == float(block)).all()), f"page {page} restored for block {block} holds {got.unique()}"
        self.page_block[page] = block

    @rule(picks=st.lists(st.integers(0, 10**6), min_size=1, max_size=3), page=st.integers(0, PAGES - 1),
          head=st.integers(0, 2), drop=st.booleans())
    def split_restore(self, picks, page, head, drop):
        """A split's tail: a run of host blocks located, the first ``head`` of them left to be recomputed,
        the rest copied at once into one page (``start_load(prefetch=...)``), then applied or dropped."""
        self._evict(page)
        held = list(self.tiers.host._lru)
        if not held:
            return
        names = [held[p % len(held)] for p in picks]
        blocks = [int(n.split(b"-")[1]) for n in names]
        where = self.tiers.locate_run(names, b"".join(_tokens(b, self.SIZE) for b in blocks))
        head = min(head, len(where) - 1)
        if len(where) - head < 1:
            return
        name, block = names[head], blocks[head]  # the tail's first block, into ``page``
        load = self.tiers.start_load([("host", name, _tokens(block, self.SIZE))], [page], head * self.SIZE,
                                     (head + 1) * self.SIZE, prefetch=head)
        assert load.copied == 1
        if drop:
            self.tiers.drop_load(load)
            self.page_block.pop(page, None)  # (its bytes are the block's, but nobody names the page)
            return
        assert self.tiers.apply_load(load) == 1
        self.kv.settle()
        got = self.kv.data[:, :, page]
        assert bool((got == float(block)).all()), f"page {page} copied for block {block} holds {got.unique()}"
        self.page_block[page] = block

    @invariant()
    def landed_slots_hold_their_blocks(self):
        waiting = set(self.tiers._deferred_slots) | {slot for _, slot in self.tiers._pending}
        for name, (slot, _) in self.tiers.host._lru.items():
            if slot in waiting:
                continue
            block = int(name.split(b"-")[1])
            row = self.tiers.host.slots[slot]
            if self.kv.codec:  # the row as the codec keeps it: its values back
                row = decode_chunks_ref(row.view(-1, encoded_chunk_bytes(self.kv.data[0, 0, 0].numel())),
                                        self.kv.data[0, 0, 0].numel())
            row = row.view(self.DTYPE)
            assert bool((row == float(block)).all()), f"host slot {slot} of block {block} holds {row.unique()}"


class CodecTiersMachine(TiersMachine):
    """The same in bf16 with host rows in ``qml_kernels.kv_codec``'s form (blocks of one value: compressed)."""

    DTYPE, CODEC, SIZE = torch.bfloat16, True, 16  # (16-token pages of tiny-llama: one 512-value segment)


TiersMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_tiers_bookkeeping = TiersMachine.TestCase
CodecTiersMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
test_tiers_bookkeeping_with_the_codec = CodecTiersMachine.TestCase
