"""The disk KV tier: round trips, restarts, every kind of damaged file, LRU by bytes, disk errors,
threads, kill -9 mid-write, and a Hypothesis state machine that interleaves all of them."""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import zlib
from contextlib import closing
from pathlib import Path

import pytest
import torch
import xxhash
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from qml_runtime.kv import disk_store
from qml_runtime.kv.block_file import ALIGN, HEADER_SIZE, payload_offset
from qml_runtime.kv.disk_store import DiskStore, StoreBusy

FP = hashlib.sha256(b"test-model/bf16/S16/L2/Hkv2/Dh8").digest()
PAYLOAD = 3000  # bytes; small, so that files are 4096 + 3000
FILE = ALIGN + PAYLOAD


def key(i: int) -> bytes:
    return hashlib.sha256(b"block %d" % i).digest()


def tokens(i: int) -> list[int]:
    return [i * 16 + j for j in range(16)]


def payload(i: int, size: int = PAYLOAD) -> torch.Tensor:
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i))


def store_files(store: DiskStore) -> set[str]:
    return {n for n in os.listdir(store.dir) if n.endswith(disk_store.SUFFIX)}


_REAL_FSYNC = os.fsync


@pytest.fixture(autouse=True)
def no_fsync(monkeypatch):
    """fsync costs 5-20 ms on a VM disk and nothing a test can observe without a power cut; the
    write protocol itself, with real fsyncs, is test_write_protocol_orders_fsync_rename_fsync."""
    monkeypatch.setattr(os, "fsync", lambda fd: None)


@pytest.fixture
def store(tmp_path):
    s = DiskStore(tmp_path, FP, budget_bytes=1 << 20)
    yield s
    s.close()


def test_round_trip(store):
    assert not store.contains(key(0)) and store.get(key(0), tokens(0)) is None
    assert store.put(key(0), None, tokens(0), payload(0))
    assert key(0) in store and len(store) == 1 and store.bytes_used == FILE
    assert torch.equal(store.get(key(0), tokens(0)), payload(0))
    out = torch.empty(PAYLOAD, dtype=torch.uint8)
    assert store.get_into(key(0), tokens(0), out) and torch.equal(out, payload(0))
    # any contiguous CPU tensor goes in and comes out as raw bytes (numpy has no bfloat16)
    kv = torch.randn(4, 16, 2, 8).to(torch.bfloat16)
    assert store.put(key(1), key(0), tokens(1), kv)
    back = torch.empty_like(kv)
    assert store.get_into(key(1), tokens(1), back) and torch.equal(back, kv)
    assert store.put(key(2), key(1), tokens(2), bytes(range(256)) * 3)
    assert bytes(store.get(key(2), tokens(2)).numpy()) == bytes(range(256)) * 3
    assert store.put(key(2), key(1), tokens(2), b"ignored: already stored")  # idempotent
    s = store.stats()
    assert (s["hits"], s["misses"], s["writes"], s["corrupt_deleted"]) == (4, 1, 3, 0)
    assert s["bytes_written"] == store.bytes_used


def test_wrong_arguments_raise(store):
    with pytest.raises(ValueError):
        store.put(b"short", None, tokens(0), payload(0))
    with pytest.raises(ValueError):
        store.put(key(0), None, tokens(0), torch.zeros(4, 4).t())  # not contiguous
    with pytest.raises(ValueError):
        store.put(key(0), None, [-1], payload(0))
    store.put(key(0), None, tokens(0), payload(0))
    with pytest.raises(ValueError):
        store.get_into(key(0), tokens(0), torch.empty(PAYLOAD + 1, dtype=torch.uint8))


def test_file_names_are_hex_digests_and_private(store):
    for i in range(3):
        store.put(key(i), None, tokens(i), payload(i))
    assert store.dir.name == FP[:8].hex()
    assert store_files(store) == {key(i).hex() + ".kvb" for i in range(3)}
    assert all(re.fullmatch(r"[0-9a-f]{64}\.kvb", n) for n in store_files(store))
    assert stat.S_IMODE(store.dir.stat().st_mode) == 0o700
    assert all(stat.S_IMODE((store.dir / n).stat().st_mode) == 0o600 for n in store_files(store))


def test_file_format_is_the_documented_one(store):
    """Pins the on-disk layout of the module docstring: changing it needs a version bump."""
    store.put(key(1), key(0), tokens(1), payload(1))
    raw = (store.dir / (key(1).hex() + ".kvb")).read_bytes()
    le = int.from_bytes
    assert raw[0:8] == b"QMLKVBLK" and le(raw[8:10], "little") == 1 and le(raw[10:12], "little") == 140
    assert le(raw[12:16], "little") == 16 and le(raw[16:24], "little") == PAYLOAD
    assert raw[24:56] == FP and raw[56:88] == key(1) and raw[88:120] == key(0)
    assert raw[120:136] == xxhash.xxh3_128_digest(raw[140:])
    assert le(raw[136:140], "little") == zlib.crc32(raw[0:136])
    assert [le(raw[140 + 4 * j:144 + 4 * j], "little") for j in range(16)] == tokens(1)
    assert raw[204:4096] == bytes(4096 - 204) and raw[4096:] == bytes(payload(1).numpy())


def test_write_protocol_orders_fsync_rename_fsync(store, monkeypatch):
    calls, real_rename = [], os.rename

    def fsync(fd):
        calls.append("fsync dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file")
        _REAL_FSYNC(fd)

    def rename(src, dst):
        calls.append("rename")
        assert str(src).endswith(".tmp") and os.path.getsize(src) == FILE  # complete before rename
        real_rename(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    assert store.put(key(0), None, tokens(0), payload(0))
    assert calls == ["fsync file", "rename", "fsync dir"]


def test_restart_finds_blocks_and_keeps_lru_order(tmp_path):
    with closing(DiskStore(tmp_path, FP, 3 * FILE)) as s:
        for i in range(3):
            s.put(key(i), None, tokens(i), payload(i))
        assert s.get(key(0), tokens(0)) is not None  # 0 is now the most recent; 1 the least
    with closing(DiskStore(tmp_path, FP, 3 * FILE)), pytest.raises(StoreBusy):  # one owner per directory
        DiskStore(tmp_path, FP, 3 * FILE)
    with closing(DiskStore(tmp_path, FP, 3 * FILE)) as s:
        assert len(s) == 3 and s.bytes_used == 3 * FILE
        assert s.put(key(3), None, tokens(3), payload(3))
        assert not s.contains(key(1)) and s.contains(key(0)) and s.contains(key(2))
        assert torch.equal(s.get(key(0), tokens(0)), payload(0))
    with closing(DiskStore(tmp_path, FP, FILE)) as s:  # a smaller budget applies at startup
        assert len(s) == 1 and s.contains(key(0))


def test_models_do_not_mix(tmp_path):
    other = hashlib.sha256(b"another model").digest()
    with closing(DiskStore(tmp_path, FP, 1 << 20)) as a, closing(DiskStore(tmp_path, other, 1 << 20)) as b:
        a.put(key(0), None, tokens(0), payload(0))
        assert not b.contains(key(0)) and b.get(key(0), tokens(0)) is None and a.dir != b.dir


def _corrupt(path, kind: str, seed: int = 0) -> None:
    data = bytearray(path.read_bytes())
    off = payload_offset(16)
    if kind == "truncated payload":
        del data[off + seed % (len(data) - off):]
    elif kind == "truncated header":
        del data[seed % HEADER_SIZE:]
    elif kind == "zero length":
        data.clear()
    elif kind == "appended byte":
        data.append(0)
    else:
        start, end = {"flipped payload byte": (off, len(data)), "flipped header byte": (0, HEADER_SIZE),
                      "flipped token or padding byte": (HEADER_SIZE, off)}[kind]
        data[start + seed % (end - start)] ^= 1 << (seed % 8)
    path.write_bytes(bytes(data))


CORRUPTIONS = ["truncated payload", "truncated header", "zero length", "appended byte",
               "flipped payload byte", "flipped header byte", "flipped token or padding byte"]


@pytest.mark.parametrize("restart", [False, True], ids=["while running", "after restart"])
@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_damaged_file_is_a_miss_and_is_deleted(tmp_path, kind, restart):
    s = DiskStore(tmp_path, FP, 1 << 20)
    s.put(key(0), None, tokens(0), payload(0))
    s.put(key(1), None, tokens(1), payload(1))
    path = s.dir / (key(0).hex() + ".kvb")
    _corrupt(path, kind, seed=12345)
    if restart:
        s.close()
        s = DiskStore(tmp_path, FP, 1 << 20)  # header damage is caught by the scan, the rest by get
    assert s.get(key(0), tokens(0)) is None
    assert not path.exists() and not s.contains(key(0)) and s.bytes_used == FILE
    assert s.stats()["corrupt_deleted"] == 1
    assert torch.equal(s.get(key(1), tokens(1)), payload(1))  # the neighbour is untouched
    assert s.put(key(0), None, tokens(0), payload(0)) and torch.equal(s.get(key(0), tokens(0)), payload(0))
    s.close()


def test_header_damage_at_every_offset_is_caught(tmp_path):
    with closing(DiskStore(tmp_path, FP, 1 << 20)) as s:
        for pos in range(HEADER_SIZE):
            s.put(key(0), None, tokens(0), payload(0))
            _corrupt(s.dir / (key(0).hex() + ".kvb"), "flipped header byte", seed=pos)
            assert s.get(key(0), tokens(0)) is None, pos
        assert s.stats()["corrupt_deleted"] == HEADER_SIZE


def test_wrong_fingerprint_in_same_directory(tmp_path):
    twin = FP[:8] + bytes(24)  # same directory, different model
    with closing(DiskStore(tmp_path, twin, 1 << 20)) as s:
        s.put(key(0), None, tokens(0), payload(0))
    with closing(DiskStore(tmp_path, FP, 1 << 20)) as s:
        assert len(s) == 0 and store_files(s) == set() and s.stats()["corrupt_deleted"] == 1
        assert s.put(key(0), None, tokens(0), payload(0)) and s.get(key(0), tokens(0)) is not None


def test_wrong_tokens_never_return_someone_elses_kv(store):
    store.put(key(0), None, tokens(0), payload(0))
    assert store.get(key(0), tokens(1)) is None  # as if two token blocks collided on one hash
    assert not store.contains(key(0)) and store_files(store) == set()
    assert store.put(key(0), None, tokens(0), payload(0)) and store.get(key(0), tokens(0)) is not None


def test_leftovers_in_the_directory(tmp_path):
    with closing(DiskStore(tmp_path, FP, 1 << 20)) as s:
        s.put(key(0), None, tokens(0), payload(0))
        d = s.dir
    (d / f".{key(1).hex()}.123-0.tmp").write_bytes(b"half a block")  # a crash mid-write
    (d / "notes.txt").write_text("not ours")
    os.symlink("/etc/passwd", d / (key(2).hex() + ".kvb"))
    with closing(DiskStore(tmp_path, FP, 1 << 20)) as s:
        assert not any(n.endswith(".tmp") for n in os.listdir(d))
        # files the store could not have written are left alone and not counted
        assert (d / "notes.txt").exists() and (d / (key(2).hex() + ".kvb")).is_symlink()
        assert len(s) == 1 and s.bytes_used == FILE and s.get(key(2), tokens(2)) is None
        assert s.put(key(3), None, tokens(3), payload(3)) and s.get(key(3), tokens(3)) is not None


def test_files_moved_or_swapped_behind_our_back(tmp_path):
    with closing(DiskStore(tmp_path, FP, 1 << 20)) as s:
        for i in range(3):
            s.put(key(i), None, tokens(i), payload(i))
        d = s.dir
        os.replace(d / (key(0).hex() + ".kvb"), d / (key(1).hex() + ".kvb"))  # a valid file, misnamed
        os.replace(d / (key(2).hex() + ".kvb"), tmp_path / "elsewhere")
        os.symlink(tmp_path / "elsewhere", d / (key(2).hex() + ".kvb"))
        assert s.get(key(2), tokens(2)) is None  # never reads through a link, even to a valid block
    with closing(DiskStore(tmp_path, FP, 1 << 20)) as s:
        assert len(s) == 0 and s.stats()["corrupt_deleted"] == 1


def test_file_deleted_behind_our_back(store):
    store.put(key(0), None, tokens(0), payload(0))
    os.unlink(store.dir / (key(0).hex() + ".kvb"))
    assert store.get(key(0), tokens(0)) is None and not store.contains(key(0)) and store.bytes_used == 0


def test_a_bad_read_never_deletes_a_fresh_copy(store):
    store.put(key(0), None, tokens(0), payload(0))
    path = store.dir / (key(0).hex() + ".kvb")
    stale_ino = path.stat().st_ino
    shutil.copy(path, path.with_suffix(".new"))
    os.replace(path.with_suffix(".new"), path)  # a writer renamed a fresh file in meanwhile
    store._discard(key(0), stale_ino, "the reader saw a damaged file")
    assert path.exists() and torch.equal(store.get(key(0), tokens(0)), payload(0))


def test_lru_eviction_by_bytes(tmp_path):
    with closing(DiskStore(tmp_path, FP, 3 * FILE + 100)) as s:
        for i in range(3):
            assert s.put(key(i), None, tokens(i), payload(i))
        assert s.get(key(0), tokens(0)) is not None  # reading 0 protects it
        assert s.put(key(3), None, tokens(3), payload(3))
        assert [s.contains(key(i)) for i in range(4)] == [True, False, True, True]
        big = payload(9, FILE + PAYLOAD)  # a file the size of two small ones
        assert s.put(key(9), None, tokens(9), big)
        assert [s.contains(key(i)) for i in (0, 2, 3, 9)] == [False, False, True, True]
        assert s.bytes_used <= s.budget_bytes and s.stats()["evictions"] == 3
        assert store_files(s) == {key(3).hex() + ".kvb", key(9).hex() + ".kvb"}


def test_block_larger_than_the_budget(tmp_path):
    with closing(DiskStore(tmp_path, FP, FILE - 1)) as s:
        assert not s.put(key(0), None, tokens(0), payload(0))
        assert os.listdir(s.dir) == [".lock"] and s.stats()["write_failures"] == 1
        assert s.put(key(1), None, tokens(1), b"small")
        assert not s.put(key(0), None, tokens(0), payload(0))
        assert s.contains(key(1))  # refused without evicting what was there


@pytest.mark.parametrize("failing", ["write", "fsync", "rename"])
def test_disk_full_is_a_failed_put_not_an_exception(store, monkeypatch, failing):
    store.put(key(0), None, tokens(0), payload(0))
    real_write = os.write

    def broken(*args, **kwargs):
        if failing == "write":  # the first bytes go out, then the disk is full
            real_write(args[0], bytes(args[1][:100]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as m:
        m.setattr(os, failing, broken)
        assert not store.put(key(1), None, tokens(1), payload(1))
    assert sorted(os.listdir(store.dir)) == [".lock", key(0).hex() + ".kvb"]  # no temp file left
    assert store.bytes_used == FILE and len(store) == 1 and store.stats()["write_failures"] == 1
    assert store.put(key(1), None, tokens(1), payload(1)) and store.get(key(1), tokens(1)) is not None


def test_concurrent_puts_and_gets(tmp_path):
    n_keys, errors = 40, []
    with closing(DiskStore(tmp_path, FP, 12 * FILE)) as s:  # evictions happen while readers read

        def writer(offset: int) -> None:
            for i in range(n_keys):
                j = (i + offset) % n_keys
                s.put(key(j), None, tokens(j), payload(j))

        def reader(offset: int) -> None:
            out = torch.empty(PAYLOAD, dtype=torch.uint8)
            for i in range(3 * n_keys):
                j = (i * 7 + offset) % n_keys
                got = s.get(key(j), tokens(j))
                if got is not None and not torch.equal(got, payload(j)):
                    errors.append(j)
                if s.get_into(key(j), tokens(j), out) and not torch.equal(out, payload(j)):
                    errors.append(j)

        threads = [threading.Thread(target=writer, args=(k * 10,)) for k in range(4)]
        threads += [threading.Thread(target=reader, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == [] and s.stats()["corrupt_deleted"] == 0
        assert s.bytes_used <= s.budget_bytes
        assert store_files(s) == {k.hex() + ".kvb" for k in s._index}
        assert s.bytes_used == sum(os.path.getsize(s.dir / n) for n in store_files(s))
        assert not any(n.endswith(".tmp") for n in os.listdir(s.dir))


_WRITER = """
import hashlib, sys
from qml_runtime.kv.disk_store import DiskStore
store = DiskStore(sys.argv[1], bytes.fromhex(sys.argv[2]), 1 << 30)
for i in range(10**6):
    store.put(hashlib.sha256(b"block %d" % i).digest(), None, [i], bytes([i % 251]) * 200_000)
    print(i, flush=True)
"""


def test_kill_9_mid_write_leaves_only_complete_blocks(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    child = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), FP.hex()], stdout=subprocess.PIPE,
                             env=env, text=True)
    for _ in range(20):  # let it get going, then kill it wherever it is
        child.stdout.readline()
    child.send_signal(signal.SIGKILL)
    child.wait()
    with closing(DiskStore(tmp_path, FP, 1 << 30)) as s:
        assert not any(n.endswith(".tmp") for n in os.listdir(s.dir))
        assert len(s) >= 20
        for i in range(len(s) + 5):
            got = s.get(key(i), [i])
            assert got is None or bytes(got.numpy()) == bytes([i % 251]) * 200_000
        assert s.stats()["corrupt_deleted"] == 0 and s.stats()["hits"] == len(s)


class StoreMachine(RuleBasedStateMachine):
    """Interleaves put/get/damage/crash/restart; the model is which blocks are known damaged."""

    KEYS = 4
    BUDGET = 3 * FILE  # less than the four blocks: eviction happens
    ELEMENT_SIZE = 0  # the store's encoding (test_disk_store_encoded runs the machine encoded too)

    def __init__(self):
        super().__init__()
        self.root = tempfile.mkdtemp()
        self.store = DiskStore(self.root, FP, self.BUDGET, element_size=self.ELEMENT_SIZE)
        self.payloads = {i: self.make_payload(i) for i in range(self.KEYS)}
        self.damaged: set[int] = set()

    @staticmethod
    def make_payload(i: int) -> torch.Tensor:
        return payload(i, 1 + 2000 * (i % 3))

    def _path(self, i: int):
        return self.store.dir / (key(i).hex() + ".kvb")

    @initialize()
    def fill(self):  # start from a full store, so that damage and eviction have work from step one
        for i in range(self.KEYS):
            assert self.store.put(key(i), None, tokens(i), self.payloads[i])

    @rule(i=st.integers(0, KEYS - 1))
    def put_then_get(self, i):
        fresh = not self.store.contains(key(i))
        ok = self.store.put(key(i), None, tokens(i), self.payloads[i])
        if fresh:
            self.damaged.discard(i)
        got = self.store.get(key(i), tokens(i))
        if i in self.damaged:  # put only refreshed the damaged file; the read finds it out
            assert got is None
            self.damaged.discard(i)
        else:  # every block fits the budget and the disk works, so a put must succeed
            assert ok and got is not None and torch.equal(got, self.payloads[i])

    @rule(i=st.integers(0, KEYS - 1))
    def get(self, i):
        got = self.store.get(key(i), tokens(i))
        if i in self.damaged:
            assert got is None
            self.damaged.discard(i)
        assert got is None or torch.equal(got, self.payloads[i])

    @rule(i=st.integers(0, KEYS - 1), j=st.integers(1, KEYS - 1))
    def get_with_other_tokens(self, i, j):
        assert self.store.get(key(i), tokens((i + j) % self.KEYS)) is None
        self.damaged.discard(i)  # the file is gone now

    @rule(n=st.integers(0, KEYS - 1), kind=st.sampled_from(CORRUPTIONS), seed=st.integers(0, 1 << 16))
    def damage(self, n, kind, seed):
        intact = [i for i in range(self.KEYS) if self._path(i).exists() and i not in self.damaged]
        if intact:  # _corrupt expects an intact file
            i = intact[n % len(intact)]
            _corrupt(self._path(i), kind, seed)
            self.damaged.add(i)

    @rule(leftover=st.booleans())
    def crash_and_restart(self, leftover):
        if leftover:  # killed mid-write
            (self.store.dir / f".{key(0).hex()}.999-0.tmp").write_bytes(b"\x00" * 10)
        self.store.close()
        self.store = DiskStore(self.root, FP, self.BUDGET, element_size=self.ELEMENT_SIZE)
        assert not any(n.endswith(".tmp") for n in os.listdir(self.store.dir))
        assert self.store.bytes_used == sum(os.path.getsize(self.store.dir / n) for n in store_files(self.store))

    @invariant()
    def index_matches_directory(self):
        assert self.store.bytes_used <= self.BUDGET
        assert store_files(self.store) == {k.hex() + ".kvb" for k in self.store._index}

    def teardown(self):
        self.store.close()
        shutil.rmtree(self.root)


def test_state_machine():
    run_state_machine_as_test(StoreMachine, settings=settings(max_examples=150, stateful_step_count=20,
                                                              deadline=None, database=None))


def test_the_planner_rates_file_is_left_alone_by_the_scan(tmp_path, caplog):
    from qml_runtime.kv.disk_store import RATES_NAME

    with closing(DiskStore(tmp_path, FP, 3 * FILE)) as s:
        s.put(key(0), None, tokens(0), payload(0))
        (s.dir / RATES_NAME).write_text("{}")
        (s.dir / "stranger.txt").write_text("x")
    with caplog.at_level("WARNING"), closing(DiskStore(tmp_path, FP, 3 * FILE)) as s:
        assert len(s) == 1 and (s.dir / RATES_NAME).exists()
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "stranger.txt" in warned and RATES_NAME not in warned
