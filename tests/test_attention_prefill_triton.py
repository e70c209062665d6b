"""Paged prefill attention: the Triton kernel against paged_attention_ref (interpreter on CPU) on the
shape table of the op's spec, chunked prefill against one prefill, the dispatch, argument checks, the
byte/FLOP formulas, and the kernel's compilation for Hopper in bf16."""

from __future__ import annotations

import os
import re

import pytest
import torch

from qml_kernels import registry
from qml_kernels.attention import AttentionMetadata, paged_attention_ref
from qml_kernels.attention_prefill import (
    PAGED_PREFILL_ATTENTION_SPEC,
    PagedPrefillAttentionConfig,
    _keys_in_band,
    _visible_pairs,
    hopper_compile_request,
    paged_prefill_attention,
    paged_prefill_attention_triton,
)
from qml_kernels.workbench.check import check
from qml_kernels.workbench.compile import assert_compiled_for_hopper
from qml_kernels.workbench.spec import Case

SPEC = PAGED_PREFILL_ATTENTION_SPEC
# max |out - ref| / max |ref|, ref in fp32 on the same (rounded) inputs: fp16 rounds the
# probabilities once before P @ V (2^-11) and the output once
TOLERANCES = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# the interpreter computes bf16 wrongly without an error: bf16 is checked on the GPU only
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
CONFIGS = {
    "default": PagedPrefillAttentionConfig(),
    # 16-row tiles and 16-key blocks: many tiles per sequence (one token per tile at group 16),
    # the band split into several masked/unmasked blocks, key blocks smaller than a page
    "small-tiles": PagedPrefillAttentionConfig(block_m=16, block_n=16),
    # the page ids loaded in the iteration that gathers them (the form before prefetching) in the direct
    # launch, and loaded ahead in the split launch
    "ids-swapped": PagedPrefillAttentionConfig(prefetch_pages=False, split_prefetch_pages=True),
}


def _seeded() -> tuple[int, torch.Generator]:
    seed = int(os.environ.get("QML_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    return seed, torch.Generator(DEVICE).manual_seed(seed)


def _inputs(case: Case, dtype: torch.dtype) -> tuple[int, dict]:
    seed, gen = _seeded()
    return seed, SPEC.make_inputs(case, dtype, DEVICE, gen)


def _expected(inputs: dict) -> torch.Tensor:
    up = {k: v.float() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    return paged_attention_ref(**up)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite values in the output (an unwritten NaN-poisoned row?)"
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def _case(name: str) -> Case:
    return next(c for c in SPEC.cases if c.name == name)


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", SPEC.cases, ids=lambda c: c.name)
def test_kernel_matches_reference(case, dtype, config):
    seed, inputs = _inputs(case, dtype)
    q_before = inputs["q"].clone()
    out = torch.full_like(q_before, float("nan"))
    got = paged_prefill_attention_triton(**inputs, out=out, config=config)
    assert got is out
    err = _rel_err(got, _expected(inputs))
    assert err <= TOLERANCES[dtype], f"{case.name} {dtype}: error {err:.2e} > {TOLERANCES[dtype]:.0e} (seed {seed})"
    assert torch.equal(inputs["q"], q_before), "q was modified"


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_chunked_prefill_equals_one_prefill(config):
    """A sequence prefilled in three chunks (each attending to the earlier ones in the cache) gets
    the rows of one prefill over the whole sequence: what chunked prefill and prefix hits rely on."""
    seed, gen = _seeded()
    H, Hkv, Dh, S, L = 8, 2, 64, 16, 45
    whole = SPEC.make_inputs(Case("whole", {"seqs": ((L, L),), "H": H, "Hkv": Hkv, "Dh": Dh, "S": S,
                                            "window": 20, "sinks": True, "shuffle": True}),
                             torch.float32, DEVICE, gen)
    full = paged_prefill_attention_triton(**whole, config=config)  # [L, H, Dh]
    pages = whole["meta"].block_tables[0].tolist()
    for start, stop in ((0, 7), (7, 33), (33, L)):
        meta = AttentionMetadata.build(list(range(stop - start)), [pages], [0, stop - start], [stop], DEVICE)
        chunk = paged_prefill_attention_triton(**dict(whole, q=whole["q"][start:stop], meta=meta), config=config)
        err = _rel_err(chunk, full[start:stop])
        assert err <= 1e-5, f"chunk [{start}, {stop}): error {err:.2e} against one prefill (seed {seed})"


def test_writes_only_its_view_of_out():
    """out as a strided view (the heads of a wider buffer): every element of the view is written and
    nothing around it."""
    seed, inputs = _inputs(_case("group-3-fused-q"), torch.float16)
    T, H, Dh = inputs["q"].shape
    buffer = torch.full((T, H + 2, Dh), float("nan"), dtype=torch.float16, device=DEVICE)
    got = paged_prefill_attention_triton(**inputs, out=buffer[:, 1: H + 1])
    assert _rel_err(got, _expected(inputs)) <= TOLERANCES[torch.float16], f"seed {seed}"
    assert buffer[:, 0].isnan().all() and buffer[:, H + 1].isnan().all(), "wrote outside its view"


def test_allocates_out_by_default():
    seed, inputs = _inputs(_case("ragged-mixed"), torch.float32)
    got = paged_prefill_attention_triton(**inputs)
    assert got.shape == inputs["q"].shape and got.dtype == inputs["q"].dtype and got.is_contiguous()
    assert _rel_err(got, _expected(inputs)) <= TOLERANCES[torch.float32], f"seed {seed}"


def test_no_queries():
    k_cache = torch.zeros(2, 16, 1, 32, device=DEVICE)
    meta = AttentionMetadata.build([], [[0]], [0, 0], [5], DEVICE)
    out = paged_prefill_attention_triton(torch.zeros(0, 2, 32, device=DEVICE), k_cache, k_cache, meta, 0.1)
    assert out.shape == (0, 2, 32)


def test_public_op_runs_the_kernel_under_using_triton():
    seed, inputs = _inputs(_case("gpt-oss-sinks"), torch.float16)
    with registry.using("triton"):
        assert registry.select("paged_prefill_attention", **inputs).name == "triton"
        got = paged_prefill_attention(**inputs)
    assert _rel_err(got, _expected(inputs)) <= TOLERANCES[torch.float16], f"seed {seed}"


def test_workbench_check_passes():
    """The OpSpec as the workbench uses it: its inputs, reference call and NaN-poisoned out."""
    cases = [_case("prefix-hit-many-pages"), _case("softcap-dh256")]
    check("paged_prefill_attention", "triton", cases=cases, dtypes=DTYPES[:2]).raise_if_failed()


def _bad(what: str) -> dict:
    q, k_cache = torch.randn(3, 4, 32), torch.randn(2, 16, 2, 32)
    meta = AttentionMetadata.build([0, 1, 2], [[0]], [0, 3], [3], "cpu")
    args = {"q": q, "k_cache": k_cache, "v_cache": k_cache.clone(), "meta": meta, "scale": 0.1}
    changes = {
        "head_dim_mismatch": {"q": torch.randn(3, 4, 64)},
        "head_dim_not_pow2": {"q": torch.randn(3, 4, 48), "k_cache": torch.randn(2, 16, 2, 48),
                              "v_cache": torch.randn(2, 16, 2, 48)},
        "heads_not_multiple": {"q": torch.randn(3, 3, 32)},
        "cache_dtype": {"k_cache": k_cache.half(), "v_cache": k_cache.half()},
        "strided_head_dim": {"q": torch.randn(3, 32, 4).transpose(1, 2)},
        "rows_mismatch": {"q": torch.randn(4, 4, 32)},
        "more_queries_than_context": {"meta": AttentionMetadata.build([0, 1, 2], [[0]], [0, 3], [2], "cpu")},
        "sinks_shape": {"sinks": torch.zeros(2)},
        "zero_window": {"sliding_window": 0},
        "page_size_not_pow2": {"k_cache": torch.randn(2, 12, 2, 32), "v_cache": torch.randn(2, 12, 2, 32)},
    }[what]
    return dict(args, **changes)


@pytest.mark.parametrize("what", ["head_dim_mismatch", "head_dim_not_pow2", "heads_not_multiple", "cache_dtype",
                                  "strided_head_dim", "rows_mismatch", "more_queries_than_context", "sinks_shape",
                                  "zero_window", "page_size_not_pow2"])
def test_rejects_bad_arguments(what):
    with pytest.raises(AssertionError):
        paged_prefill_attention_triton(**_bad(what))


def test_config_rejects_tiles_too_small_for_tl_dot():
    with pytest.raises(ValueError):
        PagedPrefillAttentionConfig(block_m=8)
    with pytest.raises(ValueError):
        PagedPrefillAttentionConfig(block_n=48)


@pytest.mark.parametrize("window", [None, 1, 5, 40, 1000])
@pytest.mark.parametrize("n_q,L", [(1, 1), (1, 37), (37, 37), (12, 50), (50, 50)])
def test_work_formulas_count_the_visible_band(n_q, L, window):
    q_pos = torch.arange(L - n_q, L)[:, None]
    k_pos = torch.arange(L)[None, :]
    visible = k_pos <= q_pos
    if window is not None:
        visible &= k_pos > q_pos - window
    assert _visible_pairs(n_q, L, window) == int(visible.sum())
    assert _keys_in_band(n_q, L, window) == int(visible.any(0).sum())


# -- compilation for the H200 (sm_90a) -------------------------------------------------------

COMPILE_VARIANTS = {
    "llama3.1-8b-dh128-g4": hopper_compile_request(32, 8, 128),
    "qwen3-30b-dh128-g8": hopper_compile_request(32, 4, 128),
    "mha-dh128-g1-page64": hopper_compile_request(8, 8, 128, S=64),
    "gpt-oss-dh64-g8-window-sinks": hopper_compile_request(64, 8, 64, window=True, sinks=True),
    "gemma3-dh256-g4-window": hopper_compile_request(4, 1, 256, window=True),
    "dh256-g16-softcap": hopper_compile_request(16, 1, 256, softcap=True),
    # split-KV (short chunks over long contexts): the same loop, partial outputs to the workspace
    "split-llama3.1-8b-dh128-g4": hopper_compile_request(32, 8, 128, direct=False),
    "split-gpt-oss-dh64-g8-window-sinks": hopper_compile_request(64, 8, 64, window=True, sinks=True, direct=False),
    "split-dh256-g4-softcap": hopper_compile_request(4, 1, 256, softcap=True, direct=False),
}


@pytest.mark.parametrize("name", COMPILE_VARIANTS)
def test_compiles_for_hopper(compile_reports, name):
    report = assert_compiled_for_hopper(compile_reports[name], name)
    print(report.summary())
    # both products run on Hopper's warpgroup tensor cores, bf16 in, fp32 accumulate
    assert report.has_wgmma, f"{name}: tl.dot did not lower to wgmma ({report.summary()})"
    assert "wgmma.mma_async.sync.aligned" in report.ptx and ".f32.bf16.bf16" in report.ptx
    # K/V tiles are staged through shared memory by cp.async (the gather rules out TMA)
    assert "cp.async" in report.ptx, f"{name}: K/V loads are not pipelined through cp.async"
    assert report.shared_bytes <= 227 * 1024, f"{name}: {report.shared_bytes} B shared (> 227 KiB per block)"
    if name.startswith("split-"):
        # 4-warp split programs (up to Dh 128) hide each other's softmax two to an SM: two fit
        assert "dh256" in name or report.shared_bytes <= 112 * 1024, f"{name}: {report.shared_bytes} B shared"
    else:
        # the direct launch's visible blocks are gathered ahead: the loop's wait leaves later blocks'
        # copies in flight (with the page ids loaded beside their gathers every wait was "wait_group 0")
        assert re.search(r"cp\.async\.wait_group\s+[1-9]", report.ptx), f"{name}: no K/V copies stay in flight"
    # page * stride in 64 bits: caches past 2^31 elements
    assert "mul.wide.s32" in report.ptx or "mul.lo.s64" in report.ptx
