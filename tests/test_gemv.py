"""The decode GEMV behind ``linear`` (``qml_kernels.gemv``): against the reference in the
interpreter on CPU (fp32, fp16), its routing by the tuning table, and its compilation for Hopper."""

from __future__ import annotations

import os

import pytest
import torch

from qml_kernels import registry
from qml_kernels.gemv import MAX_TOKENS, GemvConfig, _gemv_kernel, gemv_capable, gemv_triton
from qml_kernels.linear import linear_ref, load_linear_table, preferred_impl, use_tuning_table
from qml_kernels.tuning import write_table
from qml_kernels.workbench.compile import assert_compiled_for_hopper

TOLERANCES = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# the interpreter computes bf16 wrongly without an error: bf16 is checked on the GPU only
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
CONFIGS = {
    "default": None,
    "one-row-programs": GemvConfig(block_n=1, block_k=64, num_warps=1),  # a K tail in every program
    "wide": GemvConfig(block_n=8, block_k=256, num_warps=4),  # K = 200 < block_k: one masked step
}
# (T, N, K): decode rows, output features with a tail past block_n, reductions with a tail past block_k
SHAPES = [(1, 37, 200), (2, 64, 64), (3, 19, 130), (4, 96, 513)]


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite values in the output (an unwritten NaN-poisoned element?)"
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-N{}-K{}".format(*s))
def test_gemv_matches_reference(shape, dtype, config):
    T, N, K = shape
    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(N, K, generator=gen) * K**-0.5).to(DEVICE, dtype)
    out = torch.full((T, N), float("nan"), dtype=dtype, device=DEVICE)
    assert gemv_triton(x, w, out=out, config=config) is out
    err = _rel_err(out, linear_ref(x.float(), w.float()))
    assert err <= TOLERANCES[dtype], f"T={T} N={N} K={K} {dtype} seed={seed}: rel err {err:.2e}"


def test_gemv_takes_rows_with_a_stride():
    """A view of every other row of a larger buffer (x's rows need not be adjacent)."""
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(6, 80, generator=gen).to(DEVICE)
    x, w = base[::2], torch.randn(24, 80, generator=gen).to(DEVICE)
    assert not x.is_contiguous() and gemv_capable(x, w)
    torch.testing.assert_close(gemv_triton(x, w), linear_ref(x, w), rtol=1e-5, atol=1e-5)


def test_what_gemv_refuses():
    w = torch.randn(16, 32)
    assert not gemv_capable(torch.randn(MAX_TOKENS + 1, 32), w)  # more rows than the accumulator holds
    assert not gemv_capable(torch.randn(2, 32).half(), w)  # mixed dtypes
    assert not gemv_capable(torch.randn(32, 2).T, w)  # a strided reduction dimension
    assert not gemv_capable(torch.randn(2, 31), w)  # K mismatch
    with pytest.raises(ValueError):
        GemvConfig(block_n=3)
    with pytest.raises(ValueError):
        GemvConfig(block_k=8)


def test_tuning_table_routes_decode_shapes_to_gemv(tmp_path):
    config = GemvConfig(block_n=2, block_k=128, num_warps=2)
    table = write_table(tmp_path / "linear_test.json", "linear", "H200", [
        {"dtype": "float16", "N": 64, "K": 32, "T": 1, "impl": "gemv", "config": config},
        {"dtype": "float16", "N": 64, "K": 32, "T": 4, "impl": "gemv", "config": None},
        {"dtype": "float16", "N": 64, "K": 32, "T": 8, "impl": "cublas", "config": None},
    ])
    loaded = load_linear_table(table)
    assert loaded.lookup("float16", 64, 32, 1).config == config  # read back as the GEMV's config
    gemv_impl = registry.get_impl("linear", "gemv")
    w = torch.randn(64, 32, device=DEVICE).half()
    with use_tuning_table(table):
        for T, expected in ((1, "gemv"), (3, "gemv"), (4, "gemv"), (8, "cublas")):
            x = torch.randn(T, 32, device=DEVICE).half()
            assert preferred_impl(x, w) == expected, f"T={T}"
            assert gemv_impl.supports(x, w) == (expected == "gemv"), f"T={T}"
        with registry.using(linear="gemv"):  # forced: every shape it can take
            assert gemv_impl.supports(torch.randn(2, 32, device=DEVICE).half(), w[:48])
    assert preferred_impl(torch.randn(1, 32, device=DEVICE).half(), w) == "cublas"  # not in a committed table


def test_a_table_named_by_the_environment_replaces_the_committed_one(tmp_path, monkeypatch):
    from qml_kernels import linear

    table = tmp_path / "linear_try.json"
    write_table(table, "linear", "H200", [{"dtype": "float16", "N": 64, "K": 32, "T": 1, "impl": "gemv",
                                           "config": None}])
    w, x = torch.randn(64, 32, device=DEVICE).half(), torch.randn(1, 32, device=DEVICE).half()
    try:
        monkeypatch.setenv("QML_LINEAR_TABLE", str(table))
        linear._env_table.cache_clear()
        linear._tuned.cache_clear()
        assert preferred_impl(x, w) == "gemv"  # on any device, as the table says
        assert preferred_impl(x[:, :16], w[:, :16]) == "cublas"  # a shape it does not list
    finally:
        monkeypatch.delenv("QML_LINEAR_TABLE")
        linear._env_table.cache_clear()
        linear._tuned.cache_clear()
    assert preferred_impl(x, w) == "cublas"


# -- compilation for the H200 (sm_90a) -------------------------------------------------------

def _variant(T_pad: int, config: GemvConfig) -> dict:
    signature = {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "T": "i32", "N": "i32", "K": "i32",
                 "stride_x": "i32", "stride_w": "i32", "stride_y": "i32",
                 "T_PAD": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"}
    constexprs = {"T_PAD": T_pad, "BLOCK_N": config.block_n, "BLOCK_K": config.block_k}
    return {"kernel": _gemv_kernel, "signature": signature, "constexprs": constexprs,
            "num_warps": config.num_warps, "num_stages": 3, "divisible": ("N", "K", "stride_x", "stride_w")}


COMPILE_VARIANTS = {
    "one-token-default": _variant(1, GemvConfig()),
    "four-tokens-default": _variant(4, GemvConfig()),
    "one-token-wide": _variant(1, GemvConfig(block_n=8, block_k=1024, num_warps=8)),
}


@pytest.mark.parametrize("name", COMPILE_VARIANTS)
def test_compiles_for_hopper(compile_reports, name):
    assert_compiled_for_hopper(compile_reports[name], name)
