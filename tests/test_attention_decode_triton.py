"""Paged decode attention (split-KV): the Triton kernels against paged_attention_ref (interpreter
on CPU), the host's split choice, argument checks, and compilation for Hopper."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from qml_kernels import attention_decode, registry
from qml_kernels.attention import AttentionMetadata, paged_attention_ref
from qml_kernels.attention_decode import (
    PAGED_DECODE_ATTENTION_SPEC,
    PagedDecodeAttentionConfig,
    _paged_decode_attention_kernel,
    _paged_decode_attention_merge_kernel,
    decode_num_splits,
    paged_decode_attention,
    paged_decode_attention_triton,
)
from qml_kernels.workbench.check import check
from qml_kernels.workbench.compile import assert_compiled_for_hopper
from qml_kernels.workbench.spec import Case

# max |out - ref| / max |ref|, ref in fp32: fp32 is reordered sums only; fp16 rounds the output
# and the probabilities fed to the p.v tensor-core product (2^-11 each)
TOLERANCES = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# the interpreter computes bf16 wrongly without an error: bf16 is checked on the GPU only
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
CONFIGS = {
    "default": PagedDecodeAttentionConfig(),
    # 16 keys a step and 3 splits: every case with more than 16 keys goes through the merge stage
    "split-3": PagedDecodeAttentionConfig(block_n=16, num_splits=3),
    # more splits than steps: most splits are empty and must weigh nothing
    "split-16": PagedDecodeAttentionConfig(block_n=32, num_splits=16, num_stages=1),
}


def _inputs(case: Case, dtype: torch.dtype) -> tuple[int, dict]:
    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator(DEVICE).manual_seed(seed)
    return seed, PAGED_DECODE_ATTENTION_SPEC.make_inputs(case, dtype, DEVICE, gen)


def _case(name: str) -> Case:
    return next(c for c in PAGED_DECODE_ATTENTION_SPEC.cases if c.name == name)


def _expected(inputs: dict) -> torch.Tensor:
    return paged_attention_ref(**{k: v.float() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()})


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite values in the output (an unwritten NaN-poisoned element?)"
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", PAGED_DECODE_ATTENTION_SPEC.cases, ids=lambda c: c.name)
def test_kernel_matches_reference(case, dtype, config):
    seed, inputs = _inputs(case, dtype)
    before = {k: inputs[k].clone() for k in ("q", "k_cache", "v_cache")}
    out = torch.full(inputs["q"].shape, float("nan"), dtype=dtype, device=DEVICE)
    got = paged_decode_attention_triton(**inputs, out=out, config=config)
    assert got is out
    err, tol = _rel_err(got, _expected(inputs)), TOLERANCES[dtype]
    assert err <= tol, f"{case.name} {dtype}: error {err:.2e} > {tol:.0e} (seed {seed})"
    assert all(torch.equal(inputs[k], v) for k, v in before.items()), "the inputs were modified"


def test_strided_out_view():
    """out as a [B, H, Dh] view with a token stride wider than H * Dh (a slice of a larger buffer)."""
    seed, inputs = _inputs(_case("ragged"), torch.float16)
    B, H, Dh = inputs["q"].shape
    buf = torch.full((B, H + 3, Dh), float("nan"), dtype=torch.float16, device=DEVICE)
    got = paged_decode_attention_triton(**inputs, out=buf[:, 1:H + 1], config=CONFIGS["split-3"])
    assert _rel_err(got, _expected(inputs)) <= TOLERANCES[torch.float16], f"seed {seed}"
    assert buf[:, 0].isnan().all() and buf[:, H + 1:].isnan().all(), "wrote outside the out view"


def test_long_context_many_splits():
    """33k keys (positions past 2^15), the default split choice (32 splits at one sequence)."""
    case = Case("long", {"ctx": [33000], "H": 2, "Hkv": 1, "Dh": 64, "S": 64, "shuffle": True, "sinks": True})
    seed, inputs = _inputs(case, torch.float16)
    assert decode_num_splits(1, 1, 33000, PagedDecodeAttentionConfig()) == 32
    err = _rel_err(paged_decode_attention_triton(**inputs), _expected(inputs))
    assert err <= TOLERANCES[torch.float16], f"error {err:.2e} (seed {seed})"


def test_split_count_gives_every_split_a_key_step():
    """Batch 1, Qwen3-30B-A3B's 4 KV heads (128-key steps): one split per step up to the occupancy cap, so
    no split is left empty (386 keys in 3 splits left one without a step: measured as slow as 2)."""
    config = PagedDecodeAttentionConfig()
    assert [decode_num_splits(1, 4, L, config) for L in (1, 128, 129, 130, 386, 1024, 4096)] == [1, 1, 2, 2, 4, 8, 32]
    assert decode_num_splits(32, 8, 386, config) == 2  # 256 programs: the occupancy cap (2 per SM) first


@pytest.mark.parametrize("window", [None, 1000], ids=["full", "window-1000"])
def test_split_count_of_a_longer_context_as_a_graph_captures_it(monkeypatch, window):
    """A CUDA graph sizes the split count for its longest context (host lengths of 4,096 keys here) and
    replays it over short ones: splits past a sequence's key steps return without storing, and the merge
    reads only the splits a sequence's steps reach. The workspace is NaN-poisoned: a merge that read one
    split too many would give NaN."""
    case = Case("graph", {"ctx": [1, 130, 1300, 0, 129], "H": 4, "Hkv": 2, "Dh": 64, "S": 16, "shuffle": True,
                          "window": window, "sinks": True})
    seed, inputs = _inputs(case, torch.float32)
    expected = _expected(inputs)
    meta, config = inputs["meta"], PagedDecodeAttentionConfig(block_n=64)
    longest = 4096
    wide = torch.zeros(meta.num_seqs, longest // 16, dtype=torch.int32, device=DEVICE)
    wide[:, :meta.block_tables.shape[1]] = meta.block_tables
    inputs["meta"] = dataclasses.replace(meta, block_tables=wide, context_lens_host=[longest] * meta.num_seqs)
    assert decode_num_splits(meta.num_seqs, 2, longest if window is None else window, config) > 4
    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.dtype == torch.float32 else t

    monkeypatch.setattr(attention_decode.torch, "empty", poisoned)
    out = torch.full(inputs["q"].shape, 7.0, dtype=torch.float32, device=DEVICE)
    got = paged_decode_attention_triton(**inputs, out=out, config=config)
    monkeypatch.undo()
    assert torch.equal(got[3], torch.zeros_like(got[3])), "the sequence without keys"
    assert _rel_err(got, expected) <= TOLERANCES[torch.float32], f"seed {seed}"


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("sinks", [False, True], ids=["no-sinks", "sinks"])
def test_empty_sequence_gives_zeros(config, sinks):
    """A row with no cached tokens (how a runner may pad a batch to a captured graph's size) is 0,
    as in the reference, and does not disturb its neighbours."""
    case = Case("padded", {"ctx": [0, 45, 0], "H": 4, "Hkv": 2, "Dh": 64, "sinks": sinks})
    seed, inputs = _inputs(case, torch.float32)
    got = paged_decode_attention_triton(**inputs, config=config)
    assert torch.equal(got[0], torch.zeros_like(got[0])) and torch.equal(got[2], torch.zeros_like(got[2]))
    assert _rel_err(got, _expected(inputs)) <= TOLERANCES[torch.float32], f"seed {seed}"


def test_workbench_check_passes():
    report = check("paged_decode_attention", "triton", dtypes=[torch.float32, torch.float16], device=DEVICE)
    report.raise_if_failed()


def test_public_op_runs_the_kernel_under_using_triton():
    seed, inputs = _inputs(_case("sinks-window"), torch.float16)
    with registry.using("triton"):
        assert registry.select("paged_decode_attention", **inputs).name == "triton"
        got = paged_decode_attention(**inputs)
    assert _rel_err(got, _expected(inputs)) <= TOLERANCES[torch.float16], f"seed {seed}"


# -- the host's split choice -------------------------------------------------------------------

@pytest.mark.parametrize("batch,kv_heads,max_keys,expected", [
    (1, 8, 32768, 32),  # Llama-3.1-8B, one long sequence: capped at max_splits
    (1, 8, 2048, 16),  # shorter: each split keeps >= 128 keys
    (8, 8, 32768, 5),  # 64 (sequence, KV head) pairs: 5 splits make 320 >= 264 programs
    (64, 8, 32768, 1),  # 512 pairs already fill the GPU twice over: no merge stage
    (1, 8, 128, 1),  # gpt-oss sliding layer: 128 visible keys at most
    (1, 1, 1, 1),
])
def test_split_choice(batch, kv_heads, max_keys, expected):
    assert decode_num_splits(batch, kv_heads, max_keys, PagedDecodeAttentionConfig()) == expected


def test_split_choice_can_be_fixed():
    assert decode_num_splits(256, 8, 10, PagedDecodeAttentionConfig(num_splits=7)) == 7


def test_config_rejects_bad_values():
    for bad in ({"block_n": 24}, {"block_n": 8}, {"num_splits": 0}, {"max_splits": 0}):
        with pytest.raises(ValueError):
            PagedDecodeAttentionConfig(**bad)


# -- argument checks ---------------------------------------------------------------------------

def _good() -> dict:
    _, inputs = _inputs(Case("c", {"ctx": [5, 20], "H": 4, "Hkv": 2, "Dh": 64}), torch.float32)
    return inputs


def _bad(what: str) -> dict:
    inputs = _good()
    q, k = inputs["q"], inputs["k_cache"]
    if what == "prefill_batch":
        meta = inputs["meta"]
        inputs["q"] = torch.randn(3, 4, 64)
        inputs["meta"] = AttentionMetadata.build([0, 1, 2], meta.block_tables.tolist(), [0, 1, 3], [5, 20], "cpu")
    elif what == "dtype":
        inputs["q"] = q.half()
    elif what == "heads":
        inputs["q"] = torch.randn(2, 3, 64)
    elif what == "head_dim":
        inputs["q"] = torch.randn(2, 4, 32)
    elif what == "strided_last_dim":
        inputs["q"] = torch.randn(2, 64, 4).transpose(1, 2)
    elif what == "sinks_shape":
        inputs["sinks"] = torch.zeros(2)
    elif what == "out_dtype":
        inputs["out"] = torch.empty_like(q, dtype=torch.float16)
    elif what == "narrow_block_table":
        inputs["meta"] = dataclasses.replace(inputs["meta"], block_tables=inputs["meta"].block_tables[:, :1])
    elif what == "window":
        inputs["sliding_window"] = 0
    elif what == "cache_shape":
        inputs["v_cache"] = k[:, :, :1]
    return inputs


@pytest.mark.parametrize("what", ["prefill_batch", "dtype", "heads", "head_dim", "strided_last_dim", "sinks_shape",
                                  "out_dtype", "narrow_block_table", "window", "cache_shape"])
def test_rejects_bad_arguments(what):
    with pytest.raises(AssertionError):
        paged_decode_attention_triton(**_bad(what))


def test_not_selected_for_prefill_batches():
    inputs = _bad("prefill_batch")
    impl = registry.get_impl("paged_decode_attention", "triton")
    assert not impl.supports(**inputs)
    assert impl.supports(**_good())


# -- compilation for the H200 (sm_90a) ---------------------------------------------------------

_STRIDES = ("stride_q_t", "stride_q_h", "stride_k_p", "stride_k_s", "stride_k_h", "stride_v_p", "stride_v_s",
            "stride_v_h", "stride_bt", "stride_o_t", "stride_o_h")
_SIGNATURE = {
    "q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "block_tables_ptr": "*i32", "context_lens_ptr": "*i32",
    "sinks_ptr": "*fp32", "out_ptr": "*bf16", "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32",
    "H": "i32", "num_splits": "i32", "window": "i32", "qk_scale": "fp32", "cap_scale": "fp32",
    **{name: "i32" for name in _STRIDES},
    **{name: "constexpr" for name in ("GROUP", "HEAD_DIM", "PAGE_SIZE", "BLOCK_G", "BLOCK_D", "BLOCK_N",
                                      "HAS_WINDOW", "HAS_SOFTCAP", "HAS_SINKS", "DIRECT", "DOT_PRECISION")},
}
_MERGE_SIGNATURE = {"part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "sinks_ptr": "*fp32", "out_ptr": "*bf16",
                    "context_lens_ptr": "*i32", "H": "i32", "num_splits": "i32", "window": "i32",
                    "stride_o_t": "i32", "stride_o_h": "i32",
                    **{n: "constexpr" for n in ("HEAD_DIM", "BLOCK_D", "BLOCK_SPLITS", "HAS_SINKS", "ACTIVE_FROM_LENS",
                                                "HAS_WINDOW", "BLOCK_N")}}


def _variant(group: int, Dh: int, window=False, softcap=False, sinks=False, direct=False) -> dict:
    """Stage 1 in bf16 as the launcher specialises it with the default config; at model sizes every
    stride but the block table's is a multiple of 16 elements, which a real launch tells the compiler."""
    config = PagedDecodeAttentionConfig()
    constexprs = {"GROUP": group, "HEAD_DIM": Dh, "PAGE_SIZE": 16, "BLOCK_G": max(16, group), "BLOCK_D": Dh,
                  "BLOCK_N": config.keys_per_step(Dh), "HAS_WINDOW": window, "HAS_SOFTCAP": softcap,
                  "HAS_SINKS": sinks, "DIRECT": direct, "DOT_PRECISION": "tf32"}
    return {"kernel": _paged_decode_attention_kernel, "signature": _SIGNATURE, "constexprs": constexprs,
            "num_warps": config.num_warps, "num_stages": config.num_stages,
            "divisible": tuple(s for s in _STRIDES if s != "stride_bt")}


COMPILE_VARIANTS = {
    "llama-dh128-split": _variant(4, 128),
    "llama-dh128-direct": _variant(4, 128, direct=True),
    "gpt-oss-dh64-window-sinks": _variant(8, 64, window=True, sinks=True, direct=True),
    "gemma3-dh256-window-softcap": _variant(4, 256, window=True, softcap=True),
    "merge-dh128-sinks": {"kernel": _paged_decode_attention_merge_kernel, "signature": _MERGE_SIGNATURE,
                          "constexprs": {"HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_SPLITS": 32, "HAS_SINKS": True,
                                         "ACTIVE_FROM_LENS": True, "HAS_WINDOW": True, "BLOCK_N": 128},
                          "num_warps": 4, "num_stages": 1, "divisible": ("stride_o_t", "stride_o_h")},
}


@pytest.mark.parametrize("name", COMPILE_VARIANTS)
def test_compiles_for_hopper(compile_reports, name):
    # spilled accumulators would add local-memory round trips to every step of a memory-bound loop
    report = assert_compiled_for_hopper(compile_reports[name], name)
    print(f"{name}: {report.summary()}")
    # two programs per SM (the split choice's target) must fit in the 228 KiB of shared memory
    assert report.shared_bytes <= 110 * 1024, f"{name}: {report.shared_bytes} B shared"
    if name.startswith("merge"):
        return
    # q.k and p.v on tensor cores (16-row tiles: mma.sync; wgmma needs 64 rows), K/V streamed
    # through shared memory by asynchronous copies that overlap the math of earlier steps
    assert "mma.sync" in report.ptx or report.has_wgmma, f"{name}: tl.dot did not use tensor cores"
    assert "cp.async" in report.ptx, f"{name}: the K/V loads are not pipelined"
