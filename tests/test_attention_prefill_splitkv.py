"""Paged prefill attention in split-KV mode: each tile's keys shared by several programs, partial
outputs merged by their log-sum-exps. The kernel against paged_attention_ref (interpreter on CPU)
with the split count forced to 1, 2, 3, 7 and chosen automatically, on the edges a split can cut
(window and diagonal inside one run, runs left empty, sinks added once); the host's split choice;
the launch shape fixed by host values while the device holds other lengths (CUDA graphs); and the
split kernel's and the merge's compilation for Hopper."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

import qml_kernels.attention_prefill as attention_prefill
from qml_kernels.attention import AttentionMetadata, paged_attention_ref
from qml_kernels.attention_decode import _paged_decode_attention_merge_kernel
from qml_kernels.attention_prefill import (
    PAGED_PREFILL_ATTENTION_SPEC,
    PagedPrefillAttentionConfig,
    paged_prefill_attention_triton,
    prefill_num_splits,
)
from qml_kernels.workbench.compile import compile_checks
from qml_kernels.workbench.spec import Case

SPEC = PAGED_PREFILL_ATTENTION_SPEC
# max |out - ref| / max |ref|, ref in fp32 on the same (rounded) inputs; the fp32 workspace and the
# merge add reordered sums only
TOLERANCES = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# 16-key blocks so that the short contexts here hold many blocks to share out
SPLITS = {n: PagedPrefillAttentionConfig(block_n=16, num_splits=n) for n in (1, 2, 3, 7)}
# automatic, with the per-split floor and the merge's fixed cost lowered to fit these contexts (the
# defaults, sized for the GPU, keep contexts of a few hundred keys at one split)
AUTO = PagedPrefillAttentionConfig(block_n=16, min_keys_per_split=32, merge_overhead_keys=0)
CONFIGS = {**{f"split{n}": c for n, c in SPLITS.items()}, "auto": AUTO}

CASES = (
    Case("few-queries-long-context", {"seqs": ((5, 300),), "H": 8, "Hkv": 2, "Dh": 64, "shuffle": True},
         edge="n_q << L, GQA group 4: most of the band wholly visible, the diagonal in the last run"),
    Case("ragged-mixed", {"seqs": ((1, 150), (24, 24), (6, 190), (1, 1), (9, 97), (0, 9)),
                          "H": 8, "Hkv": 1, "Dh": 64, "shuffle": True},
         edge="group 8; decode rows, a fresh prompt (n_q == L), chunks, a 1-key context whose band is "
              "one block (every other run empty), a sequence with no queries"),
    Case("page-boundaries-mha", {"seqs": ((16, 128), (17, 161)), "H": 2, "Hkv": 2, "Dh": 128},
         edge="group 1, head dim 128; chunks starting on a page boundary and ending one past one"),
    Case("window-mid-page", {"seqs": ((6, 230), (20, 60)), "H": 4, "Hkv": 1, "Dh": 64, "window": 37,
                             "shuffle": True},
         edge="window 37 < context: the band starts mid-page and mid-block; runs outside a row's window"),
    Case("window-sinks", {"seqs": ((9, 200), (1, 77)), "H": 8, "Hkv": 1, "Dh": 64, "window": 50, "sinks": True,
                          "shuffle": True},
         edge="gpt-oss layer: sinks + window, group 8, a decode row; the sink joins the merge once"),
    Case("sinks-full", {"seqs": ((3, 180),), "H": 4, "Hkv": 4, "Dh": 64, "sinks": True, "S": 32},
         edge="sinks without a window, group 1, pages of 32"),
    Case("softcap-dh256", {"seqs": ((4, 140), (12, 12)), "H": 4, "Hkv": 1, "Dh": 256, "softcap": 5.0},
         edge="tanh soft-cap, head dim 256, group 4; a fresh 12-token prompt beside a long context"),
)
# half types on a subset of split counts: the merge math is dtype-blind, they check the rounding
# path; the interpreter computes bf16 wrongly without an error: bf16 is checked on the GPU only
HALF_DTYPES = [torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
HALF_CONFIGS = ("split3", "auto")


def _seeded() -> tuple[int, torch.Generator]:
    seed = int(os.environ.get("QML_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    return seed, torch.Generator(DEVICE).manual_seed(seed)


def _expected(inputs: dict) -> torch.Tensor:
    return paged_attention_ref(**{k: v.float() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()})


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite values in the output (an unwritten row, or 0/0 in a merge?)"
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def _splits_used(inputs: dict, config: PagedPrefillAttentionConfig) -> int:
    """The split count the launcher picks for these inputs (what the automatic cases exercise)."""
    q, meta = inputs["q"], inputs["meta"]
    H, Dh, Hkv = q.shape[1], q.shape[2], inputs["k_cache"].shape[2]
    tile_tokens = config.tiles(Dh, H // Hkv)[0] // (H // Hkv)
    cu = meta.cu_seqlens_q_host
    tiles = sum(-(-(b - a) // tile_tokens) for a, b in zip(cu, cu[1:]))
    band = max(meta.context_lens_host)
    if inputs["sliding_window"] is not None:
        band = min(band, inputs["sliding_window"] + tile_tokens - 1)
    return prefill_num_splits(tiles * Hkv, band, config)


def _check(case: Case, dtype: torch.dtype, config: PagedPrefillAttentionConfig) -> None:
    seed, gen = _seeded()
    inputs = SPEC.make_inputs(case, dtype, DEVICE, gen)
    out = torch.full(inputs["q"].shape, float("nan"), dtype=dtype, device=DEVICE)
    got = paged_prefill_attention_triton(**inputs, out=out, config=config)
    assert got is out
    err, tol = _rel_err(got, _expected(inputs)), TOLERANCES[dtype]
    splits = _splits_used(inputs, config)
    assert err <= tol, f"{case.name} {dtype} {splits} splits: error {err:.2e} > {tol:.0e} (seed {seed})"


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_split_kernel_matches_reference_fp32(case, config):
    _check(case, torch.float32, config)


@pytest.mark.parametrize("config", HALF_CONFIGS)
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_split_kernel_matches_reference_half(case, dtype, config):
    _check(case, dtype, CONFIGS[config])


def test_automatic_choice_splits_these_cases():
    """The automatic configs above do exercise the merge (else they would test one split twice)."""
    gen = torch.Generator(DEVICE).manual_seed(0)
    for case in CASES:
        inputs = SPEC.make_inputs(case, torch.float32, DEVICE, gen)
        assert _splits_used(inputs, AUTO) > 1, case.name


@pytest.mark.parametrize("splits", [1, 4])
def test_default_tiles_split_equals_reference(splits):
    """The default 64-key blocks: runs of several blocks, the last one cut by the diagonal."""
    case = Case("default-tiles", {"seqs": ((7, 520), (1, 300)), "H": 8, "Hkv": 2, "Dh": 64, "window": 400,
                                  "sinks": True, "shuffle": True})
    _check(case, torch.float32, PagedPrefillAttentionConfig(num_splits=splits))


def test_more_splits_than_blocks_weigh_nothing():
    """9 splits over bands of one 64-key block: all runs but one are empty for every row of their
    tile and store lse = -inf only; the merge must give them weight 0, with and without a sink."""
    for sinks in (False, True):
        case = Case("tiny", {"seqs": ((1, 1), (3, 40), (2, 2)), "H": 4, "Hkv": 2, "Dh": 32, "sinks": sinks})
        _check(case, torch.float32, PagedPrefillAttentionConfig(num_splits=9))


def test_one_split_writes_out_directly(monkeypatch):
    """One split: no workspace and no merge launch; more than one: the merge runs (the probe can fail)."""

    class MergeProbe:
        launches = 0

        def __getitem__(self, grid):
            MergeProbe.launches += 1
            return _paged_decode_attention_merge_kernel[grid]

    seed, gen = _seeded()
    inputs = SPEC.make_inputs(CASES[0], torch.float16, DEVICE, gen)
    ref = _expected(inputs)
    empty = torch.empty
    workspaces = []

    def tracking_empty(*args, **kwargs):
        if kwargs.get("dtype") == torch.float32:
            workspaces.append(args)
        return empty(*args, **kwargs)

    monkeypatch.setattr(attention_prefill, "_paged_decode_attention_merge_kernel", MergeProbe())
    monkeypatch.setattr(attention_prefill.torch, "empty", tracking_empty)
    out = paged_prefill_attention_triton(**inputs, config=SPLITS[1])
    assert MergeProbe.launches == 0 and not workspaces, "one split launched the merge or allocated a workspace"
    assert _rel_err(out, ref) <= TOLERANCES[torch.float16], f"seed {seed}"
    out = paged_prefill_attention_triton(**inputs, config=SPLITS[3])
    assert MergeProbe.launches == 1 and len(workspaces) == 2
    assert _rel_err(out, ref) <= TOLERANCES[torch.float16], f"seed {seed}"


def test_launch_from_host_values_device_lengths_differ():
    """What a CUDA graph replays: the split count (and workspace) come from host lists claiming the
    longest context, while the device holds the real, shorter lengths; the result follows the device."""
    seed, gen = _seeded()
    case = Case("graph", {"seqs": ((20, 90), (5, 5)), "H": 4, "Hkv": 1, "Dh": 64, "sinks": True, "shuffle": True})
    inputs = SPEC.make_inputs(case, torch.float32, DEVICE, gen)
    meta = inputs["meta"]
    claimed = dataclasses.replace(meta, context_lens_host=[4096, 4096])
    config = PagedPrefillAttentionConfig(block_n=16)
    assert _splits_used(inputs, config) == 1
    assert _splits_used(dict(inputs, meta=claimed), config) > 1
    got = paged_prefill_attention_triton(**dict(inputs, meta=claimed), config=config)
    assert _rel_err(got, _expected(inputs)) <= TOLERANCES[torch.float32], f"seed {seed}"


def test_chunked_prefill_with_splits_equals_one_prefill():
    """A sequence prefilled in chunks under split-KV gets the rows of one unsplit prefill."""
    seed, gen = _seeded()
    L = 150
    whole = SPEC.make_inputs(Case("whole", {"seqs": ((L, L),), "H": 4, "Hkv": 1, "Dh": 64, "window": 70,
                                            "sinks": True, "shuffle": True}), torch.float32, DEVICE, gen)
    full = paged_prefill_attention_triton(**whole, config=SPLITS[1])
    pages = whole["meta"].block_tables[0].tolist()
    for start, stop in ((0, 60), (60, 143), (143, L)):
        meta = AttentionMetadata.build(list(range(stop - start)), [pages], [0, stop - start], [stop], DEVICE)
        chunk = paged_prefill_attention_triton(**dict(whole, q=whole["q"][start:stop], meta=meta), config=SPLITS[7])
        err = _rel_err(chunk, full[start:stop])
        assert err <= 2e-6, f"chunk [{start}, {stop}): error {err:.2e} against one prefill (seed {seed})"


# -- the host's split choice -------------------------------------------------------------------

@pytest.mark.parametrize("programs,band,expected", [
    # Llama-3.1-8B, 219 new tokens over 27k: split (7 at one program per SM), then counted at two 4-warp
    # programs per SM: 9 splits, 504 programs (287 us on the H200 against 345 at 7)
    (56, 28000, 9),
    (40, 8000, 6),  # 133 over 8k
    (16, 16000, 16),  # 64 over 16k
    (128, 32768, 1),  # 512 over 32k: one wave already; a split would add a second
    (256, 32000, 1),  # 1024 over 32k: two full waves
    (128, 512, 1),  # a fresh 512-token prompt: the merge costs more than the band
    (512, 2048, 1),  # a fresh 2048-token prompt: its tiles fill the GPU (counted at two per SM it would split)
    (16, 143, 1),  # gpt-oss sliding layer (window 128): too few keys to split
    (8, 32768, 32),  # one query token over 32k (a lone decode row through this kernel)
    (1, 10 ** 6, 32),  # capped at max_splits
])
def test_split_choice(programs, band, expected):
    assert prefill_num_splits(programs, band, PagedPrefillAttentionConfig()) == expected


def test_split_launch_warps_follow_the_head_dim():
    config = PagedPrefillAttentionConfig()
    assert config.split_warps(128) == 4 and config.split_concurrent_programs(128) == 2 * config.concurrent_programs
    assert config.split_warps(256) == 8 and config.split_concurrent_programs(256) == config.concurrent_programs
    fixed = PagedPrefillAttentionConfig(split_num_warps=8)
    assert fixed.split_warps(128) == 8 and prefill_num_splits(56, 28000, fixed) == 7  # the 8-warp launch's count


def test_split_choice_can_be_fixed_and_bounded():
    assert prefill_num_splits(10_000, 16, PagedPrefillAttentionConfig(num_splits=5)) == 5
    assert prefill_num_splits(8, 32768, PagedPrefillAttentionConfig(max_splits=4)) == 4
    # each split keeps min_keys_per_split keys
    assert prefill_num_splits(8, 1000, PagedPrefillAttentionConfig(min_keys_per_split=300)) == 3


def test_config_rejects_bad_split_values():
    for bad in ({"num_splits": 0}, {"max_splits": 0}, {"min_keys_per_split": 0}, {"concurrent_programs": 0},
                {"merge_overhead_keys": -1}, {"split_num_warps": 0}):
        with pytest.raises(ValueError):
            PagedPrefillAttentionConfig(**bad)


# -- the merge's compilation for the H200 (sm_90a); the split kernel's is in test_attention_prefill_triton --

_MERGE_SIGNATURE = {"part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "sinks_ptr": "*fp32", "out_ptr": "*bf16",
                    "context_lens_ptr": "*i32", "H": "i32", "num_splits": "i32", "window": "i32",
                    "stride_o_t": "i32", "stride_o_h": "i32",
                    **{n: "constexpr" for n in ("HEAD_DIM", "BLOCK_D", "BLOCK_SPLITS", "HAS_SINKS", "ACTIVE_FROM_LENS",
                                                "HAS_WINDOW", "BLOCK_N")}}
MERGE_VARIANTS = {
    "merge-dh64-sinks-8": {"HEAD_DIM": 64, "BLOCK_D": 64, "BLOCK_SPLITS": 8, "HAS_SINKS": True,
                           "ACTIVE_FROM_LENS": False, "HAS_WINDOW": False, "BLOCK_N": 16},
    "merge-dh256-32": {"HEAD_DIM": 256, "BLOCK_D": 256, "BLOCK_SPLITS": 32, "HAS_SINKS": False,
                       "ACTIVE_FROM_LENS": False, "HAS_WINDOW": False, "BLOCK_N": 16},
}


@pytest.fixture(scope="module")
def merge_reports() -> dict:
    requests = [{"kernel": _paged_decode_attention_merge_kernel, "signature": _MERGE_SIGNATURE, "constexprs": c,
                 "num_warps": 4, "num_stages": 1, "divisible": ("stride_o_t", "stride_o_h")}
                for c in MERGE_VARIANTS.values()]
    return dict(zip(MERGE_VARIANTS, compile_checks(requests)))


@pytest.mark.parametrize("name", MERGE_VARIANTS)
def test_merge_compiles_for_hopper(merge_reports, name):
    report = merge_reports[name]
    assert report.ok, report.error
    print(report.summary())
    assert ".target sm_90a" in report.ptx
    assert report.spills in (0, None), f"{name}: {report.spills} spill bytes"
