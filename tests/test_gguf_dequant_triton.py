"""Checks of the Triton GGUF dequantization kernels (qml_kernels.gguf_dequant_triton).

Dequantization is bit-exact, so there is no tolerance table: an fp32 output must equal
``dequantize_ref`` bit for bit, and an fp16 output must equal the reference's fp32
values cast to fp16 (bf16 likewise, but only on the GPU: the interpreter computes bf16
wrongly). Outputs are NaN-poisoned before the kernel runs, so an element it forgets to
write fails, and NaN never passes (bit patterns are compared). Inputs are fresh random
blocks every run; the seed is in every failure message, and QML_TEST_SEED replays one.
"""

import os

import pytest
import torch

from qml_kernels.ggml_types import BLOCK_LAYOUT, GGMLType, tensor_nbytes
from qml_kernels.gguf_dequant import (
    DEQUANTIZE_MXFP4_INTERLEAVED_SPEC,
    DEQUANTIZE_SPEC,
    dequantize,
    dequantize_mxfp4_interleaved,
    dequantize_mxfp4_interleaved_ref,
    dequantize_ref,
)
from qml_kernels.gguf_dequant_triton import (
    BLOCK_TYPES,
    DequantConfig,
    _dequant_kquant_kernel,
    _dequant_mxfp4_interleaved_kernel,
    _dequant_q32_kernel,
    dequantize_mxfp4_interleaved_triton,
    dequantize_triton,
)
from qml_kernels.registry import KernelUnavailable, select, using
from qml_kernels.workbench.spec import Case

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# the interpreter gets bf16 wrong silently, so bf16 is only checked on the GPU
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
_BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


@pytest.fixture
def seed() -> int:
    return int(os.environ.get("QML_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(DEVICE).manual_seed(seed)


def assert_bit_exact(got: torch.Tensor, want: torch.Tensor, context: str) -> None:
    assert got.dtype == want.dtype, f"{context}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{context}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.isfinite(want).all(), f"{context}: non-finite reference (bad test input)"
    differ = got.view(_BITS[got.dtype]) != want.view(_BITS[want.dtype])
    if differ.any():
        i = tuple(int(k) for k in differ.nonzero()[0])
        raise AssertionError(f"{context}: {int(differ.sum())}/{differ.numel()} values differ; "
                             f"first at {i}: got {got[i].item()!r}, want {want[i].item()!r}")


def _poisoned(shape, dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", DEQUANTIZE_SPEC.cases, ids=lambda c: c.name)
def test_dequantize_bit_exact(case, dtype, seed):
    inputs = DEQUANTIZE_SPEC.make_inputs(case, dtype, DEVICE, _gen(seed))
    out = _poisoned(inputs["shape"], dtype)
    got = dequantize_triton(**inputs, out=out)
    assert got is out
    want = dequantize_ref(inputs["raw"], inputs["qtype"], inputs["shape"]).to(dtype)
    assert_bit_exact(got, want, f"{case.name} ({case.edge}) {dtype} seed={seed}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", DEQUANTIZE_MXFP4_INTERLEAVED_SPEC.cases, ids=lambda c: c.name)
def test_mxfp4_interleaved_bit_exact(case, dtype, seed):
    inputs = DEQUANTIZE_MXFP4_INTERLEAVED_SPEC.make_inputs(case, dtype, DEVICE, _gen(seed))
    want = dequantize_mxfp4_interleaved_ref(inputs["blocks"], inputs["scales"]).to(dtype)
    got = dequantize_mxfp4_interleaved_triton(**inputs, out=_poisoned(want.shape, dtype))
    # -0.0 (code 8 in the checkpoint's convention) is compared by its bits too
    assert_bit_exact(got, want, f"mxfp4 interleaved {case.name} ({case.edge}) {dtype} seed={seed}")


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_small_programs_partial_last(qtype, seed):
    # 512 values per program: 2 super-blocks or 16 blocks, so 9 super-blocks / 21 blocks
    # leave the last program partly masked, with one warp per program
    config = DequantConfig(values_per_program=512, num_warps=1)
    block_elems = BLOCK_LAYOUT[qtype][0]
    shape = (3, 3 * block_elems) if block_elems == 256 else (3, 7 * block_elems)
    inputs = DEQUANTIZE_SPEC.make_inputs(Case("edge", {"qtype": qtype, "shape": shape}), torch.float32, DEVICE,
                                         _gen(seed))
    got = dequantize_triton(**inputs, out=_poisoned(shape, torch.float32), config=config)
    want = dequantize_ref(inputs["raw"], qtype, shape)
    assert_bit_exact(got, want, f"{qtype.name} {shape} {config} seed={seed}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("qtype", [GGMLType.F32, GGMLType.F16, GGMLType.BF16], ids=lambda t: t.name)
def test_plain_floats_are_cast(qtype, dtype, seed):
    source = {GGMLType.F32: torch.float32, GGMLType.F16: torch.float16, GGMLType.BF16: torch.bfloat16}[qtype]
    values = torch.randn(3, 40, generator=_gen(seed), device=DEVICE).to(source)
    raw = values.view(torch.uint8).reshape(-1)
    got = dequantize_triton(raw, qtype, (3, 40), dtype, out=_poisoned((3, 40), dtype))
    assert_bit_exact(got, dequantize_ref(raw, qtype, (3, 40)).to(dtype), f"{qtype.name} -> {dtype} seed={seed}")


def test_public_functions_dispatch_to_triton(seed):
    gen = _gen(seed)
    for qtype, shape in [(GGMLType.Q4_K, (3, 512)), (GGMLType.Q8_0, (2, 96)), (GGMLType.MXFP4, (4, 64))]:
        case = Case(qtype.name, {"qtype": qtype, "shape": shape})
        raw = DEQUANTIZE_SPEC.make_inputs(case, torch.float16, DEVICE, gen)["raw"]
        with using("triton"):
            assert select("dequantize", raw, qtype, shape, torch.float16).name == "triton"
            got = dequantize(raw, qtype, shape, torch.float16)
        assert_bit_exact(got, dequantize_ref(raw, qtype, shape).to(torch.float16), f"{qtype.name} seed={seed}")
    inputs = DEQUANTIZE_MXFP4_INTERLEAVED_SPEC.make_inputs(DEQUANTIZE_MXFP4_INTERLEAVED_SPEC.cases[2],
                                                           torch.float32, DEVICE, gen)
    with using("triton"):
        assert select("dequantize_mxfp4_interleaved", **inputs).name == "triton"
        got = dequantize_mxfp4_interleaved(**inputs)
    assert_bit_exact(got, dequantize_mxfp4_interleaved_ref(inputs["blocks"], inputs["scales"]), f"seed={seed}")


def test_types_without_a_kernel_are_refused_when_forced():
    raw = torch.zeros(tensor_nbytes(GGMLType.Q8_K, 256), dtype=torch.uint8, device=DEVICE)
    with using("triton"), pytest.raises(KernelUnavailable):
        dequantize(raw, GGMLType.Q8_K, (256,))


def test_launcher_rejects_bad_arguments():
    raw = torch.zeros(tensor_nbytes(GGMLType.Q4_K, 512), dtype=torch.uint8, device=DEVICE)
    with pytest.raises(AssertionError, match="needs 288 bytes"):
        dequantize_triton(raw[:-1], GGMLType.Q4_K, (2, 256))
    with pytest.raises(AssertionError, match="uint8"):
        dequantize_triton(raw.view(torch.int8), GGMLType.Q4_K, (2, 256))
    with pytest.raises(AssertionError, match="not a multiple"):
        dequantize_triton(raw, GGMLType.Q4_K, (4, 128))
    with pytest.raises(AssertionError, match="out: dtype"):
        dequantize_triton(raw, GGMLType.Q4_K, (2, 256), torch.float16, out=_poisoned((2, 256), torch.float32))
    with pytest.raises(AssertionError, match="out: shape"):
        dequantize_triton(raw, GGMLType.Q4_K, (2, 256), out=_poisoned((512,), torch.float32))
    with pytest.raises(AssertionError, match="blocks \\[..., G, 16\\]"):
        dequantize_mxfp4_interleaved_triton(raw[:32].view(2, 16), raw[:3])
    with pytest.raises(ValueError, match="power of 2"):
        DequantConfig(values_per_program=384)


# Every kernel variant as it runs on the H200: bf16 output, the default config.
_DEFAULT = DequantConfig()
_BLOCK_SIGNATURE = {"raw_ptr": "*u8", "out_ptr": "*bf16", "n_blocks": "i32", "QTYPE": "constexpr",
                    "BLOCK_BYTES": "constexpr", "BLOCKS": "constexpr"}
COMPILE_VARIANTS = {
    t.name: (_dequant_kquant_kernel if BLOCK_LAYOUT[t][0] == 256 else _dequant_q32_kernel, _BLOCK_SIGNATURE,
             {"QTYPE": int(t), "BLOCK_BYTES": BLOCK_LAYOUT[t][1],
              "BLOCKS": _DEFAULT.values_per_program // BLOCK_LAYOUT[t][0]})
    for t in BLOCK_TYPES
}
COMPILE_VARIANTS["MXFP4-interleaved"] = (
    _dequant_mxfp4_interleaved_kernel,
    {"blocks_ptr": "*u8", "scales_ptr": "*u8", "out_ptr": "*bf16", "n_groups": "i32", "GROUPS": "constexpr"},
    {"GROUPS": _DEFAULT.values_per_program // 32},
)


@pytest.fixture(scope="module")
def compile_reports() -> dict:
    from qml_kernels.workbench.compile import compile_checks

    requests = [dict(kernel=kernel, signature=signature, constexprs=constexprs, num_warps=_DEFAULT.num_warps)
                for kernel, signature, constexprs in COMPILE_VARIANTS.values()]
    return dict(zip(COMPILE_VARIANTS, compile_checks(requests)))


@pytest.mark.parametrize("variant", list(COMPILE_VARIANTS))
def test_compiles_for_hopper(variant, compile_reports):
    report = compile_reports[variant]
    assert report.ok, report.error
    assert report.spills in (0, None), report.summary()
    # 32-56 registers at the time of writing; 96 would still fit 5 four-warp programs per SM
    assert report.registers is None or report.registers <= 96, report.summary()
    # subnormal scales (fp16 d, E8M0 below 2^-126) must survive: no flush-to-zero arithmetic
    assert ".ftz" not in report.ptx, f"{variant}: flush-to-zero instructions in the PTX"
    if variant in ("Q4_K", "Q5_K", "MXFP4-interleaved"):  # aligned code bytes: vector loads (8 or 16 bytes,
        # as the program's share per thread allows)
        assert "ld.global.v4.b32" in report.ptx or "ld.global.v2.b32" in report.ptx, report.summary()
    assert "st.global.v4.b32" in report.ptx, f"{variant}: values are not written with 16-byte stores"
