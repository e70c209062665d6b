"""The grouped expert GEMM (plain and with SwiGLU fused) and the whole MoE feed-forward against
their references (interpreter on CPU), torch._grouped_mm on CUDA, and compilation for Hopper."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F

from qml_kernels import registry
from qml_kernels.moe_gemm import (
    LARGE_DOWN_TILE_CONFIG,
    LARGE_TILE_CONFIG,
    MID_TILE_CONFIG,
    MOE_GEMM_SPEC,
    SMALL_DOWN_TILE_CONFIG,
    SMALL_TILE_CONFIG,
    MoEGemmConfig,
    _moe_gemm_kernel,
    moe_block_size,
    moe_forward,
    moe_forward_ref,
    moe_gemm,
    moe_gemm_config,
    moe_gemm_ref,
    moe_gemm_triton,
)
from qml_kernels.moe_routing import draw_expert_ids, moe_align_ref
from qml_kernels.workbench.compile import compile_checks
from qml_kernels.workbench.spec import Case

# max |out - ref| / max |ref|, ref computed in fp32; fp16/bf16 allow a few output roundings
# (and for the FFN, the rounding of the intermediate silu(gate)·up to the activation dtype)
TOLERANCES = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
FFN_TOLERANCES = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# the interpreter computes bf16 wrongly without an error: bf16 is checked on the GPU only
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
CONFIGS = {
    "default": MoEGemmConfig(),
    # 16x16x16 tiles: several tiles per expert segment, several column tiles and K steps
    "small-tiles": MoEGemmConfig(block_m=16, block_n=16, block_k=16, num_warps=1),
    # the other launch order (every row tile of a column tile first): same tiles, same results
    "small-tiles-rows-first": MoEGemmConfig(block_m=16, block_n=16, block_k=16, num_warps=1, columns_first=False),
    # what the launcher picks for 16-row segments: one tile for K <= 128 in the small cases
    "decode": SMALL_TILE_CONFIG,
    "decode-down": SMALL_DOWN_TILE_CONFIG,
    "mid": MID_TILE_CONFIG,
    "large": LARGE_TILE_CONFIG,
    "large-down": LARGE_DOWN_TILE_CONFIG,
    "mid-pointer-loads": dataclasses.replace(MID_TILE_CONFIG, tma_weights=False),
    # weight tiles through a TMA descriptor: edges past N and K zero-filled by the copy, not masked
    "tma": MoEGemmConfig(tma_weights=True),
    "tma-small-tiles": MoEGemmConfig(block_m=16, block_n=16, block_k=16, num_warps=1, tma_weights=True),
}

# exp(-g) overflows to inf for very negative gates on purpose (silu is then exactly 0)
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def _seeded() -> tuple[int, torch.Generator]:
    seed = int.from_bytes(os.urandom(4), "little")
    return seed, torch.Generator().manual_seed(seed)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite values in the output (an unwritten NaN-poisoned row?)"
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def _upcast(inputs: dict) -> dict:
    return {k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in inputs.items()}


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", MOE_GEMM_SPEC.cases, ids=lambda c: c.name)
def test_moe_gemm_matches_reference(case, dtype, config):
    seed, gen = _seeded()
    inputs = MOE_GEMM_SPEC.make_inputs(case, dtype, DEVICE, gen)
    ref = moe_gemm_ref(**_upcast(inputs))
    out = torch.full_like(ref, float("nan"), dtype=dtype)
    assert moe_gemm_triton(**inputs, out=out, config=config) is out
    err = _rel_err(out, ref)
    assert err <= TOLERANCES[dtype], f"{case.name} ({case.edge}) {dtype} seed={seed}: rel err {err:.2e}"


def test_config_follows_the_segment_height():
    """16-row segments (decode, short prefills) get the narrow deep tiles, 64-row ones 64x64 tiles,
    128-row ones (long prefills) 128x128 tiles; each tile height divides its segments."""
    assert moe_gemm_config(16) is SMALL_TILE_CONFIG and moe_gemm_config(32) is SMALL_TILE_CONFIG
    assert moe_gemm_config(16, swiglu=False) is SMALL_DOWN_TILE_CONFIG
    assert moe_gemm_config(64) is MID_TILE_CONFIG and moe_gemm_config(128) is LARGE_TILE_CONFIG
    assert moe_gemm_config(128, swiglu=False) is LARGE_DOWN_TILE_CONFIG  # the down projection: wider tiles
    assert all(moe_gemm_config(b, s).tma_weights for b in (64, 128) for s in (True, False))  # prefill: TMA
    for T, block, block_m in ((1, 16, 16), (256, 16, 16), (257, 64, 64), (2047, 64, 64), (2048, 128, 128)):
        assert moe_block_size(8 * T, 128) == block, T  # Qwen3-30B-A3B: 8 of 128 experts
        assert moe_gemm_config(block).block_m == block_m


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("swiglu", [True, False], ids=["gate-up", "down"])
def test_decode_tiles_over_several_k_steps(swiglu, dtype):
    """The launcher's own choice at one token (no config): 128-deep K steps, K = 320 is two and a
    tail; 8 of 40 experts used, each with one real row in its 16-row tile."""
    seed, gen = _seeded()
    case = Case("decode", {"T": 1, "E": 40, "k": 8, "K": 320, "N": 96, "block": moe_block_size(8, 40),
                           "swiglu": swiglu, "per_pair": not swiglu})
    inputs = MOE_GEMM_SPEC.make_inputs(case, dtype, DEVICE, gen)
    ref = moe_gemm_ref(**_upcast(inputs))
    out = torch.full_like(ref, float("nan"), dtype=dtype)
    moe_gemm_triton(**inputs, out=out)
    err = _rel_err(out, ref)
    assert err <= TOLERANCES[dtype], f"{dtype} seed={seed}: rel err {err:.2e}"


GROUPED_CONFIGS = {k: CONFIGS[k] for k in ("default", "small-tiles", "tma", "tma-small-tiles")}


@pytest.mark.parametrize("config", GROUPED_CONFIGS.values(), ids=GROUPED_CONFIGS.keys())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_grouped_rows_between_the_two_gemms(dtype, config):
    """``sorted_out``: gate-up writes each pair's row at its grouped row (``inverse``) and zeros in the padding
    rows; ``sorted_in``: the down GEMM reads those rows in order (through TMA with the TMA configs) and writes
    grouped rows too. Both against the pair-order reference moved to grouped rows."""
    seed, gen = _seeded()
    T, E, k, D, Ie, block = 37, 5, 2, 48, 40, 16
    ids = draw_expert_ids(T, E, k, gen, "sparse")  # empty experts: segments of zero rows
    sorted_pairs, offsets, inverse = (t.to(DEVICE) for t in moe_align_ref(ids, E, block))
    x = torch.randn(T, D, generator=gen).to(DEVICE, dtype)
    w_gate_up = (torch.randn(E, 2 * Ie, D, generator=gen) * D**-0.5).to(DEVICE, dtype)
    w_down = (torch.randn(E, D, Ie, generator=gen) * Ie**-0.5).to(DEVICE, dtype)
    R, used, rows = sorted_pairs.shape[0], int(offsets[-1]), inverse.long()
    padding = (sorted_pairs[:used] < 0).nonzero().flatten()
    assert padding.numel() > 0
    h = torch.full((R, Ie), float("nan"), dtype=dtype, device=DEVICE)
    moe_gemm_triton(x, w_gate_up, sorted_pairs, offsets, block, k, swiglu=True, sorted_out=True, out=h, config=config)
    h_ref = moe_gemm_ref(x.float(), w_gate_up.float(), sorted_pairs, offsets, block, k, swiglu=True)  # pair order
    assert _rel_err(h[rows], h_ref) <= TOLERANCES[dtype], f"gate-up {dtype} seed={seed}"
    assert (h[padding] == 0).all(), "padding rows must be written as zeros"
    torch.testing.assert_close(moe_gemm_ref(x.float(), w_gate_up.float(), sorted_pairs, offsets, block, k,
                                            swiglu=True, sorted_out=True)[rows], h_ref)
    y = torch.full((R, D), float("nan"), dtype=dtype, device=DEVICE)
    moe_gemm_triton(h, w_down, sorted_pairs, offsets, block, 1, sorted_in=True, sorted_out=True, out=y, config=config)
    y_ref = moe_gemm_ref(h[rows].float(), w_down.float(), sorted_pairs, offsets, block, 1)  # pair order
    assert _rel_err(y[rows], y_ref) <= TOLERANCES[dtype], f"down {dtype} seed={seed}"
    assert (y[padding] == 0).all()
    with pytest.raises(AssertionError, match="sorted_in"):
        moe_gemm_triton(h, w_down, sorted_pairs, offsets, block, 1, sorted_in=True)  # pair-order output


@pytest.mark.parametrize("down", ["triton", "grouped_mm"])
def test_moe_forward_with_grouped_rows(monkeypatch, down):
    """A long prefill (128-row segments) through ``moe_experts_grouped`` and the combine's inverse, all in
    Triton, against the loop over experts (``grouped_mm`` falls back to our GEMM where torch's cannot run)."""
    import qml_kernels.moe_gemm as moe_gemm_module

    monkeypatch.setattr(moe_gemm_module, "MOE_GROUPED_ROWS", True)
    monkeypatch.setattr(moe_gemm_module, "GROUPED_DOWN", down)
    seed, gen = _seeded()
    T, E, k, D, Ie = 400, 3, 1, 32, 24
    assert moe_block_size(T * k, E) == 128
    x = torch.randn(T, D, generator=gen)
    logits = torch.randn(T, E, generator=gen)
    w_gate_up = torch.randn(E, 2 * Ie, D, generator=gen) * D**-0.5
    w_down = torch.randn(E, D, Ie, generator=gen) * Ie**-0.5
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float16
    args = [t.to(DEVICE, dtype) for t in (x, logits, w_gate_up, w_down)]
    calls = []
    grouped = moe_gemm_module.moe_experts_grouped
    monkeypatch.setattr(moe_gemm_module, "moe_experts_grouped", lambda *a: calls.append(1) or grouped(*a))
    with registry.using("triton"):
        out = moe_forward(*args, k, True)
    ref = moe_forward_ref(*(a.float() for a in args), k, True)
    assert calls, "the grouped-row path did not run"
    err = _rel_err(out, ref)
    assert err <= FFN_TOLERANCES[dtype], f"{down} seed={seed}: rel err {err:.2e}"


def test_reference_is_one_matmul_per_pair():
    """The looped reference against the definition written per pair, so the kernel is not
    checked against a wrong reference."""
    gen = torch.Generator().manual_seed(0)
    T, E, k, K, N = 9, 5, 2, 12, 10
    ids = draw_expert_ids(T, E, k, gen)
    x, w = torch.randn(T, K, generator=gen), torch.randn(E, N, K, generator=gen)
    sorted_pairs, offsets, _ = moe_align_ref(ids, E, 16)
    expert = ids.flatten().long()  # [T·k]
    per_pair = torch.einsum("pk,pnk->pn", x.repeat_interleave(k, dim=0), w[expert])  # [T·k, N]
    torch.testing.assert_close(moe_gemm_ref(x, w, sorted_pairs, offsets, 16, k), per_pair)
    gate, up = per_pair.chunk(2, dim=-1)
    torch.testing.assert_close(moe_gemm_ref(x, w, sorted_pairs, offsets, 16, k, swiglu=True), F.silu(gate) * up)


def test_unchosen_experts_are_never_read():
    """Decode: the weights of experts no token chose are NaN, and the result is still exact.
    Programs past the last used segment return before loading anything."""
    seed, gen = _seeded()
    E, k, K, N = 32, 4, 64, 48
    ids = draw_expert_ids(1, E, k, gen)  # one token: 4 experts used, 28 not
    x = torch.randn(1, K, generator=gen).to(DEVICE)
    w = torch.full((E, N, K), float("nan"), device=DEVICE)
    chosen = ids.flatten().long()
    w[chosen] = torch.randn(k, N, K, generator=gen).to(DEVICE) * K**-0.5
    sorted_pairs, offsets, _ = (t.to(DEVICE) for t in moe_align_ref(ids, E, 16))
    out = moe_gemm_triton(x, w, sorted_pairs, offsets, 16, k, swiglu=True)
    ref = moe_gemm_ref(x, w, sorted_pairs, offsets, 16, k, swiglu=True)
    assert _rel_err(out, ref) <= 1e-5, f"seed={seed}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T, E, k, spread", [
    (1, 16, 4, "uniform"),  # decode: 16-row tiles, 12 experts empty
    (24, 7, 1, "hot"),  # top-1, every token to expert 0
    (40, 11, 3, "sparse"),  # prime E, odd experts empty
    (70, 8, 8, "uniform"),  # k = E: every expert gets every token; 560 pairs, 64-row tiles
    (20, 128, 8, "uniform"),  # Qwen3's 128 experts: 160 pairs, 3 chunks of 64, the multi-program alignment
])
def test_moe_forward_matches_reference(T, E, k, spread, dtype):
    """The dispatched pipeline (router, alignment, two grouped GEMMs, combine) all in Triton,
    against the loop over experts. The logits make the routing ``spread`` wants."""
    seed, gen = _seeded()
    D, Ie = 48, 40
    chosen = draw_expert_ids(T, E, k, gen, spread).long()
    # the chosen experts get logits 4 + noise ahead of the others: a clear, known routing
    logits = torch.randn(T, E, generator=gen)
    logits.scatter_(1, chosen, 4.0 + torch.rand(T, k, generator=gen))
    x = torch.randn(T, D, generator=gen)
    w_gate_up = torch.randn(E, 2 * Ie, D, generator=gen) * D**-0.5
    w_down = torch.randn(E, D, Ie, generator=gen) * Ie**-0.5
    args = [t.to(DEVICE, dtype) for t in (x, logits, w_gate_up, w_down)]
    with registry.using("triton"):
        out = moe_forward(*args, k, True)
    ref = moe_forward_ref(*(a.float() for a in args), k, True)
    err = _rel_err(out, ref)
    assert err <= FFN_TOLERANCES[dtype], f"T={T} E={E} k={k} {spread} {dtype} seed={seed}: rel err {err:.2e}"
    assert moe_block_size(T * k, E) == (16 if T * k <= 16 * E else 64 if T * k < 128 * E else 128)


def test_moe_forward_on_cpu_runs_the_references():
    """Without a forced implementation the CPU pipeline is made of the references, and it equals
    the expert loop (the model's CPU path)."""
    gen = torch.Generator().manual_seed(5)
    T, E, k, D, Ie = 6, 5, 2, 16, 12
    x, logits = torch.randn(T, D, generator=gen), torch.randn(T, E, generator=gen)
    w_gate_up, w_down = torch.randn(E, 2 * Ie, D, generator=gen), torch.randn(E, D, Ie, generator=gen)
    assert registry.select("moe_gemm", x, w_gate_up, torch.zeros(1, dtype=torch.int32),
                           torch.zeros(E + 1, dtype=torch.int32), 16, k).name == "reference"
    torch.testing.assert_close(moe_forward(x, logits, w_gate_up, w_down, k, False),
                               moe_forward_ref(x, logits, w_gate_up, w_down, k, False))


def test_launcher_rejects_bad_arguments():
    gen = torch.Generator().manual_seed(2)
    ids = draw_expert_ids(4, 6, 2, gen)
    sorted_pairs, offsets, _ = (t.to(DEVICE) for t in moe_align_ref(ids, 6, 16))
    x, w = torch.randn(4, 32, device=DEVICE), torch.randn(6, 24, 32, device=DEVICE)
    with pytest.raises(AssertionError, match="w must be"):
        moe_gemm_triton(x, torch.randn(6, 24, 31, device=DEVICE), sorted_pairs, offsets, 16, 2)
    with pytest.raises(AssertionError, match="expert_offsets must be"):
        moe_gemm_triton(x, w, sorted_pairs, offsets[:-1], 16, 2)
    with pytest.raises(AssertionError, match="block_size"):
        moe_gemm_triton(x, w, sorted_pairs, offsets, 8, 2)
    with pytest.raises(AssertionError, match="swiglu needs"):
        moe_gemm_triton(x, torch.randn(6, 25, 32, device=DEVICE), sorted_pairs, offsets, 16, 2, swiglu=True)
    with pytest.raises(AssertionError, match="out: shape"):
        moe_gemm_triton(x, w, sorted_pairs, offsets, 16, 2, out=torch.empty(8, 12, device=DEVICE))
    with pytest.raises(AssertionError, match="w: "):
        moe_gemm_triton(x, w.half(), sorted_pairs, offsets, 16, 2)


def test_public_function_dispatches_to_triton():
    seed, gen = _seeded()
    inputs = MOE_GEMM_SPEC.make_inputs(MOE_GEMM_SPEC.cases[0], torch.float16, DEVICE, gen)
    with registry.using("triton"):
        assert registry.select("moe_gemm", *inputs.values()).name == "triton"
        out = moe_gemm(*inputs.values())
    assert _rel_err(out, moe_gemm_ref(**_upcast(inputs))) <= TOLERANCES[torch.float16], f"seed={seed}"


@pytest.mark.skipif(not (torch.cuda.is_available() and hasattr(torch, "_grouped_mm")),
                    reason="torch._grouped_mm runs on CUDA only")
def test_matches_torch_grouped_mm():
    """The same grouped product through torch's grouped GEMM (bf16, CUTLASS on Hopper): rows in
    expert order, padded segments ending at expert_offsets[1:]."""
    gen = torch.Generator(DEVICE).manual_seed(7)
    T, E, k, K, N = 300, 16, 4, 256, 384
    ids = draw_expert_ids(T, E, k, gen)
    sorted_pairs, offsets, _ = (t.to(DEVICE) for t in moe_align_ref(ids, E, 64))
    x = torch.randn(T, K, device=DEVICE, generator=gen, dtype=torch.bfloat16)
    w = (torch.randn(E, N, K, device=DEVICE, generator=gen) * K**-0.5).to(torch.bfloat16)
    used = int(offsets[-1])
    rows = sorted_pairs[:used].long()
    a = torch.where((rows >= 0)[:, None], x[rows.clamp(min=0) // k], 0)  # [used, K], padding rows zero
    grouped = torch._grouped_mm(a, w.transpose(1, 2), offs=offsets[1:].contiguous())  # [used, N]
    ours = moe_gemm_triton(x, w, sorted_pairs, offsets, 64, k)
    real = rows >= 0
    torch.testing.assert_close(ours[rows[real]].float(), grouped[real].float(), rtol=2e-2, atol=2e-2)


# -- compilation for the H200 (sm_90a) -------------------------------------------------------

def _signature(config: MoEGemmConfig, tma_a: bool = False) -> dict:
    # without TMA the descriptor arguments are a and w themselves, never read
    w_desc = f"tensordesc<bf16[{config.block_n}, {config.block_k}]>" if config.tma_weights else "*bf16"
    a_desc = f"tensordesc<bf16[{config.block_m}, {config.block_k}]>" if tma_a else "*bf16"
    return {
        "a_ptr": "*bf16", "a_desc": a_desc, "w_ptr": "*bf16", "w_desc": w_desc, "out_ptr": "*bf16",
        "sorted_pairs_ptr": "*i32",
        "offsets_ptr": "*i32", "N_OUT": "i32", "K": "i32", "E": "i32", "stride_a": "i32", "stride_we": "i32",
        "stride_wn": "i32", "stride_out": "i32", "NUM_M": "i32", "NUM_N": "i32",
        "PAIRS_PER_ROW": "constexpr", "SWIGLU": "constexpr",
        "PRECISION": "constexpr", "TMA_W": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
        "BLOCK_K": "constexpr", "BLOCK_E": "constexpr", "COLUMNS_FIRST": "constexpr", "SORTED_IN": "constexpr",
        "SORTED_OUT": "constexpr", "TMA_A": "constexpr",
    }


def _variant(block_size: int, swiglu: bool, pairs_per_row: int, config: MoEGemmConfig | None = None,
             sorted_in: bool = False, sorted_out: bool = False) -> dict:
    """The bf16 kernel as the launcher specialises it for Qwen3-30B-A3B (128 experts; K = 2048 for
    gate-up, 768 for down), with the config it picks for ``block_size`` unless one is given."""
    config = config or moe_gemm_config(block_size, swiglu)
    tma_a = sorted_in and config.tma_weights
    constexprs = {"PAIRS_PER_ROW": pairs_per_row, "SWIGLU": swiglu, "PRECISION": "tf32",
                  "TMA_W": config.tma_weights, "BLOCK_M": min(config.block_m, block_size),
                  "BLOCK_N": config.block_n, "BLOCK_K": config.block_k, "BLOCK_E": 128,
                  "COLUMNS_FIRST": config.columns_first, "SORTED_IN": sorted_in, "SORTED_OUT": sorted_out,
                  "TMA_A": tma_a}
    divisible = ("N_OUT", "K", "stride_a", "stride_we", "stride_wn", "stride_out")
    return {"signature": _signature(config, tma_a), "constexprs": constexprs, "num_warps": config.num_warps,
            "num_stages": config.num_stages, "divisible": divisible}


COMPILE_VARIANTS = {
    "gate-up-swiglu-prefill": _variant(64, True, 8),
    "down-prefill": _variant(64, False, 1),
    "gate-up-swiglu-long-prefill": _variant(128, True, 8),
    "down-long-prefill": _variant(128, False, 1),
    "gate-up-swiglu-decode": _variant(16, True, 8),
    "down-decode": _variant(16, False, 1),
    "gate-up-swiglu-16-rows-default-tiles": _variant(16, True, 8, MoEGemmConfig()),
    "gate-up-swiglu-long-prefill-pointer-loads": _variant(128, True, 8,
                                                          dataclasses.replace(LARGE_TILE_CONFIG, tma_weights=False)),
    "gate-up-swiglu-long-prefill-rows-first": _variant(128, True, 8,
                                                       dataclasses.replace(LARGE_TILE_CONFIG, columns_first=False)),
    # grouped-row order (moe_experts' sorted path): gate-up writes grouped rows, down reads them through TMA
    "gate-up-swiglu-long-prefill-sorted-out": _variant(128, True, 8, sorted_out=True),
    "down-long-prefill-sorted-in-out": _variant(128, False, 1, sorted_in=True, sorted_out=True),
}
# programs of the decode tiles that must fit on one SM together (228 KB of shared memory on Hopper),
# so that the weight bytes in flight per SM are what SMALL_TILE_CONFIG's comment counts
PROGRAMS_PER_SM = {"gate-up-swiglu-decode": 1, "down-decode": 5}


@pytest.fixture(scope="module")
def compile_reports() -> dict:
    requests = [dict(kernel=_moe_gemm_kernel, **variant) for variant in COMPILE_VARIANTS.values()]
    return dict(zip(COMPILE_VARIANTS, (dataclasses.asdict(r) for r in compile_checks(requests))))


@pytest.mark.parametrize("name", COMPILE_VARIANTS)
def test_compiles_for_hopper(compile_reports, name):
    report = compile_reports[name]
    assert report["ok"], report["error"]
    assert ".target sm_90a" in report["ptx"]
    assert report["spills"] in (0, None), f"{name}: {report['spills']} spill bytes"
    # 64-row tiles are one warpgroup MMA high: the tensor cores' Hopper instruction must be used
    if COMPILE_VARIANTS[name]["constexprs"]["BLOCK_M"] >= 64:
        assert report["has_wgmma"], f"{name}: no wgmma in the PTX"
    if COMPILE_VARIANTS[name]["constexprs"]["TMA_W"]:
        assert report["has_tma"], f"{name}: no TMA copy in the PTX"
    if name in PROGRAMS_PER_SM:
        assert PROGRAMS_PER_SM[name] * report["shared_bytes"] <= 228 * 1024, f"{name}: {report['shared_bytes']} B"
        assert "cp.async" in report["ptx"], f"{name}: the weight loads are not asynchronous copies (no pipeline)"
