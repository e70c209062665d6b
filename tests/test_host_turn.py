"""The host's per-turn work over a long history, in faster forms: the same answers as the plain ones.

(benchmarks/host_turn_cpu.py measures the time; these check the results.)
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from qml_kernels.attention import block_tables_tensor
from qml_runtime.engine_requests import _packed_ids
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


# --- a restore's pages: taken, its copy launched, then what they held forgotten ---


def _block_manager_with_history(retain_some: bool):
    """A pool of 12 pages: 9 named pages released (3 of them retained when ``retain_some``), 3 empty."""
    from qml_runtime.kv.block_manager import BlockManager

    blocks = BlockManager(12, S)
    table = []
    blocks.grow(table, 9 * S)
    blocks.register_run(table, [b"n%02d" % i for i in range(9)], pack(range(9 * S)))
    blocks.release(table[:6])
    blocks.release(table[6:], retain=retain_some)
    return blocks


@pytest.mark.parametrize("retain_some", [False, True])
def test_take_then_forget_leaves_what_grow_leaves(retain_some):
    def state(b):
        return (list(b._free), list(b._retained), list(b.ref), dict(b._by_name), list(b._name), list(b._packed))

    grown, taken = _block_manager_with_history(retain_some), _block_manager_with_history(retain_some)
    seen = []
    grown.on_evict = seen.extend
    table_a, table_b = [5], [5]  # (a cached page the tables hold already: not taken again)
    grown.acquire([5])
    taken.acquire([5])
    grown.grow(table_a, 12 * S)  # 11 more: the 3 empty ones, then named ones oldest first, the retained last
    evicted = taken.take(table_b, 12 * S)
    assert list(evicted) == seen and table_a == table_b
    assert all(taken.named(page) == (name, tokens) for page, name, tokens in evicted)  # still registered
    assert all(taken.ref[page] == 1 for page in table_b[1:])
    taken.forget(evicted)
    assert state(grown) == state(taken)
    with pytest.raises(MemoryError):
        taken.take([], S)  # nothing free: nothing taken
    assert state(grown) == state(taken)


def test_spill_first_waits_for_the_pump_now_and_leaves_the_host_recency_for_after_the_copy(monkeypatch):
    """Every evicted page in host RAM already: ``spill_first`` waits for the newest pump batch reading them (once)
    and changes nothing else; its rest makes their host entries the most recent, in order. Then the tiers are
    as ``spill`` page by page leaves them."""
    from qml_runtime.kv.block_manager import Evicted
    from qml_runtime.kv.cache import KVCache
    from qml_runtime.kv.host_tier import HostTier
    from qml_runtime.kv.tiers import KVTiers
    from qml_runtime.presets import PRESETS

    class Event:
        def query(self):
            return False

    waits = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: type(
        "Stream", (), {"wait_event": lambda self, e: waits[-1].append(e)})())

    def state(tiers):
        return (list(tiers.host._lru.items()), dict(tiers._deferred), list(tiers._pending),
                {page: batch for page, (batch, _) in tiers._saving.items()}, waits[-1] and len(waits[-1]))

    runs = []
    for first in (False, True):
        kv = KVCache(PRESETS["tiny-llama"].config, 8, 4, "cpu", torch.float32)
        tiers = KVTiers(kv, HostTier(kv.block_bytes, 8 * kv.block_bytes, pin=False), None)
        tiers.persist([(p, b"name-%d" % p, pack([p] * 4), None) for p in range(6)])  # in host RAM, copied
        old, new = Event(), Event()
        tiers._saving = {0: (1, old), 3: (2, new), 5: (2, new)}
        tiers._save_seq = 2
        evicted = Evicted([3, 0, 4], [b"name-%d" % p for p in (3, 0, 4)], [pack([p] * 4) for p in (3, 0, 4)])
        waits.append([])
        if first:
            before = state(tiers)[0]
            rest = tiers.spill_first(evicted)
            assert waits[-1] == [new] and state(tiers)[0] == before  # waited; the host order untouched
            rest()
        else:
            for page, name, tokens in evicted:
                tiers.spill(page, name, tokens)
        runs.append(state(tiers))
    assert runs[0] == runs[1]
    assert [name for name, _ in runs[1][0]][-3:] == [b"name-3", b"name-0", b"name-4"]
    assert runs[1][3] == {5: 2} and runs[1][4] == 1  # the pages evicted no longer wait for the pump


def test_a_restore_copies_into_its_pages_before_their_old_names_go():
    """The turn's copy from host RAM is launched while the pages it takes still carry the other conversation's
    names (their bookkeeping comes after it); once scheduled, those names are gone and the history's are there."""
    from qml_runtime.kv.prefix import chain

    rng = random.Random(3)
    history = [rng.randrange(512) for _ in range(5 * S + 3)]
    sched, kv = _scheduler_with_host_tier()
    _run(sched, history, b"a")
    _run(sched, [rng.randrange(512) for _ in range(8 * S)], b"other")  # the history goes to host RAM
    old_names = {page: sched.blocks.named(page) for page in range(sched.blocks.num_blocks)}
    upload, at_copy = sched.tiers._upload, []

    def recording(pages, sources, hold=False):
        at_copy.append((list(pages), [sched.blocks.named(page) for page in pages]))
        return upload(pages, sources, hold)

    sched.tiers._upload = recording
    seq = _run(sched, history + [1, 2], b"a")
    assert seq.num_cached == 5 * S and len(at_copy) == 1
    copied_into, named_then = at_copy[0]
    assert len(copied_into) == 5 and named_then == [old_names[page] for page in copied_into] and all(named_then)
    for page, name in zip(copied_into, chain(history, S, b"fp", b"a")):
        assert sched.blocks.named(page)[0] == name
    assert not {old_names[page][0] for page in copied_into} & set(sched.blocks._by_name)


def test_layer_groups_cover_every_layer_once_in_order():
    from qml_runtime.kv.host_restores import layer_groups

    assert layer_groups(4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert layer_groups(32, "halves") == [(0, 16), (16, 24), (24, 28), (28, 30), (30, 31), (31, 32)]
    assert layer_groups(3, "halves") == [(0, 1), (1, 2), (2, 3)]
    assert layer_groups(1, "halves") == [(0, 1)]
    assert layer_groups(6, "4, 4") == [(0, 4), (4, 6)]  # clipped at the last layer
    assert layer_groups(6, [2]) == [(0, 2), (2, 3), (3, 4), (4, 5), (5, 6)]  # the rest one a launch
    for n in range(1, 40):
        for sizes in ("", "halves", "3,1,7"):
            groups = layer_groups(n, sizes)
            assert [lo for lo, _ in groups] == [0] + [hi for _, hi in groups[:-1]] and groups[-1][1] == n
    with pytest.raises(ValueError):
        layer_groups(8, "4,0,4")


def test_the_restore_admit_benchmark_restores_the_history_and_marks_the_copy():
    """benchmarks/restore_admit_cpu.py on a small pool: the turn's history comes back from host RAM (its own
    assertion), the copy's mark falls inside the schedule, and nothing of it runs on a GPU."""
    import argparse
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import restore_admit_cpu

    args = argparse.Namespace(history=40 * S, new=5, blocks=48, chunk=256, repeats=1, layered=False)
    row = restore_admit_cpu.one_turn(args, random.Random(0))
    assert 0 < row["to_copy"] <= row["schedule"]


def test_the_restore_admit_benchmark_runs_the_gpu_path_with_stand_ins(monkeypatch):
    """``--layered``: the GPU's restore path (the staged one by default) runs on CPU up to its first copy, with
    CUDA's streams and events stood in for (put back after this test)."""
    import argparse
    import sys
    from pathlib import Path

    import qml_kernels.page_copy
    from qml_runtime.kv import dma, host_restores

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import restore_admit_cpu

    for obj, name in ((torch.cuda, "current_stream"), (torch.cuda, "stream"), (torch.cuda, "Event"),
                      (torch.cuda, "Stream"), (host_restores, "int64_rows"), (qml_kernels.page_copy, "page_copy"),
                      (dma, "copy_2d_to_device")):
        monkeypatch.setattr(obj, name, getattr(obj, name))  # (restored at the end, whatever the script sets)
    restore_admit_cpu.fake_cuda()
    args = argparse.Namespace(history=40 * S, new=5, blocks=48, chunk=256, repeats=1, layered=True)
    row = restore_admit_cpu.one_turn(args, random.Random(0))
    assert 0 < row["to_copy"] <= row["schedule"]


def test_int64_rows_is_torch_tensor_of_the_lists():
    from qml_runtime.kv.host_restores import int64_rows

    rng = random.Random(2)
    for n in (0, 1, 1700):
        rows = [[rng.randrange(2**40) for _ in range(n)] for _ in range(2)]
        assert torch.equal(int64_rows(*rows), torch.tensor(rows, dtype=torch.int64).view(2, n))
        assert torch.equal(int64_rows(rows[0]), torch.tensor(rows[:1], dtype=torch.int64).view(1, n))
    one = [5, 6]
    got = int64_rows(one)
    one.append(7)  # the tensor keeps its own copy of the ids
    assert got.tolist() == [[5, 6]]


@pytest.mark.parametrize("kind", ["list", "array"])
def test_token_ids_read_as_the_list_they_stand_for(kind):
    """``Sequence.token_ids``: the prompt kept as it came (a uint32 array stays one), the ids after it in a list;
    every read the engine makes (indices, slices, length, iteration) answers as the plain list would, and
    only ids after the prompt change."""
    from array import array

    from qml_runtime.sequence import TokenIds

    rng = random.Random(5)
    prompt = [rng.randrange(2**20) for _ in range(9)]
    ids, ref = TokenIds(array("I", prompt) if kind == "array" else prompt), list(prompt)
    prompt.append(1)  # the caller's list is not the sequence's
    for token in (7, -1, 8):  # (-1: the engine's placeholder)
        ids.append(token)
        ref.append(token)
    ids[-2] = ref[-2] = 5
    assert ids == ref and len(ids) == len(ref) and list(ids) == ref
    n = len(ref)
    for a in range(-n - 2, n + 3):
        if -n <= a < n:
            assert ids[a] == ref[a]
        for b in range(-n - 2, n + 3):
            for step in (None, 1, 3, -1):
                got = ids[a:b:step]
                assert got == ref[a:b:step] and type(got) is list
    assert ids + [4] == ref + [4] and [4] + ids == [4] + ref
    assert ids.pop() == ref.pop() and ids == ref
    with pytest.raises(IndexError):
        ids[0] = 3  # a prompt's ids do not change
    with pytest.raises(IndexError):
        ids[n]
    ids.pop(), ids.pop()
    with pytest.raises(IndexError):
        ids.pop()  # only ids after the prompt come off
    assert isinstance(ids._prompt, array) == (kind == "array")


def test_a_uint32_prompt_reaches_the_sequence_without_becoming_python_ints(engine):
    """The server's prompts come as uint32 arrays: the sequence keeps the array (no per-id int objects on the
    request's path), and the request answers as the same prompt given as a list does."""
    from array import array

    from qml_runtime.sampling_params import SamplingParams

    prompt = list(range(40, 90))
    params = SamplingParams(max_tokens=4, temperature=0.0)
    seq = engine._new_sequence(array("I", prompt), params, "r")
    assert isinstance(seq.token_ids._prompt, array) and seq.token_ids == prompt
    assert engine.generate_sync(array("I", prompt), params).token_ids == engine.generate_sync(prompt, params).token_ids
