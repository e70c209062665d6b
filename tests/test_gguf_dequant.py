"""Checks of qml_kernels.gguf_dequant against gguf-py's numpy dequantization.

Dequantization is compared bit-exact (float32 bit patterns) and NaN never
passes. Inputs are random bytes with the scale fields overwritten by finite
values; each run draws a new seed, printed in every failure message. Set
QML_TEST_SEED to replay one.
"""

import os

import numpy as np
import pytest
import torch

from qml_kernels.ggml_types import BLOCK_LAYOUT, GGMLType, tensor_nbytes
from qml_kernels.gguf_dequant import (
    SUPPORTED_TYPES,
    dequantize,
    dequantize_mxfp4_interleaved_ref,
    dequantize_ref,
)

try:  # gguf is a dev dependency; the GPU machine may lack it
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize
except ImportError:
    gguf_dequantize = None
needs_gguf = pytest.mark.skipif(gguf_dequantize is None, reason="needs the gguf package (dev dependency)")

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

# Byte offsets of the fp16 scale fields (d, dmin, m) in each block
# (ggml-common.h); random bytes there could be inf/NaN, so they are replaced.
FP16_FIELDS: dict[GGMLType, tuple[int, ...]] = {
    GGMLType.Q4_0: (0,),
    GGMLType.Q4_1: (0, 2),
    GGMLType.Q5_0: (0,),
    GGMLType.Q5_1: (0, 2),
    GGMLType.Q8_0: (0,),
    GGMLType.Q2_K: (80, 82),
    GGMLType.Q3_K: (108,),
    GGMLType.Q4_K: (0, 2),
    GGMLType.Q5_K: (0, 2),
    GGMLType.Q6_K: (208,),
}
PLAIN_FLOATS = {GGMLType.F32: torch.float32, GGMLType.F16: torch.float16, GGMLType.BF16: torch.bfloat16}

# Shapes in blocks: the last axis is multiplied by the type's block size.
SHAPES_IN_BLOCKS = [
    (1,),  # a single block
    (1, 24),  # a single row of many blocks
    (3, 2),  # odd number of rows
    (37, 1),  # more rows than gguf-py's 16-row groups, and not a multiple of 16
    (4, 3, 2),  # 3-D expert-stacked tensor [E, out, in]
]


@pytest.fixture
def seed() -> int:
    return int(os.environ.get("QML_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))


def _fp16_bytes(n: int, gen: torch.Generator) -> torch.Tensor:
    """n finite fp16 values of either sign, magnitudes 2^-20 (subnormal) to 2,
    as [n, 2] bytes."""
    exponent = torch.rand(n, generator=gen) * 21 - 20
    sign = torch.randint(0, 2, (n,), generator=gen) * 2 - 1
    values = (sign * torch.exp2(exponent)).to(torch.float16)
    return values.view(torch.uint8).view(n, 2)


def random_tensor_bytes(qtype: GGMLType, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Valid random bytes of a tensor of ``shape`` in ``qtype``: [nbytes] uint8."""
    n_elements = int(np.prod(shape))
    if qtype in PLAIN_FLOATS:
        # Normal values over a wide range of exponents (subnormals included),
        # kept inside the dtype's finite range.
        low, high = (-20, 10) if qtype == GGMLType.F16 else (-30, 30)
        exponent = torch.randint(low, high + 1, (n_elements,), generator=gen)
        values = torch.randn(n_elements, generator=gen) * torch.exp2(exponent)
        return values.to(PLAIN_FLOATS[qtype]).view(torch.uint8).reshape(-1)
    block_elems, block_bytes = BLOCK_LAYOUT[qtype]
    n_blocks = n_elements // block_elems
    blocks = torch.randint(0, 256, (n_blocks, block_bytes), dtype=torch.uint8, generator=gen)
    for offset in FP16_FIELDS.get(qtype, ()):
        blocks[:, offset : offset + 2] = _fp16_bytes(n_blocks, gen)
    if qtype == GGMLType.MXFP4:
        # Typical exponents, plus 0 and 1 (subnormal scales) and a large one.
        blocks[:, 0] = torch.randint(110, 140, (n_blocks,), dtype=torch.uint8, generator=gen)
        blocks[0, 0] = 0
        blocks[-1, 0] = 1 if n_blocks > 1 else 250
    return blocks.reshape(-1)


def gguf_reference(raw: torch.Tensor, qtype: GGMLType, shape: tuple[int, ...]) -> np.ndarray:
    block_elems, block_bytes = BLOCK_LAYOUT[qtype]
    byte_shape = (*shape[:-1], shape[-1] // block_elems * block_bytes)
    ref = gguf_dequantize(raw.cpu().numpy().reshape(byte_shape), GGMLQuantizationType(int(qtype)))
    return np.ascontiguousarray(ref, dtype=np.float32)


def assert_bit_exact(ours: torch.Tensor, ref: torch.Tensor, context: str) -> None:
    assert ours.dtype == torch.float32 and ref.dtype == torch.float32, context
    assert tuple(ours.shape) == tuple(ref.shape), f"{context}: shape {tuple(ours.shape)} != {tuple(ref.shape)}"
    ours, ref = ours.cpu().contiguous(), ref.cpu().contiguous()
    assert not torch.isnan(ours).any(), f"{context}: NaN in output"
    assert not torch.isnan(ref).any(), f"{context}: NaN in reference (bad test input)"
    mismatch = ours.view(torch.int32) != ref.view(torch.int32)
    if mismatch.any():
        i = tuple(int(k) for k in mismatch.nonzero()[0])
        raise AssertionError(
            f"{context}: {int(mismatch.sum())}/{mismatch.numel()} values differ; "
            f"first at {i}: ours {ours[i].item()!r}, reference {ref[i].item()!r}"
        )


@needs_gguf
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape_in_blocks", SHAPES_IN_BLOCKS, ids=str)
@pytest.mark.parametrize("qtype", SUPPORTED_TYPES, ids=lambda t: t.name)
def test_matches_gguf_bit_exact(qtype, shape_in_blocks, device, seed):
    gen = torch.Generator().manual_seed(seed)
    block_elems = BLOCK_LAYOUT[qtype][0]
    shape = (*shape_in_blocks[:-1], shape_in_blocks[-1] * block_elems)
    raw = random_tensor_bytes(qtype, shape, gen)
    context = f"{qtype.name} shape={shape} device={device} seed={seed}"

    ref = torch.from_numpy(gguf_reference(raw, qtype, shape))
    out = dequantize_ref(raw.to(device), qtype, shape)
    assert out.device.type == device, context
    assert_bit_exact(out, ref, context)
    assert_bit_exact(dequantize(raw.to(device), qtype, shape), ref, context + " (public dequantize)")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("qtype", SUPPORTED_TYPES, ids=lambda t: t.name)
def test_output_dtype_is_cast_of_fp32(qtype, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    shape = (3, 2 * BLOCK_LAYOUT[qtype][0])
    raw = random_tensor_bytes(qtype, shape, gen)
    got = dequantize_ref(raw, qtype, shape, dtype=dtype)
    want = dequantize_ref(raw, qtype, shape).to(dtype)
    assert got.dtype == dtype and got.shape == want.shape
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"{qtype.name} {dtype} seed={seed}"


@pytest.mark.parametrize("qtype", [GGMLType.Q4_1, GGMLType.Q6_K, GGMLType.F16])
def test_wrong_byte_count_raises(qtype):
    shape = (2, BLOCK_LAYOUT[qtype][0])
    nbytes = tensor_nbytes(qtype, 2 * BLOCK_LAYOUT[qtype][0])
    for wrong in (nbytes - 1, nbytes + 1, nbytes // 2):
        with pytest.raises(ValueError, match=qtype.name):
            dequantize_ref(torch.zeros(wrong, dtype=torch.uint8), qtype, shape)


def test_row_not_whole_blocks_raises():
    # 64 values are two whole Q8_0 blocks in total, but rows of 16 would split them.
    with pytest.raises(ValueError, match="multiple"):
        dequantize_ref(torch.zeros(tensor_nbytes(GGMLType.Q8_0, 64), dtype=torch.uint8), GGMLType.Q8_0, (4, 16))


def test_non_uint8_input_raises():
    with pytest.raises(ValueError, match="uint8"):
        dequantize_ref(torch.zeros(34, dtype=torch.int8), GGMLType.Q8_0, (32,))


@pytest.mark.parametrize("qtype", [GGMLType.Q8_K, GGMLType.Q8_1, GGMLType.I8, GGMLType.F64], ids=lambda t: t.name)
def test_unsupported_type_raises(qtype):
    with pytest.raises(ValueError, match=f"{qtype.name}.*not supported"):
        dequantize_ref(torch.zeros(4096, dtype=torch.uint8), qtype, (256,))


def test_type_unknown_to_ggml_types_raises():
    # 16 is IQ2_XXS in gguf's enum, a type qml_kernels.ggml_types does not list.
    with pytest.raises(ValueError, match="16.*not supported"):
        dequantize_ref(torch.zeros(4096, dtype=torch.uint8), 16, (256,))


# E2M1 code -> value (OCP MX spec): bit 3 is the sign.
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def mxfp4_interleaved_loop(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """One value at a time, as the gpt-oss checkpoint defines it."""
    *lead, groups, _ = blocks.shape
    out = np.empty((*lead, groups * 32), dtype=np.float32)
    for idx in np.ndindex(*lead, groups):
        scale = 2.0 ** (int(scales[idx]) - 127)
        for i in range(16):
            byte = int(blocks[idx][i])
            out[(*idx[:-1], idx[-1] * 32 + 2 * i)] = E2M1[byte & 0x0F] * scale
            out[(*idx[:-1], idx[-1] * 32 + 2 * i + 1)] = E2M1[byte >> 4] * scale
    return out


def random_mxfp4_checkpoint(lead: tuple[int, ...], groups: int, gen: torch.Generator):
    blocks = torch.randint(0, 256, (*lead, groups, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(110, 140, (*lead, groups), dtype=torch.uint8, generator=gen)
    edges = torch.tensor([0, 1, 127], dtype=torch.uint8)  # subnormal and unit scales
    n = min(scales.numel(), len(edges))
    scales.view(-1)[:n] = edges[:n]
    return blocks, scales


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "lead, groups",
    [
        ((), 1),  # a single group, no leading axes
        ((3,), 5),  # odd number of rows
        ((2, 3), 4),  # expert-stacked [E, out, G, 16]
    ],
    ids=str,
)
def test_mxfp4_interleaved_matches_loop(lead, groups, device, seed):
    gen = torch.Generator().manual_seed(seed)
    blocks, scales = random_mxfp4_checkpoint(lead, groups, gen)
    ref = torch.from_numpy(mxfp4_interleaved_loop(blocks.numpy(), scales.numpy()))
    out = dequantize_mxfp4_interleaved_ref(blocks.to(device), scales.to(device))
    assert_bit_exact(out, ref, f"mxfp4 interleaved lead={lead} G={groups} device={device} seed={seed}")
    half = dequantize_mxfp4_interleaved_ref(blocks, scales, dtype=torch.bfloat16)
    assert torch.equal(half.view(torch.int16), out.cpu().to(torch.bfloat16).view(torch.int16)), f"seed={seed}"


def test_mxfp4_interleaved_equals_ggml_after_repacking(seed):
    # llama.cpp converts gpt-oss by moving the nibbles into ggml's split-half
    # order and prepending the scale byte; both decoders must then agree, up to
    # the sign of zero (ggml decodes code 8 to +0, the checkpoint to -0).
    gen = torch.Generator().manual_seed(seed)
    blocks, scales = random_mxfp4_checkpoint((6,), 3, gen)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2)  # [6, 3, 32]
    split_half = codes[..., :16] | (codes[..., 16:] << 4)  # [6, 3, 16]
    ggml_raw = torch.cat([scales.unsqueeze(-1), split_half], dim=-1).reshape(-1)
    ggml = dequantize_ref(ggml_raw, GGMLType.MXFP4, (6, 96))
    interleaved = dequantize_mxfp4_interleaved_ref(blocks, scales)
    assert_bit_exact(interleaved + 0.0, ggml, f"seed={seed}")  # x + 0.0 turns -0 into +0


def test_mxfp4_interleaved_rejects_bad_shapes():
    with pytest.raises(ValueError, match="blocks"):
        dequantize_mxfp4_interleaved_ref(torch.zeros(2, 8, dtype=torch.uint8), torch.zeros(2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="blocks"):
        dequantize_mxfp4_interleaved_ref(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(3, dtype=torch.uint8))
