"""The Triton GEMM behind ``linear`` against its reference (interpreter on CPU), the tuning table
that routes shapes between Triton and cuBLAS, and the kernel's compilation for Hopper."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F

from qml_kernels import registry
from qml_kernels.gemv import MAX_TOKENS, GemvConfig
from qml_kernels.linear import (
    H200_SMS,
    LINEAR_SPEC,
    LinearConfig,
    _linear_kernel,
    _make_config,
    default_config,
    linear,
    linear_config,
    linear_ref,
    linear_triton,
    load_linear_table,
    preferred_impl,
    use_tuning_table,
)
from qml_kernels.tuning import TABLE_DIR, find_table, token_bucket, write_table
from qml_kernels.workbench.compile import compile_checks
from qml_kernels.workbench.spec import Case

# max |out - ref| / max |ref|, ref in fp32: fp32 sums in a different order (K of a few hundred),
# fp16/bf16 round the output once
TOLERANCES = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# the interpreter computes bf16 wrongly without an error: bf16 is checked on the GPU only
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
CONFIGS = {
    "default": None,  # what linear_config picks: the heuristic (interpreter: large steps; no table on CPU)
    # the GPU heuristic's decode and prefill tiles, on a few programs
    "decode-tiles": dataclasses.replace(default_config(1, 4096, 4096, torch.float16), num_sms=4),
    "prefill-tiles": dataclasses.replace(default_config(8192, 4096, 4096, torch.float16), num_sms=4),
    # 16x16x32 tiles on 3 programs: several K steps with a K tail, several row-tiles per group,
    # and every program walking many tiles
    "small-tiles": LinearConfig(block_m=16, block_n=16, block_k=32, group_m=2, num_warps=4, num_stages=2,
                                num_sms=3),
    "tile-per-program": LinearConfig(block_m=32, block_n=32, block_k=32, group_m=4, num_warps=4, num_stages=2,
                                     persistent=False),
}


def _seeded() -> tuple[int, torch.Generator]:
    seed = int.from_bytes(os.urandom(4), "little")
    return seed, torch.Generator().manual_seed(seed)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite values in the output (an unwritten NaN-poisoned element?)"
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def _inputs(T: int, N: int, K: int, dtype=torch.float16) -> tuple[int, dict]:
    seed, gen = _seeded()
    return seed, LINEAR_SPEC.make_inputs(Case("t", {"T": T, "N": N, "K": K}), dtype, DEVICE, gen)


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", LINEAR_SPEC.cases, ids=lambda c: c.name)
def test_matches_reference(case, dtype, config):
    seed, gen = _seeded()
    inputs = LINEAR_SPEC.make_inputs(case, dtype, DEVICE, gen)
    x, w = inputs["x"], inputs["weight"]
    out = torch.full((x.shape[0], w.shape[0]), float("nan"), dtype=dtype, device=DEVICE)
    returned = linear_triton(x, w, out=out, config=config)
    assert returned is out
    err = _rel_err(out, linear_ref(x.float(), w.float()))
    assert err <= TOLERANCES[dtype], f"{case.name} ({case.edge}) {dtype} {config} seed={seed}: rel err {err:.2e}"


def test_strided_operands_and_output():
    """x and out as column slices of wider buffers (TMA takes any 16-byte aligned row stride)."""
    seed, gen = _seeded()
    T, N, K = 9, 24, 40
    wide_x = torch.randn(T, K + 24, generator=gen).to(DEVICE)  # [T, K + 24]
    x = wide_x[:, 8:8 + K]  # 32-byte offset, 256-byte row stride
    w = torch.randn(N, K, generator=gen).to(DEVICE)
    target = torch.full((T, N + 16), float("nan"), device=DEVICE)  # [T, N + 16]
    out = linear_triton(x, w, out=target[:, 4:4 + N], config=CONFIGS["small-tiles"])
    assert _rel_err(out, linear_ref(x, w)) <= TOLERANCES[torch.float32], f"seed={seed}"
    assert target[:, :4].isnan().all() and target[:, 4 + N:].isnan().all(), "wrote outside out's columns"


def test_zero_tokens():
    out = linear_triton(torch.empty(0, 32, device=DEVICE), torch.randn(16, 32, device=DEVICE))
    assert out.shape == (0, 16)


def test_launcher_rejects_bad_arguments():
    x, w = torch.randn(4, 32, device=DEVICE), torch.randn(16, 32, device=DEVICE)
    with pytest.raises(AssertionError, match="weight must be"):
        linear_triton(x, torch.randn(16, 24, device=DEVICE))
    with pytest.raises(AssertionError, match="weight dtype"):
        linear_triton(x, w.half())
    with pytest.raises(AssertionError, match="TMA needs"):
        linear_triton(torch.randn(4, 33, device=DEVICE)[:, 1:], w)  # 4-byte offset: unaligned base
    with pytest.raises(AssertionError, match="TMA needs"):
        linear_triton(x.t().contiguous().t(), w)  # K not contiguous
    with pytest.raises(AssertionError, match="out: shape"):
        linear_triton(x, w, out=torch.empty(4, 8, device=DEVICE))
    with pytest.raises(ValueError, match="power of 2"):
        LinearConfig(block_n=48)


def test_default_config_separates_decode_from_prefill():
    decode = default_config(1, 4096, 4096, torch.bfloat16)
    prefill = default_config(8192, 4096, 4096, torch.bfloat16)
    assert decode.block_m == 16 and decode.block_n < prefill.block_n
    assert (prefill.block_m, prefill.block_n, prefill.num_warps) == (128, 256, 8)
    for case in LINEAR_SPEC.model_cases:
        T, N, K = (case.dims[k] for k in ("T", "N", "K"))
        c = default_config(T, N, K, torch.bfloat16)
        tiles = -(-T // c.block_m) * -(-N // c.block_n)
        # decode streams the weight: every SM needs a share of it
        assert T > 64 or tiles >= 0.8 * H200_SMS, f"{case.name}: {tiles} tiles for {H200_SMS} SMs ({c})"
        stages = c.num_stages * (c.block_m + c.block_n) * c.block_k * 2 + c.block_m * c.block_n * 2
        assert stages <= 227 * 1024, f"{case.name}: {stages} B of shared memory ({c})"


# -- choosing between Triton and cuBLAS -----------------------------------------------------

TUNED = LinearConfig(block_m=16, block_n=32, block_k=32, group_m=1, num_warps=4, num_stages=2)


def test_tuning_table_routes_shapes(tmp_path):
    table = write_table(tmp_path / "linear_test.json", "linear", "H200", [
        {"dtype": "float16", "N": 64, "K": 32, "T": 8, "impl": "triton", "config": TUNED},
        {"dtype": "float16", "N": 64, "K": 32, "T": 128, "impl": "cublas", "config": None},
    ])
    triton_impl = registry.get_impl("linear", "triton")
    w = torch.randn(64, 32, device=DEVICE).half()
    with use_tuning_table(table):
        for T, expected in ((5, "triton"), (8, "triton"), (100, "cublas"), (300, "cublas")):
            x = torch.randn(T, 32, device=DEVICE).half()
            assert preferred_impl(x, w) == expected, f"T={T} (bucket {token_bucket(T)})"
            # the predicate registry.select consults on a GPU: triton claims only the table's shapes
            assert triton_impl.supports(x, w) == (expected == "triton"), f"T={T}"
        x = torch.randn(5, 32, device=DEVICE).half()
        assert linear_config(x, w) == TUNED  # linear_triton(config=None) launches the measured config
        assert preferred_impl(x.float(), w.float()) == "cublas"  # an fp32 call is another key
        assert preferred_impl(x[:, :24], w[:, :24]) == "cublas"  # absent (N, K)
        unaligned = torch.empty(5, 72, device=DEVICE).half()[:, 1:65]  # 2-byte offset: TMA cannot store there
        assert not triton_impl.supports(x, w, out=unaligned)
        with registry.using(linear="triton"):
            assert triton_impl.supports(torch.randn(300, 32, device=DEVICE).half(), w)  # forced: all it can run
    assert preferred_impl(x, w) == "cublas"  # no committed table names this shape
    heuristic = (default_config(5, 64, 32, torch.float16, torch.cuda.get_device_properties(DEVICE).multi_processor_count)
                 if DEVICE.type == "cuda" else LinearConfig(16, 256, 64, 1, 4, 2))  # interpreter: few large steps
    assert linear_config(x, w) == heuristic


_ENTRY = {"dtype": "bfloat16", "N": 64, "K": 32, "T": 8, "impl": "triton", "config": None}


@pytest.mark.parametrize("entries, match", [
    ([dict(_ENTRY, impl="cutlass")], "impl 'cutlass'"),
    ([dict(_ENTRY, config={"block_q": 64})], "bad config"),
    ([dict(_ENTRY, config={"block_m": 48})], "bad config"),
    ([{k: v for k, v in _ENTRY.items() if k != "K"}], "lacks"),
    ([_ENTRY, dict(_ENTRY, impl="cublas")], "repeats"),
], ids=["unknown-impl", "unknown-field", "bad-block", "missing-key", "repeated-key"])
def test_tuning_table_rejects_bad_entries(tmp_path, entries, match):
    with pytest.raises(ValueError, match=match):
        load_linear_table(write_table(tmp_path / "linear_bad.json", "linear", "H200", entries))


def test_committed_table():
    """The packaged H200 table loads, is found by the H200's device name, and only names real choices."""
    table = load_linear_table(TABLE_DIR / "linear_h200.json")
    impls = ("triton", "cublas", "gemv")
    found = find_table("linear", "NVIDIA H200", key_fields=("dtype", "N", "K", "T"), impls=impls,
                       make_config=_make_config)
    assert found is not None and found.source == table.source
    assert find_table("linear", "NVIDIA A100-SXM4-80GB", key_fields=("dtype", "N", "K", "T"), impls=impls) is None
    for (dtype, N, K, T), entry in table.entries.items():
        assert T == token_bucket(T), f"{(dtype, N, K, T)}: T must be a bucket (token_bucket)"
        expected = {"cublas": type(None), "triton": LinearConfig, "gemv": GemvConfig}[entry.impl]
        assert isinstance(entry.config, expected), f"{(dtype, N, K, T)}: {entry.impl} with {entry.config}"
        assert entry.impl != "gemv" or T <= MAX_TOKENS, f"{(dtype, N, K, T)}: more rows than the GEMV takes"


def test_token_bucket():
    assert [token_bucket(T) for T in (0, 1, 2, 3, 8, 9, 2048, 2049)] == [1, 1, 2, 4, 8, 16, 2048, 4096]
    # a turn's token counts, in steps of 32 (the prefill graphs' 160, 192 and 256 among them)
    assert [token_bucket(T) for T in (128, 129, 150, 160, 161, 219, 256, 257)] == [128, 160, 160, 160, 192, 224,
                                                                                    256, 512]


def test_public_linear_dispatch():
    """What the engine calls: torch on CPU by default, the kernel when triton is forced, the reference
    when the reference is forced."""
    seed, inputs = _inputs(7, 200, 152)
    x, w = inputs["x"], inputs["weight"]
    with registry.using("triton"):
        assert registry.select("linear", x, w).name == "triton"
        out = linear(x, w)
    assert _rel_err(out, linear_ref(x.float(), w.float())) <= TOLERANCES[torch.float16], f"seed={seed}"
    with registry.using("reference"):
        assert torch.equal(linear(x, w), linear_ref(x, w))
    if DEVICE.type == "cpu":
        assert torch.equal(linear(x, w), F.linear(x, w))  # oneDNN/MKL, not the fp32-upcast reference


# -- compilation for the H200 (sm_90a) -------------------------------------------------------

def _variant(T: int, N: int, K: int) -> dict:
    """The bf16 kernel as the launcher specialises it for a [T, K] x [N, K]^T product on the H200."""
    c = default_config(T, N, K, torch.bfloat16)
    signature = {
        "x_desc": f"tensordesc<bf16[{c.block_m}, {c.block_k}]>",
        "w_desc": f"tensordesc<bf16[{c.block_n}, {c.block_k}]>",
        "out_desc": f"tensordesc<bf16[{c.block_m}, {c.block_n}]>",
        "T": "i32", "N": "i32", "K": "i32", "num_programs": "i32",
        "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "GROUP_M": "constexpr",
        "PRECISION": "constexpr",
    }
    constexprs = {"BLOCK_M": c.block_m, "BLOCK_N": c.block_n, "BLOCK_K": c.block_k, "GROUP_M": c.group_m,
                  "PRECISION": "tf32"}
    return {"kernel": _linear_kernel, "signature": signature, "constexprs": constexprs,
            "num_warps": c.num_warps, "num_stages": c.num_stages, "divisible": ("N", "K")}


COMPILE_VARIANTS = {  # name: (variant, whether the tile is large enough for wgmma's 64-row minimum)
    "prefill-128x256-llama-o-T8192": (_variant(8192, 4096, 4096), True),
    "mid-64x64-llama-o-T128": (_variant(128, 4096, 4096), True),
    "decode-16x32-llama-o-T1": (_variant(1, 4096, 4096), False),
}


@pytest.fixture(scope="module")
def compile_reports() -> dict:
    reports = compile_checks([variant for variant, _ in COMPILE_VARIANTS.values()])
    return dict(zip(COMPILE_VARIANTS, (dataclasses.asdict(r) for r in reports)))


@pytest.mark.parametrize("name", COMPILE_VARIANTS)
def test_compiles_for_hopper(compile_reports, name):
    report, wgmma = compile_reports[name], COMPILE_VARIANTS[name][1]
    assert report["ok"], report["error"]
    assert ".target sm_90a" in report["ptx"]
    # the point of the kernel: TMA feeds shared memory, wgmma reads it (decode's 16-row tile uses mma.sync)
    assert report["has_tma"], f"{name}: no cp.async.bulk.tensor (TMA) in the PTX"
    assert report["has_wgmma"] == wgmma, f"{name}: wgmma={report['has_wgmma']}, expected {wgmma}"
    assert report["spills"] in (0, None), f"{name}: {report['spills']} spill bytes"
    assert report["shared_bytes"] <= 227 * 1024, f"{name}: {report['shared_bytes']} B shared"
