"""The host's per-turn work over a long history, in faster forms: the same answers as the plain ones.

(benchmarks/host_turn_cpu.py measures the time; these check the results.)
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from qml_kernels.attention import block_tables_tensor
from qml_runtime.engine import _packed_ids
from qml_runtime.kv.prefix import pack


@pytest.mark.parametrize("ids, ok", [
    ([], True),
    ([0, 1, 511], True),
    ([True, 3], True),  # bool is an int (as isinstance says)
    ([0, 512], False),  # the vocabulary's end
    ([-1, 3], False),
    ([2**32 + 1], False),  # past uint32: would wrap
    ([2**70], False),
    ([1, 2.0], False),
    ([1, "2"], False),
    ([1, None], False),
    ([np.int64(3)], False),  # not an int, as before
])
def test_prompt_ids_are_checked_as_one_id_at_a_time_would(ids, ok):
    assert ok == all(isinstance(t, int) and 0 <= t < 512 for t in ids)
    assert _packed_ids(ids, 512) == (pack(ids) if ok else None)


def test_block_tables_tensor_is_the_padded_tables():
    rng = random.Random(1)
    tables = [[rng.randrange(2**31) for _ in range(n)] for n in (1700, 3, 0, 1699)]
    width = max(map(len, tables))
    got = block_tables_tensor(tables)
    assert got.dtype == torch.int32
    assert torch.equal(got, torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32))
    assert block_tables_tensor([[], []]).shape == (2, 0)


# --- a history restored from host RAM: found, restored and registered in runs of packed tokens ---

S = 16


def _runs_one_by_one(slots: list[int]) -> list[tuple[int, int, int]]:
    runs = []
    for i, s in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == s:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((i, s, 1))
    return runs


def _held(rng: random.Random, blocks: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """(name, stored tokens) a host tier holds: a leading run of ``blocks`` and some others, in a random
    order, a few under other tokens (a collision)."""
    k = rng.randrange(len(blocks) + 1)
    held = blocks[:k] + rng.sample(blocks[k:], rng.randrange(len(blocks) - k + 1))
    rng.shuffle(held)
    return [(name, tokens if rng.random() < 0.95 else pack([7] * S)) for name, tokens in held]


def test_host_find_run_is_find_block_by_block_with_the_same_recency():
    from qml_runtime.kv.host_tier import HostTier

    rng = random.Random(3)
    for _ in range(200):
        blocks = [(b"n%d" % i, pack(rng.randrange(4) for _ in range(S))) for i in range(rng.randrange(1, 30))]
        one, run = HostTier(8, 8 * 64, pin=False), HostTier(8, 8 * 64, pin=False)
        for name, tokens in _held(rng, blocks):
            one.reserve(name, tokens)
            run.reserve(name, tuple(np.frombuffer(tokens, np.uint32).tolist()))  # the ids: kept packed
        want = []
        for name, tokens in blocks:
            slot = one.find(name, tokens)
            if slot is None:
                break
            want.append(slot)
        assert run.find_run([n for n, _ in blocks], b"".join(t for _, t in blocks)) == want
        assert list(run._lru.items()) == list(one._lru.items())  # same recency, same packed tokens
    assert HostTier(8, 64, pin=False).find_run([], b"") == []


def test_locate_run_is_locate_block_by_block():
    from qml_runtime.kv.cache import KVCache
    from qml_runtime.kv.host_tier import HostTier
    from qml_runtime.kv.tiers import KVTiers
    from qml_runtime.presets import PRESETS

    class Disk:  # all that locating asks of the disk store
        def __init__(self, names):
            self.names = set(names)

        def contains(self, name):
            return name in self.names

    kv = KVCache(PRESETS["tiny-llama"].config, 4, S, "cpu", torch.float32)
    rng = random.Random(4)
    for _ in range(200):
        blocks = [(b"n%d" % i, pack(rng.randrange(4) for _ in range(S))) for i in range(rng.randrange(1, 30))]
        held, on_disk = _held(rng, blocks), rng.sample(blocks, rng.randrange(len(blocks) + 1))
        one, run = (KVTiers(kv, HostTier(kv.block_bytes, 64 * kv.block_bytes, pin=False), None) for _ in range(2))
        for tiers in (one, run):
            tiers.disk = Disk(name for name, _ in on_disk)
            for name, tokens in held:
                tiers.host.reserve(name, tokens)
        want = []
        for name, tokens in blocks:
            tier = one.locate(name, tokens)
            if tier is None:
                break
            want.append(tier)
        assert run.locate_run([n for n, _ in blocks], b"".join(t for _, t in blocks)) == want
        assert list(run.host._lru.items()) == list(one.host._lru.items())


def test_runs_of_slots_are_the_runs_found_one_by_one():
    from qml_runtime.kv.host_tier import slot_runs

    rng = random.Random(5)
    cases = [[], [3], [1, 2, 4, 5, 9], list(range(100, 1800)), [5, 4, 3], [2, 2]]
    cases += [rng.sample(range(40), rng.randrange(40)) for _ in range(100)]
    cases += [sorted(rng.sample(range(4000), 1700))]
    for slots in cases:
        assert slot_runs(slots) == _runs_one_by_one(slots)


def test_register_run_is_register_page_by_page():
    from qml_runtime.kv.block_manager import BlockManager

    rng = random.Random(6)
    for _ in range(100):
        one, run = BlockManager(32, S), BlockManager(32, S)
        for blocks in (one, run):  # pages named before
            blocks.register(3, b"old", pack([1] * S))
        n = rng.randrange(20)
        pages = rng.sample(range(32), n)
        names = [b"n%d" % rng.randrange(12) for _ in range(n)]  # repeats: the first page keeps a name
        names = [b"old" if rng.random() < 0.1 else name for name in names]  # a name cached elsewhere
        tokens = [[rng.randrange(2**32) for _ in range(S)] for _ in range(n)]
        for page, name, toks in zip(pages, names, tokens):
            one.register(page, name, tuple(toks))
        run.register_run(pages, names, bytearray(pack(t for toks in tokens for t in toks)))
        assert run._by_name == one._by_name
        assert [run.named(p) for p in range(32)] == [one.named(p) for p in range(32)]
        assert all(type(run.named(p)[1]) is bytes for p in range(32) if run.named(p))
    with pytest.raises(ValueError):
        run.register_run([1, 2], [b"a", b"b"], pack([0] * S))


def _scheduler_with_host_tier(num_blocks: int = 8):
    from qml_runtime.config import SchedulerConfig
    from qml_runtime.kv.block_manager import BlockManager
    from qml_runtime.kv.cache import KVCache
    from qml_runtime.kv.host_tier import HostTier
    from qml_runtime.kv.tiers import KVTiers
    from qml_runtime.presets import PRESETS
    from qml_runtime.scheduler import Scheduler

    kv = KVCache(PRESETS["tiny-llama"].config, num_blocks, S, "cpu", torch.float32)
    kv.data.normal_()  # page contents to find again
    tiers = KVTiers(kv, HostTier(kv.block_bytes, 64 * kv.block_bytes, pin=False), None)
    blocks = BlockManager(num_blocks, S)
    blocks.on_evict = tiers.spill_many
    return Scheduler(SchedulerConfig(max_batched_tokens=1000), blocks, b"fp", tiers=tiers), kv


def _run(sched, tokens: list[int], salt: bytes):
    """A request over ``tokens`` scheduled to its end as the engine does (pages computed in place)."""
    from qml_runtime.sampling_params import SamplingParams
    from qml_runtime.sequence import Sequence

    seq = Sequence("r", tokens, SamplingParams(max_tokens=1), None, salt=salt)
    sched.add(seq)
    while seq.num_computed < seq.num_tokens:
        batch = sched.schedule()
        sched.tiers.flush_spills()
        for q, n in zip(batch.seqs, batch.num_tokens):
            q.num_computed += n
            sched.commit(q)
    sched.finish(seq, "stop")
    return seq


def test_a_history_evicted_to_host_ram_comes_back_for_its_tenant_only_and_up_to_a_collision():
    from qml_runtime.kv.prefix import chain

    rng = random.Random(7)
    history = [rng.randrange(512) for _ in range(5 * S + 3)]
    names = chain(history, S, b"fp", b"a")
    for collide in (None, 2):
        sched, kv = _scheduler_with_host_tier()
        _run(sched, history, b"a")
        kept = {name: kv.gather_pages(torch.tensor([sched.blocks._by_name[name]]))[0].clone() for name in names}
        _run(sched, [rng.randrange(512) for _ in range(8 * S)], b"other")  # every page: the history's spilled
        assert sched.blocks.lookup_run(names, pack(history[:5 * S])) == []
        if collide is not None:  # the host tier holds block 2's name with other tokens
            slot, _ = sched.tiers.host._lru[names[collide]]
            sched.tiers.host._lru[names[collide]] = (slot, pack([0] * S))
        restored, hits = sched.tiers.stats.restored_host, sched.prefix_hits
        other = _run(sched, history + [1, 2], b"b")  # another tenant, the same tokens: nothing
        assert other.num_cached == 0 and sched.tiers.stats.restored_host == restored
        again = _run(sched, history + [1, 2], b"a")
        n = 5 if collide is None else collide
        assert again.num_cached == n * S and sched.prefix_hits - hits == n * S
        assert sched.tiers.stats.restored_host - restored == n
        for i, name in enumerate(names[:n]):  # the pages hold the history's bytes, under its names and tokens
            page = sched.blocks._by_name[name]
            assert sched.blocks.named(page) == (name, pack(history[i * S:(i + 1) * S]))
            assert torch.equal(kv.gather_pages(torch.tensor([page]))[0], kept[name])


def test_restore_takes_the_slots_located_just_before_unless_an_entry_left():
    """``restore_host`` takes the host slots ``locate_run`` found for the same blocks (no second lookup) while
    no host entry has left since; after a removal, or with other tokens under the same names, it looks again."""
    from qml_runtime.kv.cache import KVCache
    from qml_runtime.kv.host_tier import HostTier
    from qml_runtime.kv.tiers import KVTiers
    from qml_runtime.presets import PRESETS

    kv = KVCache(PRESETS["tiny-llama"].config, 4, S, "cpu", torch.float32)
    tiers = KVTiers(kv, HostTier(kv.block_bytes, 8 * kv.block_bytes, pin=False), None)
    names = [b"a" * 32, b"b" * 32, b"c" * 32]
    packed = b"".join(pack([i] * S) for i in range(3))
    for i, name in enumerate(names):
        slot, _ = tiers.host.reserve(name, packed[i * S * 4:(i + 1) * S * 4])
        tiers.host.slots[slot] = torch.randint(0, 256, (kv.block_bytes,), dtype=torch.uint8)
    lookups = []
    find_run = tiers.host.find_run
    tiers.host.find_run = lambda *a: (lookups.append(a), find_run(*a))[1]

    def page_bytes(page: int) -> torch.Tensor:
        out = torch.empty(kv.block_bytes, dtype=torch.uint8)
        kv.read_page(page, out)
        return out

    def slot_of(name: bytes) -> int:
        return tiers.host._lru[name][0]

    assert tiers.locate_run(names, packed) == ["host"] * 3 and len(lookups) == 1
    assert tiers.restore_host(names, packed, [3, 1, 2]) == 3 and len(lookups) == 1  # the located slots, as they are
    assert all(torch.equal(page_bytes(p), tiers.host.slots[slot_of(n)]) for p, n in zip([3, 1, 2], names))

    tiers.locate_run(names, packed)
    tiers.host.discard(names[1])  # an entry left: the run is looked up again, and ends before it
    assert tiers.restore_host(names, packed, [0, 1, 2]) == 1 and len(lookups) == 3
    assert torch.equal(page_bytes(0), tiers.host.slots[slot_of(names[0])])

    tiers.locate_run(names[:1], packed[:S * 4])
    other = pack([7] * S)  # the same name with other tokens (a collision): looked up again, a miss
    assert tiers.restore_host(names[:1], other, [1]) == 0 and len(lookups) == 5
    assert tiers.restore_host(names[:1], packed[:S * 4], [1]) == 1 and len(lookups) == 6  # located once only
