"""Triton kernels for the op "dequantize" (GGUF blocks -> fp32/fp16/bf16), and its workbench tables.

The reference, the public ``dequantize`` and the registration live in
``qml_kernels.gguf_dequant``, which imports this module; it imports nothing from
there, so there is no import cycle.

Layouts (ggml-common.h block structs, sizes in ``ggml_types.BLOCK_LAYOUT``): a tensor
is a run of blocks along its contiguous axis, 32 values per block for Q4_0, Q4_1,
Q5_0, Q5_1, Q8_0 and MXFP4, 256 per super-block for the K-quants. A program decodes
``values_per_program`` values, a run of whole consecutive blocks, so it reads one
contiguous byte range and writes one contiguous range of values. A 32-value block is
a tile ``[2, 16]`` (row h: the values from the low, then the high nibbles of the 16
code bytes); a super-block is ``[16, 16]`` (row j: the j-th run of 16 values, the
unit of the Q2_K/Q3_K/Q6_K scales). Along the last axis of both tiles the values and
the code bytes are contiguous, so loads and stores vectorise; a byte that feeds
several rows of a K-quant tile (two nibbles, four 2-bit fields) comes from HBM once,
its repeats from L1. The gpt-oss checkpoint's MXFP4 (value 2i in the low nibble of
byte i, scales in their own tensor) has its own kernel: ``[G, 16]`` bytes, paired
into ``[G, 32]`` values in registers.

Numerics: each value is computed in fp32 in the reference's order. The products are
exact in fp32 (fp16 scale x sub-scale x quant needs at most 23 significant bits), so
the only rounding is the final add of a min, which an FMA performs identically; the
cast to fp16/bf16 then rounds that fp32 value once, as ``ref.to(dtype)`` does.

Traffic: one read of the blocks, one write of the values: Q4_K to bf16 moves 144 B in
and 512 B out per 256 values, so the writes dominate and, at about ten integer ops
per value, the kernels are bound by HBM bandwidth.

Sources: ggml/src/ggml-quants.c ``dequantize_row_*`` and ggml-common.h (layouts);
OCP Microscaling Formats (MX) v1.0 (E2M1 codes, E8M0 scales).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch
import triton
import triton.language as tl

from qml_kernels.ggml_types import BLOCK_LAYOUT, QK_K, GGMLType, tensor_nbytes
from qml_kernels.workbench.spec import Case

_Q4_0 = tl.constexpr(int(GGMLType.Q4_0))
_Q4_1 = tl.constexpr(int(GGMLType.Q4_1))
_Q5_0 = tl.constexpr(int(GGMLType.Q5_0))
_Q5_1 = tl.constexpr(int(GGMLType.Q5_1))
_Q8_0 = tl.constexpr(int(GGMLType.Q8_0))
_Q2_K = tl.constexpr(int(GGMLType.Q2_K))
_Q3_K = tl.constexpr(int(GGMLType.Q3_K))
_Q4_K = tl.constexpr(int(GGMLType.Q4_K))
_Q5_K = tl.constexpr(int(GGMLType.Q5_K))
_Q6_K = tl.constexpr(int(GGMLType.Q6_K))
_MXFP4 = tl.constexpr(int(GGMLType.MXFP4))
# The eight E2M1 magnitudes doubled to integers (0, 1, 2, 3, 4, 6, 8, 12), one per
# nibble: a shift and a mask replace a lookup table.
_E2M1_DOUBLED_NIBBLES = tl.constexpr(0xC8643210)

BLOCK_TYPES: tuple[GGMLType, ...] = (
    GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0, GGMLType.MXFP4,
    GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K,
)
_PLAIN_FLOATS = {GGMLType.F32: torch.float32, GGMLType.F16: torch.float16, GGMLType.BF16: torch.bfloat16}
TRITON_TYPES: tuple[GGMLType, ...] = (*_PLAIN_FLOATS, *BLOCK_TYPES)
_TRITON_IDS = frozenset(int(t) for t in TRITON_TYPES)
OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class DequantConfig:
    """Launch tunables, one setting for every type (it counts values, not blocks)."""

    # output values per program: 64 blocks of 32 or 8 super-blocks of 256, 16 values per
    # thread; measured fastest on the H200 for most types (benchmarks/results/sweep-h200-all-2026-11-30.md)
    values_per_program: int = 2048
    num_warps: int = 4  # the kernels have no loop, so there are no pipeline stages to tune

    def __post_init__(self):
        v = self.values_per_program
        if v < QK_K or v & (v - 1):
            raise ValueError(f"DequantConfig.values_per_program must be a power of 2 >= {QK_K}, got {v}")
        if self.num_warps < 1 or self.num_warps & (self.num_warps - 1):
            raise ValueError(f"DequantConfig.num_warps must be a power of 2, got {self.num_warps}")


@triton.jit
def _u8(ptr, mask):
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def _i8(ptr, mask):
    return tl.load(ptr, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.int32)


# 16-bit fields (fp16 scales, Q5 high bits) sit at even offsets of even-sized blocks,
# so they are read in place with one 2-byte load
@triton.jit
def _u16(ptr, mask):
    return tl.load(ptr.to(tl.pointer_type(tl.uint16), bitcast=True), mask=mask, other=0).to(tl.int32)


@triton.jit
def _f16(ptr, mask):
    return tl.load(ptr.to(tl.pointer_type(tl.float16), bitcast=True), mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _e8m0_half(e):
    """2^(e-128) in fp32 from its bit pattern (exact; e < 2 gives subnormals), e int32."""
    bits = tl.where(e < 2, 0x00200000 << (e & 1), (e - 1) << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_doubled(code, SIGNED_ZERO: tl.constexpr):
    """Twice the E2M1 value of a 4-bit code (int32) as fp32. ggml's table is integer, so
    code 8 is +0; the gpt-oss checkpoint's decoders give -0 (SIGNED_ZERO)."""
    table = tl.full(code.shape, _E2M1_DOUBLED_NIBBLES, tl.uint32)
    mag = ((table >> (4 * (code & 7)).to(tl.uint32)) & 15).to(tl.int32)
    if SIGNED_ZERO:
        # set the sign bit directly: `-v` may compile to `0 - v`, which turns -0 into +0
        sign = (code >= 8).to(tl.uint32) << 31
        return (mag.to(tl.float32).to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return tl.where(code >= 8, -mag, mag).to(tl.float32)


@triton.jit
def _dequant_q32_kernel(raw_ptr, out_ptr, n_blocks, QTYPE: tl.constexpr, BLOCK_BYTES: tl.constexpr,
                        BLOCKS: tl.constexpr):
    # 64-bit block index: byte offsets of the largest tensors (embeddings) pass 2^31
    blk = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)[:, None, None]  # [N, 1, 1]
    h = tl.arange(0, 2)[None, :, None]  # [1, 2, 1] low / high nibbles
    l = tl.arange(0, 16)[None, None, :]  # [1, 1, 16] code byte
    live = blk < n_blocks
    b = raw_ptr + blk * BLOCK_BYTES  # [N, 1, 1] block starts
    if QTYPE == _Q8_0:
        y = _i8(b + 2 + 16 * h + l, live).to(tl.float32) * _f16(b, live)
    elif QTYPE == _MXFP4:
        code = (_u8(b + 1 + l, live) >> (4 * h)) & 15
        y = _e2m1_doubled(code, False) * _e8m0_half(_u8(b, live))
    elif QTYPE == _Q4_0:
        q = (_u8(b + 2 + l, live) >> (4 * h)) & 15
        y = (q - 8).to(tl.float32) * _f16(b, live)
    elif QTYPE == _Q4_1:
        q = (_u8(b + 4 + l, live) >> (4 * h)) & 15
        y = q.to(tl.float32) * _f16(b, live) + _f16(b + 2, live)
    elif QTYPE == _Q5_0:
        # value 16h + l takes its fifth bit from bit l of the h-th little-endian 16-bit half of qh
        fifth = (_u16(b + 2 + 2 * h, live) >> l) & 1  # qh [N, 2, 1] bits -> [N, 2, 16]
        q = ((_u8(b + 6 + l, live) >> (4 * h)) & 15) | (fifth << 4)
        y = (q - 16).to(tl.float32) * _f16(b, live)
    else:  # Q5_1
        fifth = (_u16(b + 4 + 2 * h, live) >> l) & 1
        q = ((_u8(b + 8 + l, live) >> (4 * h)) & 15) | (fifth << 4)
        y = q.to(tl.float32) * _f16(b, live) + _f16(b + 2, live)
    tl.store(out_ptr + blk * 32 + 16 * h + l, y.to(out_ptr.dtype.element_ty), mask=live)


@triton.jit
def _dequant_kquant_kernel(raw_ptr, out_ptr, n_blocks, QTYPE: tl.constexpr, BLOCK_BYTES: tl.constexpr,
                           BLOCKS: tl.constexpr):
    blk = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)[:, None, None]  # [N, 1, 1]
    j = tl.arange(0, 16)[None, :, None]  # [1, 16, 1] run of 16 values
    m = tl.arange(0, 16)[None, None, :]  # [1, 1, 16]
    # value 16j + m is value l of 32-value group g; the 2-bit fields of group g = 4*half + k
    # come from bit pair k of the 32 bytes of its half of the super-block
    g = j // 2
    l = 16 * (j % 2) + m
    half = j // 8
    k = g % 4
    live = blk < n_blocks
    b = raw_ptr + blk * BLOCK_BYTES  # [N, 1, 1] super-block starts
    if QTYPE == _Q2_K:
        sc = _u8(b + j, live)  # [N, 16, 1] scale in the low nibble, min in the high
        q = (_u8(b + 16 + 32 * half + l, live) >> (2 * k)) & 3
        dl = _f16(b + 80, live) * (sc & 15).to(tl.float32)
        ml = _f16(b + 82, live) * (sc >> 4).to(tl.float32)
        y = q.to(tl.float32) * dl - ml
    elif QTYPE == _Q3_K:
        # a clear hmask bit g makes the value 4 lower
        hbit = (_u8(b + l, live) >> g) & 1
        q = ((_u8(b + 32 + 32 * half + l, live) >> (2 * k)) & 3) - 4 * (1 - hbit)
        # 6-bit scales: low 4 bits from the nibbles of bytes 96-103, top 2 from bit pairs of 104-107
        low = (_u8(b + 96 + j % 8, live) >> (4 * (j // 8))) & 15
        high = (_u8(b + 104 + j % 4, live) >> (2 * (j // 4))) & 3
        dl = _f16(b + 108, live) * ((low | (high << 4)) - 32).to(tl.float32)
        y = q.to(tl.float32) * dl
    elif QTYPE == _Q6_K:
        lo = (_u8(b + 64 * half + 32 * (k % 2) + l, live) >> (4 * (k // 2))) & 15
        hi = (_u8(b + 128 + 32 * half + l, live) >> (2 * k)) & 3
        dl = _f16(b + 208, live) * _i8(b + 192 + j, live).to(tl.float32)
        y = ((lo | (hi << 4)) - 32).to(tl.float32) * dl
    else:  # Q4_K, Q5_K: 8 six-bit scales and mins per super-block, one per group g
        a = _u8(b + 4 + g % 4, live)  # [N, 16, 1]
        c = _u8(b + 8 + g % 4, live)
        x = _u8(b + 12 + g % 4, live)
        # groups 0-3 use the low 6 bits of bytes 4-7 / 8-11; groups 4-7 take their low 4 bits
        # from the nibbles of 12-15 and their top 2 from the spare top bits of 4-7 / 8-11
        first = g < 4
        sc = tl.where(first, a & 63, (x & 15) | ((a >> 6) << 4))
        mn = tl.where(first, c & 63, (x >> 4) | ((c >> 6) << 4))
        if QTYPE == _Q4_K:
            q = (_u8(b + 16 + 32 * (g // 2) + l, live) >> (4 * (g % 2))) & 15
        else:
            q = (_u8(b + 48 + 32 * (g // 2) + l, live) >> (4 * (g % 2))) & 15
            q = q | (((_u8(b + 16 + l, live) >> g) & 1) << 4)
        dl = _f16(b, live) * sc.to(tl.float32)
        ml = _f16(b + 2, live) * mn.to(tl.float32)
        y = q.to(tl.float32) * dl - ml
    tl.store(out_ptr + blk * 256 + 16 * j + m, y.to(out_ptr.dtype.element_ty), mask=live)


@triton.jit
def _dequant_mxfp4_interleaved_kernel(blocks_ptr, scales_ptr, out_ptr, n_groups, GROUPS: tl.constexpr):
    grp = tl.program_id(0).to(tl.int64) * GROUPS + tl.arange(0, GROUPS)[:, None]  # [N, 1]
    live = grp < n_groups
    codes = _u8(blocks_ptr + grp * 16 + tl.arange(0, 16)[None, :], live)  # [N, 16]
    scale = _e8m0_half(_u8(scales_ptr + grp, live))  # [N, 1]
    lo = _e2m1_doubled(codes & 15, True) * scale
    hi = _e2m1_doubled(codes >> 4, True) * scale
    # value 2i is byte i's low nibble and 2i+1 its high one: join pairs them in registers
    y = tl.reshape(tl.join(lo, hi), [GROUPS, 32])  # [N, 32]
    tl.store(out_ptr + grp * 32 + tl.arange(0, 32)[None, :], y.to(out_ptr.dtype.element_ty), mask=live)


def _check_out(out: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    assert tuple(out.shape) == shape, f"out: shape {tuple(out.shape)}, expected {shape}"
    assert out.dtype == dtype, f"out: dtype {out.dtype}, expected {dtype}"
    assert out.device == device, f"out on {out.device}, input on {device}"
    assert out.is_contiguous(), f"out must be contiguous, strides {out.stride()}"


def _needs_even_address(qtype: GGMLType) -> bool:
    return qtype in BLOCK_TYPES and qtype != GGMLType.MXFP4  # MXFP4 alone has no 16-bit field


def triton_supports(raw, qtype, shape=None, dtype=torch.float32, out=None, config=None) -> bool:
    """Whether ``dequantize_triton`` runs these arguments (the registry's ``supports``)."""
    if int(qtype) not in _TRITON_IDS or dtype not in OUT_DTYPES:
        return False
    return (raw.dtype == torch.uint8 and raw.is_contiguous()
            and not (_needs_even_address(GGMLType(int(qtype))) and raw.data_ptr() % 2))


def mxfp4_interleaved_supports(blocks, scales, dtype=torch.float32, out=None, config=None) -> bool:
    return dtype in OUT_DTYPES and blocks.is_contiguous() and scales.is_contiguous()


def dequantize_triton(raw: torch.Tensor, qtype: GGMLType, shape: tuple[int, ...],
                      dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None,
                      config: DequantConfig = DequantConfig()) -> torch.Tensor:
    """Decode a GGUF tensor's bytes; the contract of ``gguf_dequant.dequantize_ref``.

    raw: uint8 [nbytes], contiguous, as stored in the file; shape: torch order, blocks
    along the last axis; returns (or fills ``out``) ``[*shape]`` in ``dtype``.
    """
    assert int(qtype) in _TRITON_IDS, f"dequantize_triton: ggml type {qtype!r} is not supported"
    qtype = GGMLType(int(qtype))
    assert raw.dtype == torch.uint8, f"raw must be uint8 bytes, got {raw.dtype}"
    assert raw.is_contiguous(), f"raw must be contiguous, strides {raw.stride()}"
    assert dtype in OUT_DTYPES, f"dtype must be one of {OUT_DTYPES}, got {dtype}"
    shape = tuple(int(s) for s in shape)
    block_elems, block_bytes = BLOCK_LAYOUT[qtype]
    assert block_elems == 1 or (shape and shape[-1] % block_elems == 0), \
        f"{qtype.name} blocks hold {block_elems} values; the last axis of {shape} is not a multiple"
    expected = tensor_nbytes(qtype, prod(shape))
    assert raw.numel() == expected, f"{qtype.name} of shape {shape} needs {expected} bytes, got {raw.numel()}"
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=raw.device)
    _check_out(out, shape, dtype, raw.device)

    if qtype in _PLAIN_FLOATS:
        # nothing to decode: the cast is the whole op, and torch's copy already runs at bandwidth
        float_dtype = _PLAIN_FLOATS[qtype]
        flat = raw if raw.storage_offset() % float_dtype.itemsize == 0 else raw.clone()
        out.copy_(flat.view(float_dtype).view(shape))
        return out
    n_blocks = raw.numel() // block_bytes
    if n_blocks == 0:
        return out
    if _needs_even_address(qtype):
        assert raw.data_ptr() % 2 == 0, "raw must start at an even address (16-bit fields are read in place)"
    kernel = _dequant_kquant_kernel if block_elems == QK_K else _dequant_q32_kernel
    blocks = config.values_per_program // block_elems
    kernel[(triton.cdiv(n_blocks, blocks),)](
        raw, out, n_blocks, QTYPE=int(qtype), BLOCK_BYTES=block_bytes, BLOCKS=blocks, num_warps=config.num_warps,
    )
    return out


def dequantize_mxfp4_interleaved_triton(blocks: torch.Tensor, scales: torch.Tensor,
                                        dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None,
                                        config: DequantConfig = DequantConfig()) -> torch.Tensor:
    """gpt-oss checkpoint MXFP4: blocks uint8 [..., G, 16], scales uint8 [..., G] -> [..., G*32] in dtype;
    the contract of ``gguf_dequant.dequantize_mxfp4_interleaved_ref``."""
    assert blocks.dtype == torch.uint8 and scales.dtype == torch.uint8, \
        f"blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}"
    assert blocks.dim() >= 2 and blocks.shape[-1] == 16 and scales.shape == blocks.shape[:-1], \
        f"expected blocks [..., G, 16] and scales [..., G], got {tuple(blocks.shape)} and {tuple(scales.shape)}"
    assert blocks.is_contiguous() and scales.is_contiguous(), "blocks and scales must be contiguous"
    assert blocks.device == scales.device, f"blocks on {blocks.device}, scales on {scales.device}"
    assert dtype in OUT_DTYPES, f"dtype must be one of {OUT_DTYPES}, got {dtype}"
    shape = (*blocks.shape[:-2], blocks.shape[-2] * 32)
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=blocks.device)
    _check_out(out, shape, dtype, blocks.device)
    n_groups = scales.numel()
    if n_groups:
        groups = config.values_per_program // 32
        _dequant_mxfp4_interleaved_kernel[(triton.cdiv(n_groups, groups),)](
            blocks, scales, out, n_groups, GROUPS=groups, num_warps=config.num_warps,
        )
    return out


# -- workbench: shape tables, inputs, traffic ---------------------------------------------

# byte offsets of the fp16 scale fields (d, dmin, m) in each block; random bytes there
# could be inf/NaN, so make_inputs writes finite values instead
_FP16_FIELDS: dict[GGMLType, tuple[int, ...]] = {
    GGMLType.Q4_0: (0,), GGMLType.Q4_1: (0, 2), GGMLType.Q5_0: (0,), GGMLType.Q5_1: (0, 2),
    GGMLType.Q8_0: (0,), GGMLType.Q2_K: (80, 82), GGMLType.Q3_K: (108,), GGMLType.Q4_K: (0, 2),
    GGMLType.Q5_K: (0, 2), GGMLType.Q6_K: (208,),
}


def _random_e8m0(n: int, gen: torch.Generator) -> torch.Tensor:
    """Typical MXFP4 exponents; the first two are 0 and 1 (subnormal scales). Values stay
    below 2^13, finite in fp16 too."""
    e = torch.randint(110, 141, (n,), dtype=torch.uint8, generator=gen, device=gen.device)
    e[:2] = torch.tensor([0, 1], dtype=torch.uint8, device=gen.device)[: min(n, 2)]
    return e


def random_gguf_bytes(qtype: GGMLType, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random valid bytes of a ``qtype`` tensor of ``shape``, on ``gen``'s device: [nbytes] uint8.
    Scales are finite fp16 of either sign from 2^-20 (subnormal) to 2."""
    block_elems, block_bytes = BLOCK_LAYOUT[qtype]
    n = prod(shape) // block_elems
    raw = torch.randint(0, 256, (n, block_bytes), dtype=torch.uint8, generator=gen, device=gen.device)
    for offset in _FP16_FIELDS.get(qtype, ()):
        magnitude = torch.exp2(torch.rand(n, generator=gen, device=gen.device) * 21 - 20)
        sign = torch.randint(0, 2, (n,), generator=gen, device=gen.device) * 2 - 1
        raw[:, offset:offset + 2] = (sign * magnitude).to(torch.float16).view(torch.uint8).view(n, 2)
    if qtype == GGMLType.MXFP4:
        raw[:, 0] = _random_e8m0(n, gen)
    return raw.view(-1)


def _cases(qtype: GGMLType) -> tuple[Case, ...]:
    name = qtype.name.lower()
    if BLOCK_LAYOUT[qtype][0] == QK_K:
        shapes = [((256,), "1 super-block: one program, 15 of 16 block slots masked"),
                  ((1, 20 * 256), "one row of 20 super-blocks: 2 programs, the second partial"),
                  ((3, 512), "odd number of rows, 2 super-blocks each"),
                  ((2, 3, 256), "3-D expert stack [E, out, in]")]
    else:
        shapes = [((32,), "1 block: one program, 127 of 128 block slots masked"),
                  ((1, 24 * 32), "one row of 24 blocks"),
                  ((5, 1024), "5 odd rows, 160 blocks: 2 programs, the second partial"),
                  ((4, 3, 64), "3-D expert stack [E, out, in]")]
    tags = ("1-block", "row", "odd-rows", "experts")
    return tuple(Case(f"{name}-{tag}", {"qtype": qtype, "shape": shape}, edge=edge)
                 for tag, (shape, edge) in zip(tags, shapes))


CASES: tuple[Case, ...] = tuple(c for t in BLOCK_TYPES for c in _cases(t))

# Llama-3.1-8B ffn_gate/up [ffn, hidden] in every type (the per-type speed table), plus the
# MoE expert stacks the engine dequantizes: Qwen3-30B-A3B ffn_{gate,up}_exps [E, ffn, hidden]
# and gpt-oss-20b's gate_up [E, 2*ffn, hidden] in MXFP4
MODEL_CASES: tuple[Case, ...] = (
    *(Case(f"{t.name.lower()}-llama3.1-8b-ffn", {"qtype": t, "shape": (14336, 4096)},
           edge="Llama-3.1-8B ffn_gate weight 14336x4096")
      for t in (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q8_0, GGMLType.Q2_K, GGMLType.Q3_K,
                GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K, GGMLType.MXFP4)),
    *(Case(f"{t.name.lower()}-qwen3-30b-a3b-experts", {"qtype": t, "shape": (128, 768, 2048)},
           edge="Qwen3-30B-A3B expert stack 128x768x2048")
      for t in (GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q8_0)),
    Case("mxfp4-gpt-oss-20b-experts", {"qtype": GGMLType.MXFP4, "shape": (32, 5760, 2880)},
         edge="gpt-oss-20b gate_up expert stack 32x5760x2880 (90 blocks per row)"),
)


def make_inputs(case: Case, dtype: torch.dtype, device, gen: torch.Generator) -> dict:
    qtype, shape = case.dims["qtype"], case.dims["shape"]
    return {"raw": random_gguf_bytes(qtype, shape, gen).to(device), "qtype": qtype, "shape": shape, "dtype": dtype}


def bytes_moved(inputs: dict) -> int:
    # the blocks are read once, the values written once
    return inputs["raw"].numel() + prod(inputs["shape"]) * inputs["dtype"].itemsize


MXFP4_INTERLEAVED_CASES: tuple[Case, ...] = (
    Case("1-group", {"lead": (), "groups": 1}, edge="a single group, no leading axes"),
    Case("odd-rows", {"lead": (3,), "groups": 5}, edge="odd rows of an odd number of groups"),
    Case("experts", {"lead": (2, 3), "groups": 4}, edge="expert stack [E, out, G, 16]"),
    Case("two-programs", {"lead": (7,), "groups": 20}, edge="140 groups: 2 programs, the second partial"),
)
MXFP4_INTERLEAVED_MODEL_CASES: tuple[Case, ...] = (
    Case("gpt-oss-20b-experts", {"lead": (32, 5760), "groups": 90},
         edge="gpt-oss-20b gate_up_proj blocks [32, 5760, 90, 16]"),
)


def make_mxfp4_interleaved_inputs(case: Case, dtype: torch.dtype, device, gen: torch.Generator) -> dict:
    lead, groups = case.dims["lead"], case.dims["groups"]
    blocks = torch.randint(0, 256, (*lead, groups, 16), dtype=torch.uint8, generator=gen, device=gen.device)
    scales = _random_e8m0(prod(lead) * groups, gen).view(*lead, groups)
    return {"blocks": blocks.to(device), "scales": scales.to(device), "dtype": dtype}


def mxfp4_interleaved_bytes_moved(inputs: dict) -> int:
    return inputs["blocks"].numel() + inputs["scales"].numel() + inputs["blocks"].numel() * 2 * inputs["dtype"].itemsize
