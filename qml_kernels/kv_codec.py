"""A lossless codec for bf16 KV pages in host RAM: fewer bytes over the host link, the same bits back.

A restore from host RAM moves the history over the link at ~50 GB/s (H200): 3.58 GB of Llama-3.1-8B KV
for a 27k-token history is ~71 ms, the whole host-RAM turn. The KV itself carries less than its 16 bits an
element. In a bf16 value (sign, 8 exponent bits, 7 mantissa bits) the mantissa is noise, but the exponents
of neighbouring values cluster: SmolLM2's KV after a 2.8k-token prompt had 2.94 bits of entropy in its
exponents, and in 99.8% of groups of 32 consecutive values (along a head's dimensions) the exponents
spanned at most 15 (zstd over the whole KV: 77.6%).

So a group of 32 values keeps its smallest exponent once (one byte) and each value keeps its sign and
mantissa (one byte) and its exponent's offset from that base (four bits): 12.25 bits a value, 76.6% of the
bytes. A segment of 512 values (16 groups) where any group spans more than 15 exponents is kept raw (flag 1);
so is a zero, whose exponent is 0, beside others (rare in KV).

Layout of one chunk of W values (a page's K or V of one layer, the unit ``page_copy`` moves), W a multiple
of 512, ``encoded_chunk_bytes(W)`` bytes:

    [flags: one byte per segment, padded to 16 bytes] [segment 0: 1024 bytes] [segment 1] ...
    compressed segment: [0:16) bases, [16:528) sign | mantissa bytes, [528:784) offsets, two a byte (low
                        nibble: the even value), [784:1024) unused: never written, never read
    raw segment:        [0:1024) the 512 values' bf16 bytes

Each segment keeps its raw size in the row, so a row has fixed offsets (a host slot's size barely changes:
+16 bytes a chunk); only the bytes read cross the link: ``kv_load`` reads a compressed segment's 784 bytes,
not its 1024. Other dtypes, and chunks whose W is not a multiple of 512, are not encoded (``codec_applies``).

- ``kv_save``: pool pages into encoded host rows (on the GPU, stored in place into pinned memory, as
  ``page_save`` does; the segment's exponent ranges decide its flag);
- ``kv_load``: encoded host rows (read in place from pinned memory) into pool pages, as ``page_copy`` does;
- ``encode_chunks_ref`` / ``decode_chunks_ref``: the format in PyTorch (the CPU's path and every check).

The runtime keeps its tiers' rows in this form with ``QML_KV_CODEC=1`` (``KVCache(codec=True)``). Off by
default: measured in the engine on the H200, a 27k-token host-RAM turn took 85.7-96.5 ms with it against
81.1-81.8 without (``benchmarks/results/turn-h200-2026-12-05.md``): with ~77% of the bytes over the link the
decode, not the link, sets the pace.

Sources: the bf16 format (IEEE 754 binary32's upper half); the measurement above (``notebooks/06_kv_store``
and the note of session 22); the zero-copy copy kernels of ``qml_kernels.page_copy``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from qml_kernels.registry import dispatch, register
from qml_kernels.workbench.spec import Case, OpSpec, register_spec

SEGMENT = 512  # values a segment
GROUP = 32  # values sharing a base exponent
SEGMENT_BYTES = 2 * SEGMENT  # a segment's room in the row: its raw size
COMPRESSED_BYTES = SEGMENT // GROUP + SEGMENT + SEGMENT // 2  # 784: bases, sign | mantissa, offsets
_SM, _NIB = SEGMENT // GROUP, SEGMENT // GROUP + SEGMENT  # where the sign | mantissa bytes and offsets start


def header_bytes(width: int) -> int:
    """The flags of a chunk of ``width`` values, padded to 16 bytes (segments stay 16-byte aligned)."""
    return -(-(width // SEGMENT) // 16) * 16


def encoded_chunk_bytes(width: int) -> int:
    return header_bytes(width) + 2 * width


def codec_applies(dtype: torch.dtype, width: int) -> bool:
    """bf16 chunks of whole segments; anything else is kept raw."""
    return dtype == torch.bfloat16 and width > 0 and width % SEGMENT == 0


def _check_width(width: int) -> int:
    assert width % SEGMENT == 0 and width > 0, f"the codec takes chunks of whole {SEGMENT}-value segments, got {width}"
    return width // SEGMENT


# --- the format in PyTorch ---------------------------------------------------------------------------

def encode_chunks_ref(values: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 ``values`` [..., W] -> encoded chunks uint8 [..., encoded_chunk_bytes(W)]. ``out`` (optional, the
    rows written): the unused bytes of compressed segments keep what ``out`` held."""
    assert values.dtype == torch.bfloat16, f"the codec encodes bf16, got {values.dtype}"
    *lead, W = values.shape
    nseg, hdr = _check_width(W), header_bytes(W)
    bits = values.reshape(-1, nseg, SEGMENT // GROUP, GROUP).view(torch.int16).to(torch.int32) & 0xFFFF
    M = bits.shape[0]
    exps = (bits >> 7) & 0xFF
    base = exps.amin(-1)  # [M, nseg, 16]
    raw = (exps.amax(-1) - base).amax(-1) > 15  # [M, nseg]
    offsets = (exps - base[..., None]).reshape(M, nseg, SEGMENT)
    if out is None:
        out = torch.zeros(*lead, hdr + 2 * W, dtype=torch.uint8, device=values.device)
    assert out.shape == (*lead, hdr + 2 * W) and out.dtype == torch.uint8, (tuple(out.shape), out.dtype)
    rows = out.view(M, hdr + 2 * W)
    rows[:, :nseg] = raw.to(torch.uint8)
    segs = rows[:, hdr:].view(M, nseg, SEGMENT_BYTES)
    comp = segs.clone()
    comp[..., :_SM] = base.to(torch.uint8)
    comp[..., _SM:_NIB] = (((bits >> 8) & 0x80) | (bits & 0x7F)).reshape(M, nseg, SEGMENT).to(torch.uint8)
    comp[..., _NIB:COMPRESSED_BYTES] = (offsets[..., 0::2] | (offsets[..., 1::2] << 4)).to(torch.uint8)
    whole = values.reshape(M, nseg, SEGMENT).contiguous().view(torch.uint8)  # little-endian bf16 bytes
    segs.copy_(torch.where(raw[..., None], whole, comp))
    return out


def decode_chunks_ref(encoded: torch.Tensor, width: int) -> torch.Tensor:
    """Encoded chunks uint8 [..., encoded_chunk_bytes(width)] -> bf16 [..., width]."""
    *lead, E = encoded.shape
    nseg, hdr = _check_width(width), header_bytes(width)
    assert E == hdr + 2 * width and encoded.dtype == torch.uint8, (E, encoded.dtype)
    rows = encoded.reshape(-1, E)
    M = rows.shape[0]
    raw = rows[:, :nseg].bool()
    segs = rows[:, hdr:].reshape(M, nseg, SEGMENT_BYTES).to(torch.int32)
    base = segs[..., :_SM].repeat_interleave(GROUP, -1)  # [M, nseg, 512]
    sm = segs[..., _SM:_NIB]
    nib = segs[..., _NIB:COMPRESSED_BYTES]
    offsets = torch.stack((nib & 0xF, nib >> 4), -1).reshape(M, nseg, SEGMENT)
    bits = ((sm & 0x80) << 8) | ((base + offsets) << 7) | (sm & 0x7F)
    comp = bits.to(torch.int16).view(torch.bfloat16)  # (int32 -> int16 keeps the low 16 bits)
    whole = rows[:, hdr:].reshape(M, nseg, SEGMENT_BYTES).contiguous().view(torch.bfloat16)
    return torch.where(raw[..., None], whole, comp).reshape(*lead, width)


def kv_save_ref(rows: torch.Tensor, slots: torch.Tensor, pool: torch.Tensor, pages: torch.Tensor,
                chunk_lo: int = 0, chunk_hi: int | None = None, config: KVCodecConfig | None = None) -> torch.Tensor:
    """``rows[slots[i], c] = encode(pool[c, pages[i]])`` for every i and ``chunk_lo <= c < chunk_hi``; returns
    rows (uint8 [N, C, encoded_chunk_bytes(W)]); the unused bytes of compressed segments are left as they were."""
    chunk_hi = pool.shape[0] if chunk_hi is None else chunk_hi
    _check(pool, pages, rows, slots, chunk_lo, chunk_hi)
    if pages.numel() == 0 or chunk_lo == chunk_hi:
        return rows
    index = slots.to(rows.device).long()
    values = pool[chunk_lo:chunk_hi, pages.to(pool.device).long()].transpose(0, 1).to(rows.device, torch.bfloat16)
    rows[index, chunk_lo:chunk_hi] = encode_chunks_ref(values, rows[index, chunk_lo:chunk_hi].clone())
    return rows


def kv_load_ref(pool: torch.Tensor, pages: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
                chunk_lo: int = 0, chunk_hi: int | None = None, config: KVCodecConfig | None = None) -> torch.Tensor:
    """``pool[c, pages[i]] = decode(rows[slots[i], c])`` for every i and ``chunk_lo <= c < chunk_hi``; returns pool."""
    chunk_hi = pool.shape[0] if chunk_hi is None else chunk_hi
    _check(pool, pages, rows, slots, chunk_lo, chunk_hi)
    if pages.numel() == 0 or chunk_lo == chunk_hi:
        return pool
    encoded = rows[slots.to(rows.device).long(), chunk_lo:chunk_hi]  # [n, c, E]
    values = decode_chunks_ref(encoded, pool.shape[2]).transpose(0, 1).to(pool.device, pool.dtype)
    pool[chunk_lo:chunk_hi, pages.to(pool.device).long()] = values
    return pool


def _check(pool: torch.Tensor, pages: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, chunk_lo: int,
           chunk_hi: int) -> None:
    assert pool.dim() == 3 and rows.dim() == 3, "pool [C, P, W], rows [N, C, E]"
    # (the references also take the pool in fp32: the workbench's checks call them on upcast inputs)
    assert pool.dtype in (torch.bfloat16, torch.float32) and rows.dtype == torch.uint8, (pool.dtype, rows.dtype)
    assert rows.shape[1] == pool.shape[0] and rows.shape[2] == encoded_chunk_bytes(pool.shape[2]), \
        (tuple(pool.shape), tuple(rows.shape))
    assert pool.stride(2) == 1 and rows.stride(2) == 1, "chunks must be contiguous"
    assert pages.dim() == 1 and slots.shape == pages.shape, (tuple(pages.shape), tuple(slots.shape))
    assert 0 <= chunk_lo <= chunk_hi <= pool.shape[0], (chunk_lo, chunk_hi, pool.shape[0])
    _check_width(pool.shape[2])


# --- the kernels ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class KVCodecConfig:
    """Launch tunables: persistent programs (the copy's share of the SMs), warps per program, and the segments
    ``kv_load`` decodes a step (a power of 2; fewer where a chunk has fewer): reads over the host link take
    ~1-2 us, so each program needs many bytes in flight (one segment is ~800)."""

    num_programs: int = 64
    num_warps: int = 4
    segments: int = 4

    def __post_init__(self):
        if self.num_programs < 1 or self.num_warps < 1 or self.segments < 1 or self.segments & (self.segments - 1):
            raise ValueError(f"KVCodecConfig: num_programs, num_warps >= 1 and segments a power of 2, got {self}")

    def step(self, width: int) -> int:
        """Segments a step for chunks of ``width`` values: the largest power of 2 <= ``segments`` dividing them."""
        n = width // SEGMENT
        return min(self.segments, n & -n)


# the counts, the chunk range and the grid change with every restore: specialising on them would compile a
# variant for a request to wait on (as page_copy)
@triton.jit(do_not_specialize=["n_items", "chunk_lo", "n_chunks", "num_programs"])
def _kv_load_kernel(pool_ptr, rows_ptr, rows16_ptr, pages_ptr, slots_ptr, n_items, chunk_lo, n_chunks, num_programs,
                    stride_pool_chunk, stride_pool_page, stride_row, stride_row_chunk,
                    W: tl.constexpr, HDR: tl.constexpr, SEGS: tl.constexpr):
    i = tl.arange(0, 512)[None, :]  # value in the segment
    j = tl.arange(0, SEGS)[:, None]  # segment of the step
    for item in range(tl.program_id(0), n_items, num_programs):
        page = tl.load(pages_ptr + item // n_chunks).to(tl.int64)
        slot = tl.load(slots_ptr + item // n_chunks).to(tl.int64)
        c = (chunk_lo + item % n_chunks).to(tl.int64)
        dst = pool_ptr + c * stride_pool_chunk + page * stride_pool_page  # int16 view of the pool
        row = slot * stride_row + c * stride_row_chunk  # byte offset of the chunk in the rows
        for s0 in range(0, W // 512, SEGS):
            # masks from one comparison each (the interpreter takes neither a scalar mask nor the & of two)
            which = i + 1024 * tl.load(rows_ptr + row + s0 + j).to(tl.int32)  # [SEGS, 512]
            raw = which >= 1024
            comp = which < 1024
            seg = row + HDR + (s0 + j) * 1024
            # only the bytes each segment's form needs are loaded: a compressed one crosses the link as 784 bytes
            base = tl.load(rows_ptr + seg + i // 32, mask=comp, other=0).to(tl.int32)
            sm = tl.load(rows_ptr + seg + 16 + i, mask=comp, other=0).to(tl.int32)
            nib = tl.load(rows_ptr + seg + 528 + i // 2, mask=comp, other=0).to(tl.int32)
            exps = base + ((nib >> ((i % 2) * 4)) & 15)
            bits = ((sm & 0x80) << 8) | (exps << 7) | (sm & 0x7F)
            whole = tl.load(rows16_ptr + seg // 2 + i, mask=raw, other=0).to(tl.int32)
            tl.store(dst + (s0 + j) * 512 + i, tl.where(raw, whole, bits).to(tl.int16))


@triton.jit(do_not_specialize=["n_items", "chunk_lo", "n_chunks", "num_programs"])
def _kv_save_kernel(pool_ptr, rows_ptr, rows16_ptr, pages_ptr, slots_ptr, n_items, chunk_lo, n_chunks, num_programs,
                    stride_pool_chunk, stride_pool_page, stride_row, stride_row_chunk,
                    W: tl.constexpr, HDR: tl.constexpr):
    g = tl.arange(0, 16)[:, None]  # group
    v = tl.arange(0, 32)[None, :]  # value in the group
    k = tl.arange(0, 16)[None, :]  # pair of values in the group (2k, 2k + 1): one offsets byte
    at = g * 32 + v  # [16, 32]: the segment in order, so that every store is contiguous (partly written 64-byte
    # lines cost the host link as much as whole ones)
    for item in range(tl.program_id(0), n_items, num_programs):
        page = tl.load(pages_ptr + item // n_chunks).to(tl.int64)
        slot = tl.load(slots_ptr + item // n_chunks).to(tl.int64)
        c = (chunk_lo + item % n_chunks).to(tl.int64)
        src = pool_ptr + c * stride_pool_chunk + page * stride_pool_page  # int16 view of the pool
        row = slot * stride_row + c * stride_row_chunk
        for s in range(W // 512):
            x = tl.load(src + s * 512 + at)
            bits = x.to(tl.int32) & 0xFFFF
            exps = (bits >> 7) & 0xFF
            lo = tl.min(exps, 1)  # [16]: each group's base
            flag = (tl.max(tl.max(exps, 1) - lo, 0) > 15).to(tl.int32)
            tl.store(rows_ptr + row + s, flag.to(tl.uint8))
            # masks from one comparison each (the interpreter takes neither a scalar mask nor the & of two)
            raw = at + 1024 * flag >= 1024
            comp = at + 1024 * flag < 1024
            seg = row + HDR + s * 1024
            tl.store(rows_ptr + seg + tl.arange(0, 16), lo.to(tl.uint8), mask=tl.arange(0, 16) + 1024 * flag < 1024)
            tl.store(rows_ptr + seg + 16 + at, (((bits >> 8) & 0x80) | (bits & 0x7F)).to(tl.uint8), mask=comp)
            even, odd = tl.split(tl.reshape(exps - lo[:, None], (16, 16, 2)))  # offsets of values 2k, 2k + 1
            pair = g * 16 + k
            tl.store(rows_ptr + seg + 528 + pair, (even | (odd << 4)).to(tl.uint8), mask=pair + 1024 * flag < 1024)
            tl.store(rows16_ptr + seg // 2 + at, x, mask=raw)


def _launch(kernel, pool: torch.Tensor, pages: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, chunk_lo: int,
            chunk_hi: int | None, config: KVCodecConfig | None) -> None:
    """Both kernels' launch: their arguments checked (the kernels take bf16 pools only), one program per item
    (page, chunk) up to ``config.num_programs``."""
    chunk_hi = pool.shape[0] if chunk_hi is None else chunk_hi
    _check(pool, pages, rows, slots, chunk_lo, chunk_hi)
    assert pool.dtype == torch.bfloat16, f"the codec's pool is bf16, got {pool.dtype}"
    assert pages.device == pool.device == slots.device, "pages and slots live beside the pool"
    config = config or KVCodecConfig()
    n_chunks = chunk_hi - chunk_lo
    n_items = pages.numel() * n_chunks
    if n_items == 0:
        return
    W = pool.shape[2]
    constexprs = {"SEGS": config.step(W)} if kernel is _kv_load_kernel else {}  # (kv_save: a segment a step)
    assert rows.stride(0) % 2 == 0 and rows.stride(1) % 2 == 0 and rows.data_ptr() % 2 == 0, \
        "the rows are also read as 16-bit values"
    programs = min(config.num_programs, n_items)
    kernel[(programs,)](
        pool.view(torch.int16), rows, rows.view(torch.int16), pages, slots, n_items, chunk_lo, n_chunks, programs,
        pool.stride(0), pool.stride(1), rows.stride(0), rows.stride(1),
        W=W, HDR=header_bytes(W), num_warps=config.num_warps, **constexprs)


def kv_load_triton(pool: torch.Tensor, pages: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
                   chunk_lo: int = 0, chunk_hi: int | None = None,
                   config: KVCodecConfig | None = None) -> torch.Tensor:
    """``kv_load_ref`` in one launch; ``rows`` may be pinned host memory (read in place)."""
    _launch(_kv_load_kernel, pool, pages, rows, slots, chunk_lo, chunk_hi, config)
    return pool


def kv_save_triton(rows: torch.Tensor, slots: torch.Tensor, pool: torch.Tensor, pages: torch.Tensor,
                   chunk_lo: int = 0, chunk_hi: int | None = None,
                   config: KVCodecConfig | None = None) -> torch.Tensor:
    """``kv_save_ref`` in one launch; ``rows`` may be pinned host memory (written in place)."""
    _launch(_kv_save_kernel, pool, pages, rows, slots, chunk_lo, chunk_hi, config)
    return rows


def _rows_reachable(rows: torch.Tensor) -> bool:
    return rows.is_cuda or rows.is_pinned()


register("kv_load", "reference", kv_load_ref)
register("kv_load", "triton", kv_load_triton, supports=lambda pool, pages, rows, *a, **k: _rows_reachable(rows))
kv_load = dispatch("kv_load")
register("kv_save", "reference", kv_save_ref)
register("kv_save", "triton", kv_save_triton, supports=lambda rows, *a, **k: _rows_reachable(rows))
kv_save = dispatch("kv_save")


# --- workbench ---------------------------------------------------------------------------------------------

def kv_values(shape: tuple, gen: torch.Generator, scale: float = 1.0, raw_every: int = 7) -> torch.Tensor:
    """bf16 values like KV (normal, one scale), with some segments made raw (a zero among them), on CPU."""
    values = (scale * torch.randn(*shape, generator=gen, device=gen.device)).to(torch.bfloat16).cpu()
    flat = values.view(-1, SEGMENT)
    flat[::raw_every, 3] = 0.0  # exponent 0 beside ~127: that segment stays raw
    return values


def _make_inputs(case: Case, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> dict:
    d = case.dims
    C, P, W, N, n = d["C"], d["P"], d["W"], d["N"], d["n"]
    pool = kv_values((C, P, W), gen).to(device)
    rows = encode_chunks_ref(kv_values((N, C, W), gen))
    if device.type == "cuda":
        rows = rows.pin_memory()
    pages = torch.randperm(P, generator=gen, device=gen.device)[:n].to(device)
    slots = torch.randperm(N, generator=gen, device=gen.device)[:n].to(device)
    return {"pool": pool, "pages": pages, "rows": rows, "slots": slots, "chunk_lo": d.get("lo", 0),
            "chunk_hi": d.get("hi", C)}


def _load_bytes(inputs: dict) -> int:
    """Bytes over the link (the segments' forms as encoded) plus the pool's writes."""
    pool, rows, slots = inputs["pool"], inputs["rows"], inputs["slots"].cpu().long()
    lo, hi = inputs["chunk_lo"], inputs["chunk_hi"]
    W = pool.shape[2]
    nseg = W // SEGMENT
    raw = rows[slots, lo:hi, :nseg].to(torch.int64)
    read = header_bytes(W) + raw * SEGMENT_BYTES + (1 - raw) * COMPRESSED_BYTES
    return int(read.sum()) + slots.numel() * (hi - lo) * W * 2


SMALL_CASES = (
    Case("one-segment", {"C": 2, "P": 6, "W": 512, "N": 4, "n": 2}, edge="W = one segment; flags padded to 16"),
    Case("chunk-range", {"C": 6, "P": 10, "W": 1536, "N": 9, "n": 5, "lo": 2, "hi": 5},
         edge="three segments a chunk, scattered pages and slots, a range of chunks (one restore's layers)"),
    Case("empty", {"C": 3, "P": 4, "W": 512, "N": 3, "n": 0}, edge="no pages: nothing written"),
)

MODEL_CASES = (
    Case("llama3.1-8b-1708-pages", {"C": 64, "P": 2048, "W": 16384, "N": 1800, "n": 1708},
         edge="a 27k-token Llama-3.1-8B history from encoded pinned host rows into scattered pages"),
)

KV_LOAD_SPEC = register_spec(OpSpec(
    op="kv_load",
    reference=kv_load_ref,
    make_inputs=_make_inputs,
    cases=SMALL_CASES,
    model_cases=MODEL_CASES,
    dtypes=(torch.bfloat16,),
    bytes_moved=_load_bytes,
    exact=True,
    out_arg=None,
    launch_config=KVCodecConfig,
    notes="returns pool, written in place and compared whole: pages not named must keep their values.",
))
