"""``qml_kernels.kv_codec``: the lossless bf16 codec of KV chunks in host rows. The format in PyTorch round
trips every bit pattern and shrinks KV-like values; the kernels (``kv_save`` / ``kv_load``) agree with it bit
for bit in the interpreter on CPU (integer operations only, so bf16 is safe there) and compile for Hopper."""

from __future__ import annotations

import threading

import pytest
import torch

from qml_kernels import kv_codec
from qml_kernels.kv_codec import (
    COMPRESSED_BYTES,
    SEGMENT,
    KVCodecConfig,
    _kv_load_kernel,
    _kv_save_kernel,
    codec_applies,
    decode_chunks_ref,
    encode_chunks_ref,
    encoded_chunk_bytes,
    header_bytes,
    kv_load_ref,
    kv_load_triton,
    kv_save_ref,
    kv_save_triton,
    kv_values,
)
from qml_kernels.workbench import check

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CONFIGS = {"default": None, "two-programs": KVCodecConfig(num_programs=2, num_warps=1, segments=1),
           "two-segments-a-step": KVCodecConfig(segments=2)}


def _bits(values: torch.Tensor) -> torch.Tensor:
    return values.view(torch.int16)


def test_every_bit_pattern_round_trips():
    gen = torch.Generator().manual_seed(1)
    bits = torch.randint(-2**15, 2**15, (6, 2048), dtype=torch.int32, generator=gen).to(torch.int16)
    special = torch.tensor([0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC1, 0x0001, 0x807F, 0x3F80], dtype=torch.int32)
    bits[0, :8] = special.to(torch.int16)  # zeros, infinities, a NaN, subnormals, 1.0
    values = bits.view(torch.bfloat16)
    assert torch.equal(_bits(decode_chunks_ref(encode_chunks_ref(values), 2048)), bits)


@pytest.mark.parametrize("scale", [1e-3, 1.0, 40.0])
def test_kv_like_values_round_trip_and_shrink_by_a_quarter(scale):
    gen = torch.Generator().manual_seed(2)
    values = (scale * torch.randn(32, 16384, generator=gen)).to(torch.bfloat16)  # one Llama-3.1-8B chunk each
    encoded = encode_chunks_ref(values)
    assert encoded.shape == (32, encoded_chunk_bytes(16384)) and header_bytes(16384) == 32
    assert torch.equal(_bits(decode_chunks_ref(encoded, 16384)), _bits(values))
    raw = encoded[:, :16384 // SEGMENT].float().mean().item()
    assert raw < 0.05  # a segment is raw when a group of 32 normal values spans > 15 exponents: rare
    read = header_bytes(16384) + (16384 // SEGMENT) * (raw * 1024 + (1 - raw) * COMPRESSED_BYTES)
    assert read / (2 * 16384) < 0.78


def test_a_segment_with_a_zero_among_normal_values_stays_raw_and_exact():
    values = torch.randn(2, 1024, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    values[0, 700] = 0.0  # in segment 1 of chunk 0
    encoded = encode_chunks_ref(values)
    assert encoded[0, :2].tolist() == [0, 1] and encoded[1, :2].tolist() == [0, 0]
    hdr = header_bytes(1024)
    assert torch.equal(encoded[0, hdr + 1024:hdr + 2048], values[0, 512:].contiguous().view(torch.uint8))
    assert torch.equal(_bits(decode_chunks_ref(encoded, 1024)), _bits(values))


def test_a_changed_offset_changes_the_value_it_belongs_to():
    values = torch.randn(1, 512, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    encoded = encode_chunks_ref(values)
    assert encoded[0, 0] == 0  # compressed
    hdr = header_bytes(512)
    encoded[0, hdr + 528 + 5] ^= 0x10  # the offset of value 11 (odd: the high nibble of byte 5)
    back = decode_chunks_ref(encoded, 512)
    changed = (_bits(back) != _bits(values)).nonzero()[:, 1].tolist()
    assert changed == [11]


def test_the_codec_applies_to_bf16_chunks_of_whole_segments():
    assert codec_applies(torch.bfloat16, 16384) and codec_applies(torch.bfloat16, 3072)  # Llama, SmolLM2
    assert not codec_applies(torch.float16, 16384) and not codec_applies(torch.float32, 16384)
    assert not codec_applies(torch.bfloat16, 1000)
    with pytest.raises(AssertionError):
        encode_chunks_ref(torch.zeros(2, 1000, dtype=torch.bfloat16))


# --- the kernels ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_load_matches_reference(config):
    report = check("kv_load", "triton", dtypes=[torch.bfloat16], device=DEVICE, config=config)
    report.raise_if_failed()


def _case(seed: int, C=4, P=7, W=1536, N=6):
    gen = torch.Generator().manual_seed(seed)
    pool = kv_values((C, P, W), gen).to(DEVICE)
    rows = encode_chunks_ref(kv_values((N, C, W), gen))
    if DEVICE.type == "cuda":
        rows = rows.pin_memory()
    return pool, rows


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("chunks", [(0, 4), (1, 3)])
def test_save_matches_reference_byte_for_byte(config, chunks):
    pool, rows = _case(3)
    want = rows.clone()
    pages = torch.tensor([6, 0, 2], device=DEVICE)
    slots = torch.tensor([5, 1, 3], device=DEVICE)
    kv_save_ref(want, slots.cpu(), pool.cpu(), pages.cpu(), *chunks)
    kv_save_triton(rows, slots, pool, pages, *chunks, config=config)
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(rows, want)  # (both leave the unused bytes of compressed segments as they were)
    raw = want[slots.cpu().long(), chunks[0]:chunks[1], :3]
    assert 0 < raw.sum() < raw.numel()  # both forms were written


def test_save_then_load_round_trips_pages_through_other_slots():
    pool, rows = _case(4)
    pages, slots = torch.tensor([1, 4, 5], device=DEVICE), torch.tensor([2, 0, 4], device=DEVICE)
    before = pool.clone()
    kv_save_triton(rows, slots, pool, pages)
    back = torch.tensor([6, 0, 3], device=DEVICE)
    kv_load_triton(pool, back, rows, slots)
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    for src, dst in zip(pages.tolist(), back.tolist()):
        assert torch.equal(_bits(pool[:, dst]), _bits(before[:, src])), (src, dst)
    for page in (2,):  # pages not named keep their values
        assert torch.equal(_bits(pool[:, page]), _bits(before[:, page]))


def test_load_writes_only_its_pages_and_chunks():
    pool, rows = _case(5)
    before = pool.clone()
    pages, slots = torch.tensor([3], device=DEVICE), torch.tensor([1], device=DEVICE)
    kv_load_triton(pool, pages, rows, slots, 1, 3)
    want = kv_load_ref(before.clone().cpu(), pages.cpu(), rows.cpu(), slots.cpu(), 1, 3)
    assert torch.equal(_bits(pool.cpu()), _bits(want))
    assert torch.equal(_bits(pool[0]), _bits(before[0])) and torch.equal(_bits(pool[:, 2]), _bits(before[:, 2]))


def test_bad_arguments_are_refused_before_a_launch():
    pool = torch.zeros(4, 6, 512, dtype=torch.bfloat16)
    rows = torch.zeros(3, 4, encoded_chunk_bytes(512), dtype=torch.uint8)
    pages, slots = torch.tensor([1, 2]), torch.tensor([0, 1])
    with pytest.raises(AssertionError):
        kv_load_ref(pool.half(), pages, rows, slots)  # bf16 (fp32: the workbench's upcast)
    with pytest.raises(AssertionError):
        kv_load_triton(pool.float(), pages, rows, slots)  # the kernels: bf16 only
    with pytest.raises(AssertionError):
        kv_load_ref(pool, pages, rows[..., :-16], slots)  # rows of another width
    with pytest.raises(AssertionError):
        kv_save_ref(rows, slots[:1], pool, pages)  # a slot per page
    with pytest.raises(AssertionError):
        kv_save_ref(rows, slots, pool, pages, 2, 5)  # past the last chunk
    for bad in (dict(num_programs=0), dict(segments=3), dict(num_warps=0)):
        with pytest.raises(ValueError):
            KVCodecConfig(**bad)


def test_the_load_step_divides_the_chunks_segments():
    assert KVCodecConfig().step(16384) == 4 and KVCodecConfig(segments=64).step(16384) == 32  # Llama: 32
    assert KVCodecConfig().step(3072) == 2  # SmolLM2: 6 segments, steps of 2
    assert KVCodecConfig(segments=8).step(512) == 1


def test_the_load_reads_a_compressed_segment_as_784_bytes():
    spec = kv_codec.KV_LOAD_SPEC
    gen = torch.Generator().manual_seed(6)
    inputs = spec.make_inputs(spec.cases[0], torch.bfloat16, torch.device("cpu"), gen)
    W, n = inputs["pool"].shape[2], inputs["slots"].numel()
    raw = inputs["rows"][inputs["slots"].long(), :, 0].long()  # W = one segment: one flag a chunk
    want = int((header_bytes(W) + raw * 1024 + (1 - raw) * 784).sum()) + n * inputs["pool"].shape[0] * W * 2
    assert spec.bytes_moved(inputs) == want


# -- compilation for the H200 (sm_90a) -------------------------------------------------------------------

def _variant(kernel, width: int, config: KVCodecConfig) -> dict:
    signature = {"pool_ptr": "*i16", "rows_ptr": "*u8", "rows16_ptr": "*i16", "pages_ptr": "*i64",
                 "slots_ptr": "*i64", "n_items": "i32", "chunk_lo": "i32", "n_chunks": "i32", "num_programs": "i32",
                 "stride_pool_chunk": "i64", "stride_pool_page": "i32", "stride_row": "i32",
                 "stride_row_chunk": "i32", "W": "constexpr", "HDR": "constexpr"}
    constexprs = {"W": width, "HDR": header_bytes(width)}
    if kernel is _kv_load_kernel:
        signature["SEGS"] = "constexpr"
        constexprs["SEGS"] = config.step(width)
    return {"kernel": kernel, "signature": signature, "constexprs": constexprs,
            "num_warps": config.num_warps, "num_stages": 1,
            "divisible": ("stride_pool_chunk", "stride_pool_page", "stride_row", "stride_row_chunk")}


COMPILE_VARIANTS = {
    "load-llama-pages": _variant(_kv_load_kernel, 16384, KVCodecConfig()),
    "save-llama-pages": _variant(_kv_save_kernel, 16384, KVCodecConfig(num_programs=16)),
    "load-qwen3-moe-pages": _variant(_kv_load_kernel, 8192, KVCodecConfig(num_warps=8, segments=8)),
    "load-one-segment-a-step": _variant(_kv_load_kernel, 16384, KVCodecConfig(segments=1)),
}


@pytest.mark.parametrize("name", COMPILE_VARIANTS)
def test_compiles_for_hopper(compile_reports, name):
    report = compile_reports[name]
    assert report.ok, report.error


def test_a_group_spanning_15_exponents_is_compressed_and_16_raw():
    """The boundary of the four-bit offsets, in the reference and in the kernels."""
    values = torch.ones(1, 3, 1024, dtype=torch.bfloat16)  # chunk c: two segments
    values[0, 0, 40], values[0, 0, 41] = 2.0**-7, 2.0**8  # exponents 120 and 135 in group 1 of segment 0: 15
    values[0, 1, 600], values[0, 1, 601] = 2.0**-8, 2.0**8  # 119 and 135 in a group of segment 1: 16
    values[0, 2, 999] = -(2.0**-8) * 1.5  # 119 beside the ones' 127: 8, and a sign and mantissa
    encoded = encode_chunks_ref(values)
    assert encoded[0, :, :2].tolist() == [[0, 0], [0, 1], [0, 0]]
    assert torch.equal(_bits(decode_chunks_ref(encoded, 1024)), _bits(values))
    pool = values[0].unsqueeze(1).to(DEVICE)  # [C=3, P=1, W]
    rows = torch.zeros(2, 3, encoded_chunk_bytes(1024), dtype=torch.uint8)
    if DEVICE.type == "cuda":
        rows = rows.pin_memory()
    zero = torch.tensor([0], device=DEVICE)
    one = torch.tensor([1], device=DEVICE)
    kv_save_triton(rows, one, pool, zero)
    want = kv_save_ref(torch.zeros_like(rows.cpu()), one.cpu(), pool.cpu(), zero.cpu())
    back = torch.zeros_like(pool)
    kv_load_triton(back, zero, rows, one)
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(rows.cpu(), want)
    assert torch.equal(_bits(back), _bits(pool))


# --- the pool's rows in the codec's form (``KVCache(codec=True)``) ------------------------------------------

def _pool(codec: bool, dtype=torch.bfloat16):
    from qml_runtime.kv.cache import KVCache
    from qml_runtime.presets import PRESETS

    kv = KVCache(PRESETS["tiny-llama"].config, 9, 16, DEVICE, dtype, codec=codec)  # 16-token pages: W = 512
    kv.data.copy_(kv_values(tuple(kv.data.shape), torch.Generator().manual_seed(9)).to(DEVICE))
    return kv


def test_the_pools_rows_take_the_codecs_form_only_where_it_applies():
    kv, raw, fp32 = _pool(True), _pool(False), _pool(True, torch.float32)
    assert kv.codec and not raw.codec and not fp32.codec
    C, W = 2 * kv.data.shape[0], kv.data[0, 0, 0].numel()
    assert kv.row_bytes == C * encoded_chunk_bytes(W) and raw.row_bytes == raw.block_bytes == kv.block_bytes
    pool, table = kv.chunk_views(torch.zeros(3, kv.row_bytes, dtype=torch.uint8))
    assert pool.shape == (C, 9, W) and table.shape == (3, C, encoded_chunk_bytes(W)) and table.dtype == torch.uint8


def test_gathered_rows_scatter_back_into_other_pages_and_read_page_is_their_row():
    kv = _pool(True)
    before = kv.data.clone()
    pages = torch.tensor([7, 2, 5, 0], device=DEVICE)
    rows = kv.gather_pages(pages)  # encoded, several at once
    assert rows.shape == (4, kv.row_bytes)
    one = torch.zeros(kv.row_bytes, dtype=torch.uint8)
    kv.read_page(2, one)
    chunk = encoded_chunk_bytes(kv.data[0, 0, 0].numel())
    flags = rows[1].view(-1, chunk)[:, :1].cpu()
    assert torch.equal(flags, one.view(-1, chunk)[:, :1])  # the same forms (the unused bytes may differ)
    kv.scatter_pages(torch.tensor([1, 3, 4, 6], device=DEVICE), rows)
    kv.write_page(8, one)
    for src, dst in ((7, 1), (2, 3), (5, 4), (0, 6), (2, 8)):
        assert torch.equal(_bits(kv.data[:, :, dst]), _bits(before[:, :, src])), (src, dst)


# --- in the engine (CPU, tiny-llama in bf16, QML_KV_CODEC=1) -------------------------------------------------

def _engine(monkeypatch, disk_dir, codec: bool, caching: bool = True):
    from qml_runtime.loader import load_engine

    monkeypatch.setenv("QML_KV_CODEC", "1" if codec else "0")
    # ~13 pages of GPU KV: a second conversation pushes the first into host RAM
    eng = load_engine("preset:tiny-llama", device="cpu", dtype="bfloat16", random_weights=True,
                      kv_cache_gib=13 * 16 * 6 * 2 * 2 * 16 / 2**30, kv_host_gib=0.01, kv_disk_dir=str(disk_dir),
                      kv_disk_gib=0.05, enable_prefix_caching=caching, cuda_graphs=False, max_model_len=192)
    eng.start()
    return eng


def test_a_history_restored_through_the_codec_from_host_ram_and_from_disk_gives_the_same_tokens(monkeypatch,
                                                                                                  tmp_path):
    from qml_runtime.sampling_params import SamplingParams

    greedy = SamplingParams(max_tokens=8, temperature=0)
    first = list(range(20, 140))  # 120 ids: 7 full pages
    other = list(range(380, 500))[::-1]  # (the vocabulary is 512)
    plain = _engine(monkeypatch, tmp_path / "plain", codec=False, caching=False)
    try:
        answer = plain.generate_sync(first, greedy).token_ids
        turn = first + answer + [5, 6, 7, 8]
        want = plain.generate_sync(turn, greedy).token_ids
    finally:
        plain.shutdown()
    eng = _engine(monkeypatch, tmp_path / "store", codec=True)
    try:
        assert eng.kv.codec and eng.tiers.host.block_bytes == eng.kv.row_bytes != eng.kv.block_bytes
        assert eng.generate_sync(first, greedy).token_ids == answer
        eng.generate_sync(other, greedy)  # pushes the first conversation's pages into host RAM
        got = eng.generate_sync(turn, greedy)
        assert eng.tiers.stats.restored_host > 0 and got.cached_tokens >= 7 * 16
        assert got.token_ids == want
    finally:
        eng.shutdown()
    restarted = _engine(monkeypatch, tmp_path / "store", codec=True)  # the same store: the rows on disk
    try:
        # the rows must come from disk: the plan is pinned to reading them. The start-up probe reads this tiny
        # store's files (12 KiB a page) cold, at a rate their opens decide, and on a busy 2-core CI machine it
        # once measured the disk slower than recomputing the 8 pages (a "recompute" plan, nothing read)
        for probe in [t for t in threading.enumerate() if t.name == "qml-kv-probe"]:
            probe.join()
        restarted.tiers.planner.alpha = 0.0  # (rates held fixed from here)
        restarted.tiers.planner.disk_bytes_per_s = 1e12
        got = restarted.generate_sync(turn, greedy)
        assert restarted.tiers.stats.restored_disk > 0 and got.cached_tokens > 0
        assert got.token_ids == want
    finally:
        restarted.shutdown()


@pytest.mark.parametrize("segments", [2, 4])
def test_load_decodes_several_segments_a_step(segments):
    pool, rows = _case(10, W=2048)  # four segments a chunk, some raw
    assert KVCodecConfig(segments=segments).step(2048) == segments
    pages, slots = torch.tensor([4, 1, 6], device=DEVICE), torch.tensor([0, 5, 2], device=DEVICE)
    want = kv_load_ref(pool.clone().cpu(), pages.cpu(), rows.cpu(), slots.cpu())
    kv_load_triton(pool, pages, rows, slots, config=KVCodecConfig(segments=segments))
    assert torch.equal(_bits(pool.cpu()), _bits(want))
    raw = rows[slots.cpu().long(), :, :4]
    assert 0 < raw.sum() < raw.numel()  # both forms in the pages read
