"""The turn path: a few hundred queries over a long cached history, the history's whole pages attended by
cuDNN on packed rows (here: ``HistoryReference``, the same math in fp32 torch on the same buffers), the
rest of the keys by ``_turn_tail_merge_kernel``, which also merges the parts. Against paged_attention_ref
(the Triton kernels in the interpreter on CPU), including the lengths a CUDA graph's replays hold on the
device while the host lists claim others; the run count; when the path applies; the kernels' compilation
for Hopper."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from qml_kernels import attention_turn
from qml_kernels.attention import AttentionMetadata, paged_attention_ref
from qml_kernels.attention_prefill import PAGED_PREFILL_ATTENTION_SPEC
from qml_kernels.attention_turn import (
    HistoryReference,
    RunSplit,
    TailLaunch,
    _turn_pack_q_kernel,
    _turn_plan_kernel,
    _turn_tail_merge_kernel,
    num_runs,
    turn_attention,
)
from qml_kernels.workbench.compile import assert_compiled_for_hopper, compile_checks_by_name
from qml_kernels.workbench.spec import Case

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCES = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}

CASES = (
    Case("gqa4-one-turn", {"seqs": ((21, 300),), "H": 8, "Hkv": 2, "Dh": 64, "shuffle": True, "fused_q": True},
         edge="group 4 (4 query heads a row group), the history ending mid-page: the tail starts a page back; q a "
              "view into the QKV projection, as the engine passes it"),
    Case("two-turns-ragged", {"seqs": ((5, 161), (17, 240)), "H": 4, "Hkv": 1, "Dh": 32, "shuffle": True},
         edge="two sequences, tiles of two lengths; the second's tail spans pages"),
    Case("mha-page-aligned", {"seqs": ((16, 144),), "H": 2, "Hkv": 2, "Dh": 128},
         edge="group 1, the history a whole number of pages (the tail is the queries' own keys only)"),
    Case("group8-pages32", {"seqs": ((3, 200), (9, 77)), "H": 8, "Hkv": 1, "Dh": 64, "S": 32, "shuffle": True},
         edge="group 8 (8 tokens a tile), pages of 32"),
)
RUN_SMS = (1, 8, 64)  # one run; a few; more runs than some histories have pages (empty runs weigh nothing)


def _seeded() -> tuple[int, torch.Generator]:
    seed = int(os.environ.get("QML_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    return seed, torch.Generator(DEVICE).manual_seed(seed)


def _inputs(case: Case, dtype, gen) -> dict:
    x = PAGED_PREFILL_ATTENTION_SPEC.make_inputs(case, dtype, DEVICE, gen)
    return {k: x[k] for k in ("q", "k_cache", "v_cache", "meta", "scale")}


def _rel_err(out, ref) -> float:
    assert torch.isfinite(out).all(), "non-finite values in the output"
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def _expected(x: dict) -> torch.Tensor:
    return paged_attention_ref(**{k: v.float() if isinstance(v, torch.Tensor) else v for k, v in x.items()})


@pytest.mark.parametrize("sms", RUN_SMS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_turn_matches_reference_fp32(case, sms):
    seed, gen = _seeded()
    x = _inputs(case, torch.float32, gen)
    out = torch.full_like(x["q"], float("nan"))
    got = turn_attention(**x, out=out, history=HistoryReference(sms))
    assert got is out
    err = _rel_err(got, _expected(x))
    assert err <= TOLERANCES[torch.float32], f"{case.name} sms={sms}: error {err:.2e} (seed {seed})"


@pytest.mark.parametrize("tail", [TailLaunch(rows=16, block_n=32, warps=2), TailLaunch(rows=32, block_n=128),
                                  TailLaunch(rows=128, block_n=16, warps=8, stages=3)],
                         ids=lambda t: f"rows{t.rows}-n{t.block_n}-w{t.warps}-s{t.stages}")
@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[3]], ids=lambda c: c.name)
def test_other_tail_launches_match_reference_fp32(case, tail):
    """The tail kernel's launches a sweep times (smaller and larger tiles, other key steps) give the same
    attention."""
    seed, gen = _seeded()
    x = _inputs(case, torch.float32, gen)
    got = turn_attention(**x, out=torch.full_like(x["q"], float("nan")), history=HistoryReference(8), tail=tail)
    err = _rel_err(got, _expected(x))
    assert err <= TOLERANCES[torch.float32], f"{case.name} {tail}: error {err:.2e} (seed {seed})"


@pytest.mark.parametrize("case", CASES[:2], ids=lambda c: c.name)
def test_turn_matches_reference_fp16(case):
    seed, gen = _seeded()
    x = _inputs(case, torch.float16, gen)
    err = _rel_err(turn_attention(**x, history=HistoryReference(8)), _expected(x))
    assert err <= TOLERANCES[torch.float16], f"{case.name}: error {err:.2e} (seed {seed})"


def test_plan_is_made_once_per_step_and_reused_by_every_layer():
    _, gen = _seeded()
    x = _inputs(CASES[0], torch.float32, gen)
    history = HistoryReference(8)
    calls = []
    real = history.graph_for
    history.graph_for = lambda *a: calls.append(1) or real(*a)
    first = turn_attention(**x, history=history)
    (plan,) = x["meta"].plans.values()
    second = turn_attention(**x, history=history)  # the next layer: same metadata
    assert len(calls) == 1 and list(x["meta"].plans.values()) == [plan]
    assert torch.equal(first, second)
    assert dataclasses.replace(x["meta"]).plans == {}  # a copy of the metadata plans afresh


def test_launch_from_host_values_device_lengths_differ():
    """A CUDA graph's replay: the host lists claim long contexts (they size rows, runs and tables), the device
    holds the real lengths, and a padding sequence of a few rows over as many keys comes second."""
    seed, gen = _seeded()
    case = Case("graph", {"seqs": ((20, 290), (4, 4)), "H": 8, "Hkv": 2, "Dh": 64, "shuffle": True})
    x = _inputs(case, torch.float32, gen)
    claimed = dataclasses.replace(x["meta"], cu_seqlens_q_host=[0, 31, 32], context_lens_host=[4096, 4096])
    got = turn_attention(**dict(x, meta=claimed), history=HistoryReference(8))
    ref = _expected(x)
    assert _rel_err(got[:20], ref[:20]) <= TOLERANCES[torch.float32], f"seed {seed}"


@pytest.mark.parametrize("sms", RUN_SMS)
def test_a_graphs_padding_sequence_gets_no_cudnn_entries(sms):
    """As a prefill graph runs a turn: the turn, then its padding rows over only their own keys, with
    ``history_seqs=1``: cuDNN's entries are the turn's runs alone (half the launch), every row still right."""
    seed, gen = _seeded()
    case = Case("graph", {"seqs": ((20, 290), (12, 12)), "H": 8, "Hkv": 2, "Dh": 64, "shuffle": True})
    x = _inputs(case, torch.float32, gen)
    claimed = dataclasses.replace(x["meta"], cu_seqlens_q_host=[0, 31, 32], context_lens_host=[4096, 4096])
    one = dataclasses.replace(claimed, history_seqs=1)
    history = HistoryReference(sms)
    both = history.graph_for(x["q"], x["k_cache"], claimed)
    (g, split) = history.graph_for(x["q"], x["k_cache"], one)
    assert g.q.shape[0] == split.runs and both[0].q.shape[0] == 2 * both[1].runs
    got = turn_attention(**dict(x, meta=one), out=torch.full_like(x["q"], float("nan")), history=history)
    err = _rel_err(got, _expected(x))  # the padding sequence's rows too: its keys all went to the tail kernel
    assert err <= TOLERANCES[torch.float32], f"sms={sms}: error {err:.2e} (seed {seed})"


@pytest.mark.parametrize("rows,kv_heads,sms,expected", [
    (640, 8, 132, 3),  # Llama-3.1-8B, 150 queries x 4 heads: 5 tiles x 8 heads = 40 programs a run
    (896, 8, 132, 2),  # 219 queries: 7 tiles
    (2048, 8, 132, 1),  # 512 queries: 16 tiles, one wave with one run
    (64, 8, 132, 16),  # a short turn: capped
    (640, 4, 132, 6),  # Qwen3-30B-A3B heads (4 KV heads, group 8: 80 queries)
])
def test_run_count_fills_one_wave(rows, kv_heads, sms, expected):
    assert num_runs(rows, kv_heads, sms) == expected


SPLITS = (RunSplit(3, 1, 4), RunSplit(2, 2, 7), RunSplit(1, 3, 2), RunSplit(4, 12, 9))


@pytest.mark.parametrize("split", SPLITS, ids=lambda s: f"{s.long}x{s.weight}+{s.short}")
@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[3]], ids=lambda c: c.name)
def test_uneven_run_splits_match_reference_fp32(case, split):
    """Long runs and short ones (the last: more runs than some histories have pages, so some are empty) give the
    same attention."""
    seed, gen = _seeded()
    x = _inputs(case, torch.float32, gen)
    got = turn_attention(**x, out=torch.full_like(x["q"], float("nan")), history=HistoryReference(8), split=split)
    err = _rel_err(got, _expected(x))
    assert err <= TOLERANCES[torch.float32], f"{case.name} {split}: error {err:.2e} (seed {seed})"


@pytest.mark.parametrize("split", (RunSplit(3), RunSplit(3, 1, 4), RunSplit(2, 3, 5), RunSplit(1, 15, 3)),
                         ids=lambda s: f"{s.long}x{s.weight}+{s.short}")
@pytest.mark.parametrize("pages", (1, 7, 97, 1699))
def test_split_plan_covers_the_history_in_order(split, pages):
    """The plan kernel's runs: consecutive, covering every whole page of the history once, long runs holding
    ``weight`` times a short one's pages (to a page), none over the table's width the launch sized."""
    S, n_q = 16, 5
    meta = AttentionMetadata.build([0] * n_q, [list(range(100, 100 + pages + 1))], [0, n_q], [pages * S + n_q],
                                   DEVICE)
    max_pages = _bucket_pages(split, meta)
    E = split.runs
    table = torch.full((E, 1, max_pages, 1), -1, dtype=torch.int32, device=DEVICE)
    seq_q = torch.zeros(E, 1, 1, 1, dtype=torch.int32, device=DEVICE)
    seq_kv = torch.zeros_like(seq_q)
    tail = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    bt = meta.block_tables
    _turn_plan_kernel[(E,)](bt, meta.cu_seqlens_q, meta.context_lens, table, seq_q, seq_kv, tail, bt.stride(0),
                            bt.shape[1], max_pages, RUNS=split.runs, LONG=split.long, WEIGHT=split.weight, GROUP=4,
                            PAGE_SIZE=S, BLOCK=256)
    counts = [int(seq_kv[e]) // S for e in range(E)]
    assert sum(counts) == pages and int(tail[0]) == pages * S
    assert all(int(seq_q[e]) == n_q * 4 for e in range(E))
    got = [int(table[e, 0, j, 0]) for e in range(E) for j in range(counts[e])]
    assert got == list(range(100, 100 + pages))
    unit = pages / split.shares
    for e, c in enumerate(counts):
        want = unit * (split.weight if e < split.long else 1)
        assert abs(c - want) <= 1 and c <= max_pages, (e, counts)


def _bucket_pages(split: RunSplit, meta: AttentionMetadata) -> int:
    x = torch.zeros(meta.num_seqs * 5, 8, 16)
    return attention_turn._launch_shape(x, torch.zeros(1, 16, 2, 16), meta, 8, split)[3]


def test_split_parse_and_bounds(monkeypatch):
    assert RunSplit.parse("3") == RunSplit(3) and RunSplit.parse("3x4+1") == RunSplit(3, 1, 4)
    assert RunSplit.parse("2+2") == RunSplit(2, 2, 1)
    assert RunSplit(3, 1, 4).shares == 13 and RunSplit(3, 1, 4).pages_per_run(1699) == 523
    for bad in ("0", "3x0+1", "10+7"):
        with pytest.raises(ValueError):
            RunSplit.parse(bad)
    meta = AttentionMetadata.build([0] * 150, [[0] * 1718], [0, 150], [27339], "cpu")
    q, cache = torch.zeros(150, 32, 128), torch.zeros(4, 16, 8, 128)
    default = attention_turn.wave_split(40, 132)  # 5 tiles x 8 KV heads a run
    assert attention_turn._launch_shape(q, cache, meta, 132)[:3] == (default.runs, default, 640)
    monkeypatch.setenv("QML_TURN_SPLIT", "3x4+1")  # the engine's A/B of a split
    E, split, _, max_pages = attention_turn._launch_shape(q, cache, meta, 132)
    assert (E, split) == (4, RunSplit(3, 1, 4)) and max_pages >= 1718 * 4 // 13 + 1
    monkeypatch.setenv("QML_TURN_SPLIT", "equal")  # num_runs' equal runs
    assert attention_turn._launch_shape(q, cache, meta, 132)[:2] == (3, RunSplit(3))


def test_wave_time_counts_rounds_of_programs():
    """The model's arithmetic on hand-worked launches (costs taken out): 3 equal runs of 40 programs on 132 SMs
    are one round of a third; 4 equal runs are two (the 160 programs do not fit); 3x4+1's short run takes
    the 12 spare SMs 4 rounds of 1/13, ending with the long runs at 4/13."""
    a, c = attention_turn.WAVE_PROGRAM_COST, attention_turn.WAVE_RUN_COST
    t = attention_turn.wave_time
    assert t(RunSplit(3), 40, 132) == pytest.approx(1 / 3 + a + 3 * c)
    assert t(RunSplit(4), 40, 132) == pytest.approx(2 * (1 / 4 + a) + 4 * c)
    assert t(RunSplit(3, 1, 4), 40, 132) == pytest.approx(4 * (1 / 13 + a) + 4 * c)


@pytest.mark.parametrize("per_run", range(4, 161, 4))
def test_wave_split_never_slower_than_equal_runs(per_run):
    """For every launch size: the split is valid, fits MAX_RUNS, and the model times it no slower than
    ``num_runs``' equal runs; and where equal runs leave a third of the SMs idle it finds a faster one."""
    sms = 132
    split = attention_turn.wave_split(per_run, sms)
    equal = RunSplit(max(1, min(attention_turn.MAX_RUNS, sms // per_run)))
    t, t_equal = attention_turn.wave_time(split, per_run, sms), attention_turn.wave_time(equal, per_run, sms)
    assert split.runs <= attention_turn.MAX_RUNS and t <= t_equal
    if equal.runs < attention_turn.MAX_RUNS and equal.runs * per_run <= sms * 2 // 3:
        assert t < t_equal * 0.9, (per_run, split, t, t_equal)


def test_wave_split_of_the_measured_turns():
    """What the H100 sweep (``turn-tail-sweep-h100-2026-12-06.json``) says for 150 queries (40 programs): one short
    run beside 3 long ones of 4 shares (-4.3% of the path against 3 equal runs, the sweep's best); 161-192 queries
    (48): not 2 equal runs, which leave 36 SMs idle."""
    assert attention_turn.wave_split(40, 132) == RunSplit(3, 1, 4)
    assert attention_turn.wave_split(48, 132).short > 0


def test_supported_only_for_turns_over_long_histories(monkeypatch):
    """The host lists decide: every sequence a turn of at most TURN_MAX_QUERIES over TURN_MIN_HISTORY cached
    keys or more, no window, sinks or soft-cap, not a decode batch; on CPU never."""
    q = torch.zeros(150, 32, 128, dtype=torch.bfloat16)
    cache = torch.zeros(4, 16, 8, 128, dtype=torch.bfloat16)

    def meta(cu, lens):
        return AttentionMetadata.build([0] * cu[-1], [[0]] * len(lens), cu, lens, "cpu")

    turn = meta([0, 150], [27339])
    assert not attention_turn.supported(q, cache, cache, turn, 0.1)  # CPU tensors
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(attention_turn, "_cudnn", lambda: object())
    monkeypatch.setattr(attention_turn, "_graph_for", lambda *a: (object(), RunSplit(3)))
    assert attention_turn.supported(q, cache, cache, turn, 0.1)
    assert not attention_turn.supported(q, cache, cache, meta([0, 150], [150 + 4095]), 0.1)  # short history
    assert not attention_turn.supported(q[:1], cache, cache, meta([0, 1], [27339]), 0.1)  # decode
    long_q = torch.zeros(600, 32, 128, dtype=torch.bfloat16)
    assert not attention_turn.supported(long_q, cache, cache, meta([0, 600], [27339]), 0.1)  # a long chunk
    assert not attention_turn.supported(q, cache, cache, turn, 0.1, sliding_window=128)
    assert not attention_turn.supported(q, cache, cache, turn, 0.1, softcap=30.0)
    assert not attention_turn.supported(q.float(), cache.float(), cache.float(), turn, 0.1)
    monkeypatch.setattr(attention_turn, "_graph_for", lambda *a: (None, RunSplit(3)))  # cuDNN declined the shape
    assert not attention_turn.supported(q, cache, cache, turn, 0.1)
    monkeypatch.setattr(attention_turn, "ENABLED", False)
    monkeypatch.setattr(attention_turn, "_graph_for", lambda *a: (object(), RunSplit(3)))
    assert not attention_turn.supported(q, cache, cache, turn, 0.1)


def test_shapes_are_built_only_where_builds_are_allowed(monkeypatch):
    """A served step never stalls on a cuDNN build: new launch shapes are built inside ``builds()`` (the
    warm-up before a CUDA graph's capture) and reused after; elsewhere the step is declined (Triton)."""
    built = []
    monkeypatch.setattr(attention_turn, "_sms", lambda index: 132)
    monkeypatch.setattr(attention_turn, "_Graph", lambda *args: built.append(args) or "graph")
    monkeypatch.setattr(attention_turn, "_captures", lambda *args: True)
    monkeypatch.setattr(attention_turn, "_cudnn", lambda: object())
    monkeypatch.setattr(attention_turn, "_GRAPHS", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    q = torch.zeros(150, 32, 128, dtype=torch.bfloat16)
    cache = torch.zeros(4, 16, 8, 128, dtype=torch.bfloat16)
    meta = AttentionMetadata.build([0] * 150, [[0] * 1718], [0, 150], [27339], "cpu")
    split = attention_turn.wave_split(40, 132)
    assert attention_turn._graph_for(q, cache, meta, 0.1) == (None, split)
    with attention_turn.builds():
        assert attention_turn._graph_for(q, cache, meta, 0.1) == ("graph", split)
    assert attention_turn._graph_for(q, cache, meta, 0.1) == ("graph", split)
    assert len(built) == 1
    wider = AttentionMetadata.build([0] * 150, [[0] * 5120], [0, 150], [27339], "cpu")
    assert attention_turn._graph_for(q, cache, wider, 0.1) == (None, split)  # another table width: another shape


# -- compiled for the H200 (sm_90a) ----------------------------------------------------------------

_I32 = "i32"
_TAIL_SIGNATURE = {
    **{n: "*bf16" for n in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr", "hist_o_ptr")},
    "hist_lse_ptr": "*fp32", **{n: "*i32" for n in ("seq_kv_ptr", "block_tables_ptr", "cu_seqlens_q_ptr",
                                                     "context_lens_ptr", "tail_ptr")},
    "num_seqs": _I32, "history_seqs": _I32, "pre_scale": "fp32",
    **{n: _I32 for n in ("stride_q_t", "stride_q_h", "stride_o_t", "stride_o_h", "stride_page", "stride_slot",
                         "stride_head", "stride_bt", "stride_ho_e", "stride_ho_h", "stride_ho_r", "stride_hl_e",
                         "stride_hl_h")},
    **{n: "constexpr" for n in ("RUNS", "GROUP", "TILE_TOKENS", "HEAD_DIM", "PAGE_SIZE", "BLOCK_M", "BLOCK_N",
                                "DOT_PRECISION")},
}
_PACK_SIGNATURE = {"q_ptr": "*bf16", "packed_ptr": "*bf16", "cu_seqlens_q_ptr": "*i32", "num_seqs": _I32,
                   "history_seqs": _I32,
                   **{n: _I32 for n in ("stride_q_t", "stride_q_h", "stride_p_e", "stride_p_h", "stride_p_r")},
                   **{n: "constexpr" for n in ("RUNS", "GROUP", "TILE_TOKENS", "HEAD_DIM", "BLOCK_M")}}
_PLAN_SIGNATURE = {**{n: "*i32" for n in ("block_tables_ptr", "cu_seqlens_q_ptr", "context_lens_ptr", "table_ptr",
                                          "seq_q_ptr", "seq_kv_ptr", "tail_ptr")},
                   "stride_bt": _I32, "width": _I32, "max_pages": _I32,
                   **{n: "constexpr" for n in ("RUNS", "LONG", "WEIGHT", "GROUP", "PAGE_SIZE", "BLOCK")}}
LLAMA = {"RUNS": 3, "GROUP": 4, "HEAD_DIM": 128}
VARIANTS = {
    "tail-merge-llama": {"kernel": _turn_tail_merge_kernel, "signature": _TAIL_SIGNATURE, "num_stages": 2,
                         "constexprs": {**LLAMA, "TILE_TOKENS": 16, "PAGE_SIZE": 16, "BLOCK_M": 64, "BLOCK_N": 64,
                                        "DOT_PRECISION": "tf32"}},
    "tail-merge-llama-rows32": {"kernel": _turn_tail_merge_kernel, "signature": _TAIL_SIGNATURE, "num_stages": 2,
                                "constexprs": {**LLAMA, "TILE_TOKENS": 8, "PAGE_SIZE": 16, "BLOCK_M": 32,
                                               "BLOCK_N": 128, "DOT_PRECISION": "tf32"}},
    "pack-llama": {"kernel": _turn_pack_q_kernel, "signature": _PACK_SIGNATURE,
                   "constexprs": {**LLAMA, "TILE_TOKENS": 16, "BLOCK_M": 64}},
    "plan-llama": {"kernel": _turn_plan_kernel, "signature": _PLAN_SIGNATURE,
                   "constexprs": {"RUNS": 3, "LONG": 3, "WEIGHT": 1, "GROUP": 4, "PAGE_SIZE": 16, "BLOCK": 256}},
    "plan-llama-split": {"kernel": _turn_plan_kernel, "signature": _PLAN_SIGNATURE,
                         "constexprs": {"RUNS": 4, "LONG": 3, "WEIGHT": 4, "GROUP": 4, "PAGE_SIZE": 16, "BLOCK": 256}},
}


@pytest.fixture(scope="module")
def compiled():
    return compile_checks_by_name(VARIANTS)


@pytest.mark.parametrize("name", VARIANTS)
def test_compiles_for_hopper(compiled, name):
    report = assert_compiled_for_hopper(compiled[name], name)
    if name.startswith("tail"):
        assert "wgmma" in report.ptx or "mma.sync" in report.ptx, "the tail's dots did not reach the tensor cores"


@pytest.mark.skipif(DEVICE.type != "cuda" or attention_turn._cudnn() is None, reason="cuDNN on a GPU")
@pytest.mark.parametrize("seqs", [((150, 6000),), ((7, 5000), (133, 8000))], ids=["one", "two"])
def test_turn_with_cudnn_matches_reference_bf16(seqs):
    """The real path on the GPU: cuDNN's paged SDPA over the history's pages, in bf16."""
    seed, gen = _seeded()
    case = Case("gpu", {"seqs": seqs, "H": 32, "Hkv": 8, "Dh": 128, "shuffle": True})
    x = _inputs(case, torch.bfloat16, gen)
    assert not attention_turn.supported(**x)  # not built yet, and no build outside ``builds()``
    with attention_turn.builds():
        assert attention_turn.supported(**x)
    assert attention_turn.supported(**x)  # built once
    err = _rel_err(turn_attention(**x), _expected(x))
    assert err <= TOLERANCES[torch.bfloat16], f"error {err:.2e} (seed {seed})"
