"""The token-narrow GEMM (``y^T = w @ x^T``, features as the MMA's rows) against its reference (interpreter on
CPU, bf16 on a GPU), its token tiles and configs, its place in ``linear``'s tuning table, and its compilation
for Hopper."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from qml_kernels import registry
from qml_kernels.linear import linear, linear_ref, load_linear_table, preferred_impl, use_tuning_table
from qml_kernels.linear_narrow import (
    MAX_TOKENS,
    NarrowConfig,
    _narrow_kernel,
    _narrow_sum_kernel,
    default_narrow_config,
    linear_narrow,
    narrow_capable,
    token_tiles,
)
from qml_kernels.workbench.compile import assert_compiled_for_hopper, compile_checks_by_name

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# the interpreter computes bf16 wrongly without an error: bf16 is checked on the GPU only
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
TOLERANCES = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _inputs(T: int, N: int, K: int, dtype: torch.dtype) -> tuple[int, torch.Tensor, torch.Tensor]:
    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(N, K, generator=gen) * K ** -0.5).to(DEVICE, dtype)
    return seed, x, w


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite values in the output (an unwritten NaN-poisoned element?)"
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


# (T, N, K, config): small shapes whose tiles, tails and splits are the ones the H200 shapes take
CASES = {
    "turn-two-token-tiles": (150, 192, 200, NarrowConfig(64, 64, 1, 4, 2)),  # 128 + 32 tokens, K tail of 8
    "one-token": (1, 64, 40, NarrowConfig(64, 16, 1, 4, 2)),  # 16-column tile, 15 of it padding
    "one-tile-exact": (128, 64, 96, NarrowConfig(64, 32, 1, 4, 2)),
    "feature-tail": (33, 72, 48, NarrowConfig(64, 16, 1, 4, 2)),  # N = 72: a second tile of 8 features
    "split-k-uneven": (150, 128, 256, NarrowConfig(64, 32, 3, 4, 2)),  # 8 K steps in 3 ranges (3 + 3 + 2)
    "split-k-more-than-steps": (20, 64, 64, NarrowConfig(64, 32, 4, 4, 2)),  # 2 steps: 2 splits, not 4
    "wide-features": (200, 256, 64, NarrowConfig(256, 32, 1, 8, 2)),  # one 256-token tile
    "full-width": (256, 128, 64, NarrowConfig(128, 32, 2, 8, 2)),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=CASES)
def test_matches_reference(case, dtype):
    T, N, K, config = CASES[case]
    seed, x, w = _inputs(T, N, K, dtype)
    out = torch.full((T, N), float("nan"), dtype=dtype, device=DEVICE)
    assert linear_narrow(x, w, out=out, config=config) is out
    err = _rel_err(out, linear_ref(x.float(), w.float()))
    assert err <= TOLERANCES[dtype], f"{case} {dtype}: rel. error {err:.3g} (seed={seed})"


def test_default_config_matches_reference():
    seed, x, w = _inputs(150, 136, 120, torch.float16)
    err = _rel_err(linear_narrow(x, w), linear_ref(x.float(), w.float()))
    assert err <= TOLERANCES[torch.float16], f"seed={seed}"


def test_split_partials_are_added_in_a_fixed_order():
    # the same call twice gives the same bits: the partials are summed in split order, not as they land
    _, x, w = _inputs(150, 64, 256, torch.float32)
    config = NarrowConfig(64, 32, 4, 4, 2)
    assert torch.equal(linear_narrow(x, w, config=config), linear_narrow(x, w, config=config))


@pytest.mark.parametrize("T, tiles", [
    (1, (16, 0)), (16, (16, 0)), (17, (32, 0)), (80, (64, 16)), (100, (128, 0)), (128, (128, 0)),
    (129, (128, 16)), (133, (128, 16)), (150, (128, 32)), (160, (128, 32)), (192, (128, 64)), (193, (256, 0)),
    (219, (256, 0)), (256, (256, 0)),
])
def test_token_tiles_cover_t_with_the_fewest_columns(T, tiles):
    a, b = token_tiles(T)
    assert (a, b) == tiles
    assert a + b >= T and a & (a - 1) == 0 and b & (b - 1) == 0 and a >= 16 and b in (0,) + (16, 32, 64, 128)
    assert a + b <= max(16, 1 << (T - 1).bit_length())  # never more than one power-of-two tile would take


@pytest.mark.parametrize("T", [0, MAX_TOKENS + 1])
def test_token_counts_outside_the_kernel_are_refused(T):
    with pytest.raises(ValueError, match="1 to 256 tokens"):
        token_tiles(T)
    x, w = torch.zeros(T, 32), torch.zeros(64, 32)
    assert not narrow_capable(x, w)


@pytest.mark.parametrize("bad", [dict(block_f=32), dict(block_k=48), dict(split_k=0), dict(split_k=17),
                                 dict(num_warps=2), dict(num_stages=0)])
def test_bad_configs_are_refused(bad):
    with pytest.raises(ValueError, match="NarrowConfig"):
        NarrowConfig(**bad)


def test_narrow_capable_needs_tma_ready_operands():
    x, w = torch.zeros(150, 64, dtype=torch.float16), torch.zeros(128, 64, dtype=torch.float16)
    assert narrow_capable(x, w)
    assert not narrow_capable(x, w.float())  # dtypes differ
    assert not narrow_capable(x[:, 1:], w[:, 1:])  # rows not 16-byte aligned
    assert not narrow_capable(x, torch.zeros(100, 64, dtype=torch.float16)[:3])  # N = 3: output rows of 6 bytes
    assert not narrow_capable(x, w, out=torch.zeros(128, 150, dtype=torch.float16).T)  # a transposed out


@pytest.mark.parametrize("N, K, block_f, split", [
    (6144, 4096, 64, 1),  # Llama-3.1-8B qkv: 96 feature tiles
    (4096, 4096, 64, 2),  # o: 64 tiles, two K ranges -> 128 programs
    (28672, 4096, 128, 1),  # gate_up: 224 tiles
    (4096, 14336, 64, 2),  # down
    (2048, 4096, 64, 4),  # Qwen3-30B-A3B o: 32 tiles, four K ranges -> 128 programs
])
def test_default_config_keeps_the_sms_busy(N, K, block_f, split):
    c = default_narrow_config(150, N, K, torch.bfloat16, num_sms=132)
    assert c.block_f == block_f
    programs = -(-N // c.block_f) * c.split_k
    assert programs * 2 >= 132 or c.split_k == 8
    assert c.split_k >= split
    a, b = token_tiles(150)
    assert (c.block_f + a + b) * c.block_k * 2 * c.num_stages <= 220 * 1024


def test_the_tuning_table_routes_a_bucket_to_narrow(tmp_path):
    w = torch.zeros(256, 128, dtype=torch.float16, device=DEVICE)
    config = NarrowConfig(64, 32, 2, 4, 3)
    table = {"op": "linear", "device": "", "version": 1, "entries": [
        {"dtype": "float16", "N": 256, "K": 128, "T": 160, "impl": "narrow", "config": dataclasses.asdict(config)}]}
    path = tmp_path / "linear_test.json"
    path.write_text(json.dumps(table))
    assert load_linear_table(path).lookup("float16", 256, 128, 160).config == config
    with use_tuning_table(path):
        # bucket 160 holds 129 to 160 tokens (a 150-token turn, eager or in the 160-token prefill graph)
        for T, expected in ((129, "narrow"), (150, "narrow"), (160, "narrow"), (128, "cublas"), (161, "cublas"),
                            (256, "cublas")):
            x = torch.zeros(T, 128, dtype=torch.float16, device=DEVICE)
            assert preferred_impl(x, w) == expected, f"T={T}"


def test_linear_forced_to_narrow_matches_the_reference():
    seed, x, w = _inputs(150, 128, 64, torch.float16)
    if DEVICE.type == "cpu":
        pytest.skip("the registry runs narrow on CUDA only (the interpreter path is tested above)")
    with registry.using("narrow"):
        out = linear(x, w)
    assert _rel_err(out, linear_ref(x.float(), w.float())) <= TOLERANCES[torch.float16], f"seed={seed}"


# -- compilation for the H200 (sm_90a) -------------------------------------------------------

def _variant(T: int, N: int, K: int, config: NarrowConfig | None = None) -> dict:
    c = config or default_narrow_config(T, N, K, torch.bfloat16)
    a, b = token_tiles(T)
    bf, bk = c.block_f, c.block_k
    signature = {
        "w_desc": f"tensordesc<bf16[{bf}, {bk}]>", "xa_desc": f"tensordesc<bf16[{a}, {bk}]>",
        "xb_desc": f"tensordesc<bf16[{b or a}, {bk}]>", "ya_desc": f"tensordesc<bf16[{a}, {bf}]>",
        "yb_desc": f"tensordesc<bf16[{b or a}, {bf}]>", "part_ptr": "*fp32",
        "T": "i32", "N": "i32", "K": "i32", "k_per_split": "i32",
        "BLOCK_F": "constexpr", "BLOCK_K": "constexpr", "TOK_A": "constexpr", "TOK_B": "constexpr",
        "SPLIT": "constexpr", "PRECISION": "constexpr",
    }
    constexprs = {"BLOCK_F": bf, "BLOCK_K": bk, "TOK_A": a, "TOK_B": b, "SPLIT": c.split_k, "PRECISION": "tf32"}
    return {"kernel": _narrow_kernel, "signature": signature, "constexprs": constexprs,
            "num_warps": c.num_warps, "num_stages": c.num_stages, "divisible": ("N", "K", "k_per_split")}


COMPILE_VARIANTS = {
    "llama-qkv-T150": _variant(150, 6144, 4096),
    "llama-o-T150-split": _variant(150, 4096, 4096),
    "llama-gate-up-T150": _variant(150, 28672, 4096),
    "llama-gate-up-T150-256-features": _variant(150, 28672, 4096, NarrowConfig(256, 64, 1, 8, 3)),
    "llama-qkv-T256": _variant(256, 6144, 4096),
    "llama-qkv-T64": _variant(64, 6144, 4096),
    "sum": {"kernel": _narrow_sum_kernel, "constexprs": {"SPLIT": 2, "BLOCK": 1024}, "num_warps": 4,
            "num_stages": 1, "signature": {"part_ptr": "*fp32", "y_ptr": "*bf16", "TN": "i32",
                                           "SPLIT": "constexpr", "BLOCK": "constexpr"}},
}


@pytest.fixture(scope="module")
def compiled() -> dict:
    return compile_checks_by_name(COMPILE_VARIANTS)


@pytest.mark.parametrize("name", COMPILE_VARIANTS)
def test_compiles_for_hopper(compiled, name):
    report = assert_compiled_for_hopper(compiled[name], name)
    assert report.shared_bytes <= 227 * 1024, f"{name}: {report.shared_bytes} B shared"
    if name != "sum":  # the point of the kernel: TMA feeds shared memory, wgmma reads it with features as rows
        assert report.has_tma and report.has_wgmma, f"{name}: tma={report.has_tma} wgmma={report.has_wgmma}"
