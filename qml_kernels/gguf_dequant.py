"""Dequantization of GGUF/ggml tensors to floating point, in plain PyTorch.

This is the reference for the op "dequantize". It runs wherever torch runs
(CPU and CUDA alike, no numpy) and is vectorised over blocks, so it is fast
enough to decode whole models at load time. The Triton kernels live in
``gguf_dequant_triton``; both are registered here, and the public
``dequantize`` dispatches between them.

Layouts follow the block structs of ggml/src/ggml-common.h (``block_q4_0``,
``block_q4_K``, ...); their sizes are in ``ggml_types.BLOCK_LAYOUT``. Blocks run
along the contiguous axis (ggml ``ne[0]``, the last axis in torch order), so a
row of ``K`` values is ``K / block_elems`` consecutive blocks.

Results are bit-exact against ``gguf.quants.dequantize`` (gguf-py's numpy port
of ggml-quants.c ``dequantize_row_*``). Each formula keeps gguf-py's order:
fp16 scales widened to fp32 first, the sub-block scale ``d * sc`` formed
before it meets the quant, then the quant, then the min. The products are in
fact exact in fp32 (an 11-bit fp16 significand times a sub-scale of at most
7 bits times a quant of at most 6 bits fits in 24 bits), so the only rounding
is the final add or subtract of the min; a kernel that fuses it into an FMA
stays bit-exact.

MXFP4 appears in two nibble orders. ggml's ``block_mxfp4`` keeps the first 16
values in the low nibbles and the last 16 in the high nibbles (as Q4_0 does);
the gpt-oss safetensors checkpoint interleaves them (value 2i low, 2i+1 high)
and stores the E8M0 scales as a separate tensor:
``dequantize_mxfp4_interleaved_ref`` reads that form.
"""

from math import prod

import torch

from qml_kernels import gguf_dequant_triton as _triton
from qml_kernels.ggml_types import BLOCK_LAYOUT, QK_K, GGMLType, tensor_nbytes
from qml_kernels.registry import dispatch, register
from qml_kernels.workbench.spec import OpSpec, register_spec

# E2M1 code -> value, doubled so every entry is an integer; the E8M0 scale is
# halved to compensate (ggml's kvalues_mxfp4 / GGML_E8M0_TO_FP32_HALF). ggml's
# table is integer, so code 8 (negative zero) decodes to +0.
_E2M1_DOUBLED = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
# The gpt-oss checkpoint's reference decoders keep the sign of zero.
_E2M1_DOUBLED_SIGNED_ZERO = (*_E2M1_DOUBLED[:8], -0.0, *_E2M1_DOUBLED[9:])


def _shifts(device: torch.device, *amounts: int) -> torch.Tensor:
    return torch.tensor(amounts, dtype=torch.uint8, device=device)


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 field at byte ``offset`` of each block, widened to fp32: [n, 1]."""
    # Copy the two bytes out first: a strided slice cannot be reinterpreted as
    # fp16 when the block size or offset is odd.
    return blocks[:, offset : offset + 2].contiguous().view(torch.float16).float()


def _nibbles_split(qs: torch.Tensor) -> torch.Tensor:
    """[n, m] bytes -> [n, 2m] codes: all low nibbles, then all high nibbles
    (Q4_0, Q4_1, Q5_*, ggml MXFP4)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _bits_le(qh: torch.Tensor) -> torch.Tensor:
    """[n, m] little-endian bytes -> [n, 8m] bits, bit 0 of byte 0 first."""
    bits = (qh.unsqueeze(-1) >> _shifts(qh.device, *range(8))) & 1  # [n, m, 8]
    return bits.flatten(-2)


def _e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """2^(e-128) as fp32, from its bit pattern: exact, and subnormal for e < 2."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    return bits.view(torch.float32)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)  # [n, 1]
    q = _nibbles_split(b[:, 2:]).to(torch.int8) - 8  # [n, 32]
    return q.float().mul_(d)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b, 0), _f16(b, 2)
    q = _nibbles_split(b[:, 4:]).float()  # [n, 32]
    return q.mul_(d).add_(m)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    q = _nibbles_split(b[:, 6:]) | (_bits_le(b[:, 2:6]) << 4)  # [n, 32]
    return (q.to(torch.int8) - 16).float().mul_(d)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b, 0), _f16(b, 2)
    q = (_nibbles_split(b[:, 8:]) | (_bits_le(b[:, 4:8]) << 4)).float()  # [n, 32]
    return q.mul_(d).add_(m)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    return b[:, 2:].view(torch.int8).float().mul_(d)  # [n, 32]


def _crumbs(qs: torch.Tensor) -> torch.Tensor:
    """[n, m] bytes -> [n, 4m] 2-bit fields, K-quant order: each 32-byte group
    yields 4 runs of 32 values, from bit pairs 0-1, 2-3, 4-5, 6-7."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, 32) >> _shifts(qs.device, 0, 2, 4, 6).view(1, 1, 4, 1)
    return (q & 3).reshape(n, -1)


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales, qs = b[:, :16], b[:, 16:80]
    d, dmin = _f16(b, 80), _f16(b, 82)
    dl = (d * (scales & 0x0F).float()).view(n, 16, 1)  # [n, 16, 1]
    ml = (dmin * (scales >> 4).float()).view(n, 16, 1)
    q = _crumbs(qs).view(n, 16, 16).float()  # [n, 16 sub-blocks, 16]
    return q.mul_(dl).sub_(ml).view(n, QK_K)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    hmask, qs, packed = b[:, :32], b[:, 32:96], b[:, 96:108]
    d = _f16(b, 108)
    # 16 six-bit scales: low 4 bits are the nibbles of bytes 0-7 (all low
    # nibbles, then all high), high 2 bits come from bytes 8-11 in bit pairs.
    low = _nibbles_split(packed[:, :8])  # [n, 16]
    high = (packed[:, 8:].unsqueeze(1) >> _shifts(b.device, 0, 2, 4, 6).view(1, 4, 1)) & 3
    sc = (low | (high.reshape(n, 16) << 4)).to(torch.int8) - 32  # [n, 16]
    dl = (d * sc.float()).view(n, 16, 1)
    # A clear hmask bit means the value is 4 lower (ggml's q3 offset).
    hbit = (hmask.unsqueeze(1) >> _shifts(b.device, *range(8)).view(1, 8, 1)) & 1  # [n, 8, 32]
    q = _crumbs(qs).to(torch.int8) - ((hbit.reshape(n, QK_K) ^ 1) << 2).to(torch.int8)
    return q.view(n, 16, 16).float().mul_(dl).view(n, QK_K)


def _k4_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack 8 six-bit scales and 8 six-bit mins from 12 bytes (Q4_K, Q5_K).
    Sub-blocks 0-3 use the low 6 bits of bytes 0-3 / 4-7; sub-blocks 4-7 take
    their low 4 bits from bytes 8-11 and their top 2 bits from the spare top
    bits of bytes 0-3 / 4-7. Returns ([n, 8], [n, 8])."""
    sc_lo, mn_lo, extra = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = torch.cat([sc_lo & 0x3F, (extra & 0x0F) | ((sc_lo >> 2) & 0x30)], dim=-1)
    mn = torch.cat([mn_lo & 0x3F, (extra >> 4) | ((mn_lo >> 2) & 0x30)], dim=-1)
    return sc, mn


def _q4_k_like(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``d*sc * q - dmin*mn`` over 8 sub-blocks of 32; q is [n, 8, 32]."""
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k4_scales(b[:, 4:16])
    dl = (d * sc.float()).view(n, 8, 1)
    ml = (dmin * mn.float()).view(n, 8, 1)
    return q.float().mul_(dl).sub_(ml).view(n, QK_K)


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, m] bytes -> [n, 2m] 4-bit fields, K-quant order: each 32-byte group
    gives 32 low nibbles, then its 32 high nibbles."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, 32) >> _shifts(qs.device, 0, 4).view(1, 1, 2, 1)
    return (q & 0x0F).reshape(n, -1)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    return _q4_k_like(b, _k_nibbles(b[:, 16:144]).view(n, 8, 32))


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    qh, qs = b[:, 16:48], b[:, 48:176]
    # Bit s of qh[l] is the fifth bit of value l of sub-block s.
    hbit = (qh.unsqueeze(1) >> _shifts(b.device, *range(8)).view(1, 8, 1)) & 1  # [n, 8, 32]
    q = _k_nibbles(qs).view(n, 8, 32) | (hbit << 4)
    return _q4_k_like(b, q)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql, qh = b[:, :128], b[:, 128:192]
    scales = b[:, 192:208].view(torch.int8)
    d = _f16(b, 208)
    dl = (d * scales.float()).view(n, 16, 1)  # [n, 16, 1]
    # Per half of 128 values: ql gives four runs of 32 from (bytes 0-31 low,
    # 32-63 low, 0-31 high, 32-63 high); qh gives bit pairs 0-1 .. 6-7.
    lo = (ql.reshape(n, 2, 1, 64) >> _shifts(b.device, 0, 4).view(1, 1, 2, 1)) & 0x0F
    q = lo.reshape(n, QK_K) | (_crumbs(qh) << 4)
    q = q.to(torch.int8) - 32
    return q.view(n, 16, 16).float().mul_(dl).view(n, QK_K)


def _mxfp4(b: torch.Tensor) -> torch.Tensor:
    scale = _e8m0_half(b[:, :1])  # [n, 1]
    lut = torch.tensor(_E2M1_DOUBLED, dtype=torch.float32, device=b.device)
    codes = _nibbles_split(b[:, 1:])  # [n, 32]
    return lut[codes.long()].mul_(scale)


_BLOCK_DECODERS = {
    GGMLType.Q4_0: _q4_0,
    GGMLType.Q4_1: _q4_1,
    GGMLType.Q5_0: _q5_0,
    GGMLType.Q5_1: _q5_1,
    GGMLType.Q8_0: _q8_0,
    GGMLType.Q2_K: _q2_k,
    GGMLType.Q3_K: _q3_k,
    GGMLType.Q4_K: _q4_k,
    GGMLType.Q5_K: _q5_k,
    GGMLType.Q6_K: _q6_k,
    GGMLType.MXFP4: _mxfp4,
}

_PLAIN_FLOATS = {
    GGMLType.F32: torch.float32,
    GGMLType.F16: torch.float16,
    GGMLType.BF16: torch.bfloat16,
}

SUPPORTED_TYPES: tuple[GGMLType, ...] = (*_PLAIN_FLOATS, *_BLOCK_DECODERS)
_SUPPORTED_IDS = frozenset(int(t) for t in SUPPORTED_TYPES)


def dequantize_ref(
    raw: torch.Tensor,
    qtype: GGMLType,
    shape: tuple[int, ...],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Decode a GGUF tensor's bytes into values.

    Args:
        raw: uint8, any shape, contiguous; exactly ``tensor_nbytes(qtype, prod(shape))``
            bytes as stored in the file.
        qtype: the ggml type of the tensor (one of ``SUPPORTED_TYPES``).
        shape: logical shape in torch order; the last axis is ggml ``ne[0]``,
            along which blocks run, so it must be a multiple of the block size.
        dtype: dtype of the result; values are computed in float32, then cast.

    Returns:
        Tensor of ``shape`` and ``dtype`` on ``raw``'s device. For F32 read as
        float32 no work is needed, and the result shares ``raw``'s memory.
    """
    if int(qtype) not in _SUPPORTED_IDS:
        name = getattr(qtype, "name", str(qtype))
        supported = ", ".join(t.name for t in SUPPORTED_TYPES)
        raise ValueError(f"dequantize: ggml type {name} is not supported (supported: {supported})")
    qtype = GGMLType(int(qtype))
    if raw.dtype != torch.uint8:
        raise ValueError(f"dequantize: raw must be uint8 bytes, got {raw.dtype}")
    shape = tuple(int(s) for s in shape)
    block_elems, block_bytes = BLOCK_LAYOUT[qtype]
    if block_elems > 1 and (not shape or shape[-1] % block_elems):
        raise ValueError(
            f"dequantize: {qtype.name} blocks hold {block_elems} values, "
            f"but the last axis of shape {shape} is not a multiple of that"
        )
    expected = tensor_nbytes(qtype, prod(shape))
    if raw.numel() != expected:
        raise ValueError(
            f"dequantize: {qtype.name} tensor of shape {shape} needs {expected} bytes, got {raw.numel()}"
        )

    flat = raw.reshape(-1)
    if qtype in _PLAIN_FLOATS:
        float_dtype = _PLAIN_FLOATS[qtype]
        if flat.storage_offset() % float_dtype.itemsize:
            flat = flat.clone()  # reinterpreting bytes needs an aligned start
        # bf16 -> fp32 and fp16 -> fp32 are exact, so a cast matches gguf-py.
        values = flat.view(float_dtype).float()
    else:
        blocks = flat.view(-1, block_bytes)  # [n_blocks, block_bytes]
        values = _BLOCK_DECODERS[qtype](blocks)  # [n_blocks, block_elems]
    return values.reshape(shape).to(dtype)


def dequantize(
    raw: torch.Tensor,
    qtype: GGMLType,
    shape: tuple[int, ...],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Decode a GGUF tensor's bytes; same contract as ``dequantize_ref``.

    Runs the implementation the registry picks for the arguments: the Triton
    kernels (``gguf_dequant_triton``) for CUDA tensors of the types they cover,
    the reference otherwise.
    """
    return _dispatch_dequantize(raw, qtype, shape, dtype)


def dequantize_mxfp4_interleaved_ref(
    blocks: torch.Tensor,
    scales: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Decode MXFP4 weights in the gpt-oss checkpoint layout.

    Value ``2i`` of a block is the E2M1 code in the low nibble of byte ``i`` and
    value ``2i+1`` the code in its high nibble; the block's scale is
    ``2^(scales - 127)``. Code 8 decodes to -0.0 here (as in the checkpoint's
    own decoders), where ggml's MXFP4 gives +0.0.

    Args:
        blocks: uint8 ``[..., G, 16]``, 32 four-bit codes per group.
        scales: uint8 ``[..., G]``, E8M0 exponent per group.
        dtype: dtype of the result; computed in float32, then cast.

    Returns:
        ``[..., G*32]`` in ``dtype``, on ``blocks``' device.
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"mxfp4: blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != 16 or scales.shape != blocks.shape[:-1]:
        raise ValueError(
            f"mxfp4: expected blocks [..., G, 16] and scales [..., G], "
            f"got {tuple(blocks.shape)} and {tuple(scales.shape)}"
        )
    lut = torch.tensor(_E2M1_DOUBLED_SIGNED_ZERO, dtype=torch.float32, device=blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1)  # [..., G, 16, 2]
    values = lut[codes.flatten(-2).long()]  # [..., G, 32]
    # Doubled codes times 2^(E-128) equals E2M1 times 2^(E-127), and both
    # products are exact, so this agrees with ldexp(E2M1, E-127).
    values = values.mul_(_e8m0_half(scales).unsqueeze(-1))
    return values.flatten(-2).to(dtype)


register("dequantize", "reference", dequantize_ref)
register("dequantize", "triton", _triton.dequantize_triton, devices=("cuda",), supports=_triton.triton_supports)
_dispatch_dequantize = dispatch("dequantize")

register("dequantize_mxfp4_interleaved", "reference", dequantize_mxfp4_interleaved_ref)
register("dequantize_mxfp4_interleaved", "triton", _triton.dequantize_mxfp4_interleaved_triton, devices=("cuda",),
         supports=_triton.mxfp4_interleaved_supports)
dequantize_mxfp4_interleaved = dispatch("dequantize_mxfp4_interleaved")

DEQUANTIZE_SPEC = register_spec(OpSpec(
    op="dequantize",
    reference=dequantize_ref,
    make_inputs=_triton.make_inputs,
    cases=_triton.CASES,
    model_cases=_triton.MODEL_CASES,
    bytes_moved=_triton.bytes_moved,
    exact=True,
    out_arg="out",
    launch_config=_triton.DequantConfig,
    notes="the qtype is part of each case (its name starts with the type); bytes = blocks read + values written",
))

DEQUANTIZE_MXFP4_INTERLEAVED_SPEC = register_spec(OpSpec(
    op="dequantize_mxfp4_interleaved",
    reference=dequantize_mxfp4_interleaved_ref,
    make_inputs=_triton.make_mxfp4_interleaved_inputs,
    cases=_triton.MXFP4_INTERLEAVED_CASES,
    model_cases=_triton.MXFP4_INTERLEAVED_MODEL_CASES,
    bytes_moved=_triton.mxfp4_interleaved_bytes_moved,
    exact=True,
    out_arg="out",
    launch_config=_triton.DequantConfig,
))
