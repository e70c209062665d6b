"""The disk KV tier's encoded blocks (format version 2): each value's low half stored raw, the high
halves zstd-compressed. Round trips in bf16, fp16 and fp32, the documented layout, the raw fallback,
both versions read by any store, the probe's KV bytes, and damaged or forged encoded files served as
misses."""

from __future__ import annotations

import struct
import zlib

import pytest
import torch
import xxhash
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from qml_runtime.kv import disk_store
from qml_runtime.kv.block_file import HEADER_SIZE, payload_offset
from qml_runtime.kv.disk_store import DiskStore
from tests.test_disk_store import FP, StoreMachine, key, no_fsync, payload, tokens  # noqa: F401  (no_fsync: a fixture)


def kv_page(seed: int, dtype=torch.bfloat16, n: int = 16384) -> torch.Tensor:
    """Values like a KV page's: Gaussian, at a few scales."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * torch.rand(n, generator=g) * 3).to(dtype)


def path_of(store: DiskStore, i: int):
    return store.dir / (key(i).hex() + disk_store.SUFFIX)


def resign(raw: bytearray) -> None:
    """Recompute a file's checksum and header CRC after editing it: a forged, 'valid' file."""
    raw[120:136] = xxhash.xxh3_128_digest(bytes(raw[140:]))
    raw[136:140] = zlib.crc32(bytes(raw[0:136])).to_bytes(4, "little")


@pytest.fixture
def encoding(tmp_path):
    s = DiskStore(tmp_path, FP, budget_bytes=1 << 24, element_size=2)
    yield s
    s.close()


@pytest.mark.parametrize("dtype, element_size", [(torch.bfloat16, 2), (torch.float16, 2), (torch.float32, 4)])
def test_encoded_round_trip_is_exact_and_smaller(tmp_path, dtype, element_size):
    store = DiskStore(tmp_path, FP, 1 << 24, element_size=element_size)
    try:
        kv = kv_page(1, dtype)
        raw_bytes = kv.numel() * kv.element_size()
        assert store.put(key(1), None, tokens(1), kv)
        back = torch.empty_like(kv)
        assert store.get_into(key(1), tokens(1), back) and torch.equal(back.view(torch.uint8), kv.view(torch.uint8))
        assert torch.equal(store.get(key(1), tokens(1)), kv.view(torch.uint8))
        s = store.stats()
        assert s["encoded_writes"] == 1 and s["kv_bytes_written"] == raw_bytes
        assert s["kv_bytes_read"] == 2 * raw_bytes  # get_into, then get
        size = path_of(store, 1).stat().st_size
        assert size == store.bytes_used == s["bytes_written"] < payload_offset(16) + raw_bytes / 1.1
    finally:
        store.close()


def test_encoded_file_layout_is_the_documented_one(encoding):
    """Pins version 2's payload (the module docstring): changing it needs a version bump."""
    kv = kv_page(2)
    encoding.put(key(2), key(1), tokens(2), kv)
    raw = path_of(encoding, 2).read_bytes()
    le = int.from_bytes
    off = payload_offset(16)
    assert raw[0:8] == b"QMLKVBLK" and le(raw[8:10], "little") == 2 and le(raw[10:12], "little") == 140
    assert le(raw[16:24], "little") == len(raw) - off  # payload_size: the stored bytes
    assert raw[120:136] == xxhash.xxh3_128_digest(raw[140:])
    codec, element_size, reserved, logical = struct.unpack_from("<HHIQ", raw, off)
    assert (codec, element_size, reserved, logical) == (1, 2, 0, kv.numel() * 2)
    x = kv.view(torch.int16).numpy().view("<u2")
    assert raw[off + 16:off + 16 + kv.numel()] == (x & 0xFF).astype("u1").tobytes()  # low halves, raw
    import zstandard

    frame = raw[off + 16 + kv.numel():]
    assert zstandard.ZstdDecompressor().decompress(frame) == (x >> 8).astype("u1").tobytes()


def test_what_the_codec_cannot_shrink_is_written_raw(encoding):
    noise = payload(3, 4096)  # uniform random bytes: the high halves do not compress
    assert encoding.put(key(3), None, tokens(3), noise)
    raw = path_of(encoding, 3).read_bytes()
    assert int.from_bytes(raw[8:10], "little") == 1 and raw[payload_offset(16):] == bytes(noise.numpy())
    assert encoding.stats()["encoded_writes"] == 0 and torch.equal(encoding.get(key(3), tokens(3)), noise)


def test_any_store_reads_both_versions(tmp_path):
    kv, noise = kv_page(4), payload(5, 4096)
    writer = DiskStore(tmp_path, FP, 1 << 24, element_size=2)
    writer.put(key(4), None, tokens(4), kv)
    writer.close()
    plain = DiskStore(tmp_path, FP, 1 << 24)  # writes raw, still reads version 2
    try:
        plain.put(key(5), None, tokens(5), noise)
        assert torch.equal(plain.get(key(4), tokens(4)), kv.view(torch.uint8))
        assert torch.equal(plain.get(key(5), tokens(5)), noise)
    finally:
        plain.close()


def test_the_probe_counts_the_kv_a_file_holds(encoding):
    kv = kv_page(6)
    encoding.put(key(6), None, tokens(6), kv)
    assert path_of(encoding, 6).stat().st_size < kv.numel() * 2
    assert encoding.cold_read(key(6)) == kv.numel() * 2
    encoding.put(key(7), None, tokens(7), payload(7, 4096))  # raw: the file's size
    assert encoding.cold_read(key(7)) == path_of(encoding, 7).stat().st_size


def test_a_buffer_of_the_wrong_size_is_the_callers_error(encoding):
    kv = kv_page(8)
    encoding.put(key(8), None, tokens(8), kv)
    with pytest.raises(ValueError, match="block's KV"):
        encoding.get_into(key(8), tokens(8), torch.empty(kv.numel() * 2 - 2, dtype=torch.uint8))
    assert key(8) in encoding  # the file is fine and stays


@pytest.mark.parametrize("damage", ["flipped frame byte", "flipped low-half byte", "truncated frame"])
def test_damaged_encoded_files_are_misses(encoding, damage):
    kv = kv_page(9)
    encoding.put(key(9), None, tokens(9), kv)
    path = path_of(encoding, 9)
    raw = bytearray(path.read_bytes())
    off = payload_offset(16)
    if damage == "flipped frame byte":
        raw[-10] ^= 0x40
    elif damage == "flipped low-half byte":
        raw[off + 16 + 5] ^= 0x01
    else:
        del raw[-100:]
    path.write_bytes(bytes(raw))
    assert encoding.get(key(9), tokens(9)) is None and not path.exists() and key(9) not in encoding
    assert encoding.stats()["corrupt_deleted"] == 1


@pytest.mark.parametrize("forgery", ["codec 7", "element size 3", "logical size too large",
                                     "logical size off by two", "frame garbage", "payload shorter than the codec header"])
def test_forged_encoded_files_are_misses_not_errors(encoding, forgery):
    """Files whose checksum and CRC are right but whose encoding is not: never an exception, never
    wrong KV."""
    kv = kv_page(10)
    encoding.put(key(10), None, tokens(10), kv)
    path = path_of(encoding, 10)
    raw = bytearray(path.read_bytes())
    off = payload_offset(16)
    logical = struct.unpack_from("<Q", raw, off + 8)[0]
    if forgery == "codec 7":
        struct.pack_into("<H", raw, off, 7)
    elif forgery == "element size 3":
        struct.pack_into("<H", raw, off + 2, 3)
    elif forgery == "logical size too large":
        struct.pack_into("<Q", raw, off + 8, 1 << 50)
    elif forgery == "logical size off by two":
        struct.pack_into("<Q", raw, off + 8, logical - 2)
    elif forgery == "frame garbage":
        raw[off + 16 + kv.numel():] = bytes(range(256)) * 4
    else:
        del raw[off + 8:]
    struct.pack_into("<Q", raw, 16, len(raw) - off)  # payload_size follows the edit
    resign(raw)
    path.write_bytes(bytes(raw))
    out = torch.empty(kv.numel() * 2, dtype=torch.uint8)
    if forgery == "logical size off by two":  # the caller's buffer no longer matches what the file says
        with pytest.raises(ValueError):
            encoding.get_into(key(10), tokens(10), out)
        assert encoding.get(key(10), tokens(10)) is None  # decoding the claimed size fails
    else:
        assert not encoding.get_into(key(10), tokens(10), out)
    assert not path.exists() and encoding.stats()["corrupt_deleted"] == 1


def test_an_unknown_element_size_is_refused(tmp_path):
    with pytest.raises(ValueError, match="element_size"):
        DiskStore(tmp_path, FP, 1 << 20, element_size=3)
    assert HEADER_SIZE == 140  # version 2 keeps version 1's header


class EncodedStoreMachine(StoreMachine):
    """test_disk_store's machine (put, get, damage, crash and restart, eviction) on encoded blocks,
    some of them too noisy to shrink (written raw beside them)."""

    ELEMENT_SIZE = 2

    @staticmethod
    def make_payload(i: int) -> torch.Tensor:
        if i == 3:
            return payload(i, 4000)  # uniform bytes: written as version 1
        return kv_page(i, n=500 + 700 * i).view(torch.uint8)


def test_encoded_state_machine():
    run_state_machine_as_test(EncodedStoreMachine, settings=settings(max_examples=100, stateful_step_count=20,
                                                                     deadline=None, database=None))
