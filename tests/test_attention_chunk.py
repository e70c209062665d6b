"""Long prefill chunks through cuDNN's paged SDPA (qml_kernels.attention_chunk).

Without a GPU the launch runs on ``ChunkReference``, which reads the launch's own buffers (block table widened to
the graph's bound, lengths, row offsets in elements of q's and out's token strides) the way cuDNN is documented to:
so what is tested here is ours, the filling of those buffers, against paged_attention_ref, on shuffled pages whose
unused slots hold NaN, with q a view into the fused QKV projection and out followed by guard rows. On a GPU with
cudnn-frontend the same cases run through cuDNN, and the dispatcher's choice is checked.
"""

from __future__ import annotations

import pytest
import torch

from qml_kernels import attention_chunk, registry
from qml_kernels.attention import paged_attention, paged_attention_ref
from qml_kernels.attention_chunk import ChunkReference, chunk_attention, launch_shapes, row_bound, serves
from qml_kernels.attention_prefill import PAGED_PREFILL_ATTENTION_SPEC
from qml_kernels.workbench.spec import Case

CASES = (
    Case("one-chunk-over-history", {"seqs": ((40, 173),), "H": 8, "Hkv": 2, "Dh": 64, "shuffle": True,
                                    "fused_q": True},
         edge="a chunk over a history ending mid-page, q inside the QKV projection's rows"),
    Case("ragged-with-fresh", {"seqs": ((33, 100), (57, 57), (20, 301)), "H": 4, "Hkv": 1, "Dh": 32,
                               "shuffle": True},
         edge="three sequences, one fresh: each one's rows found by its offset"),
    Case("group8-pages32", {"seqs": ((64, 64), (9, 400)), "H": 8, "Hkv": 1, "Dh": 64, "S": 32, "shuffle": True,
                            "fused_q": True}, edge="group 8, pages of 32"),
)


def _inputs(case: Case, dtype, device):
    gen = torch.Generator(device).manual_seed(0)
    x = PAGED_PREFILL_ATTENTION_SPEC.make_inputs(case, dtype, device, gen)
    return {k: x[k] for k in ("q", "k_cache", "v_cache", "meta", "scale")}


def _expected(x: dict) -> torch.Tensor:
    return paged_attention_ref(**{k: v.float() if isinstance(v, torch.Tensor) else v for k, v in x.items()})


def _guarded_out(x: dict) -> tuple[torch.Tensor, torch.Tensor]:
    T, H, D = x["q"].shape
    guard = torch.full((T + 8, H, D), 7.0, dtype=x["q"].dtype, device=x["q"].device)
    return guard, guard[:T]


def test_row_bounds_are_powers_of_two_and_tables_as_wide_as_the_pool():
    assert [row_bound(n) for n in (1, 512, 513, 1024, 1025, 6784, 27648)] == [1024] * 4 + [2048, 8192, 32768]
    x = _inputs(CASES[1], torch.float16, torch.device("cpu"))
    pages = x["k_cache"].shape[0]
    assert launch_shapes(x["q"], x["k_cache"], x["meta"]) == [(1, 1024, pages)] * 3  # one launch a sequence
    assert launch_shapes(x["q"], x["k_cache"], x["meta"], together=True) == [(3, 1024, pages)]
    long = Case("long", {"seqs": ((600, 900), (512, 512), (1100, 1100)), "H": 4, "Hkv": 2, "Dh": 64})
    y = _inputs(long, torch.float16, torch.device("cpu"))
    pages = y["k_cache"].shape[0]
    assert launch_shapes(y["q"], y["k_cache"], y["meta"]) == [(1, 1024, pages), (1, 1024, pages), (1, 2048, pages)]


@pytest.mark.parametrize("together", [False, True], ids=["a-launch-a-sequence", "one-launch"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_reference_launch_matches_paged_attention(case, together):
    x = _inputs(case, torch.float32, torch.device("cpu"))
    guard, out = _guarded_out(x)
    chunk_attention(**x, out=out, together=together, executor=ChunkReference())
    torch.testing.assert_close(out, _expected(x), atol=2e-5, rtol=2e-5)
    assert (guard[out.shape[0]:] == 7.0).all(), "rows after the step's were written"


def test_sequences_of_one_bound_share_its_graph_each_with_its_own_operands():
    x = _inputs(CASES[1], torch.float32, torch.device("cpu"))  # three sequences, one row bound (1,024)

    class OneGraph(ChunkReference):
        built = []

        def graph_for(self, q, k_cache, shape):
            if not self.built:
                self.built.append(super().graph_for(q, k_cache, shape))
            return self.built[0]

    executor = OneGraph()
    out = chunk_attention(**x, executor=executor)
    (launches, _), = x["meta"].plans.values()
    assert len(launches) == 3 and len({id(ops) for _, ops, _ in launches}) == 3
    assert launches[0][1] is executor.built[0]
    torch.testing.assert_close(out, _expected(x), atol=2e-5, rtol=2e-5)


def test_only_the_slots_past_each_sequence_on_its_last_page_are_zeroed():
    x = _inputs(CASES[2], torch.float32, torch.device("cpu"))
    before = [c.clone() for c in (x["k_cache"], x["v_cache"])]
    chunk_attention(**x, executor=ChunkReference())
    S = x["k_cache"].shape[1]
    tails = torch.zeros(x["k_cache"].shape[:2], dtype=torch.bool)
    for table, L in zip(x["meta"].block_tables.tolist(), x["meta"].context_lens_host):
        if L % S:
            tails[table[(L - 1) // S], L % S:] = True
    assert tails.any()
    for old, new in zip(before, (x["k_cache"], x["v_cache"])):
        assert (new[tails] == 0).all()
        torch.testing.assert_close(new[~tails], old[~tails], equal_nan=True)  # the page nobody owns stays NaN


def test_a_step_fills_its_buffers_once_over_what_an_earlier_step_left_there():
    x = _inputs(CASES[1], torch.float32, torch.device("cpu"))
    # the page no sequence owns (all NaN): what a stale column of an earlier, wider step may point to
    owned = {p for row in x["meta"].block_tables.tolist() for p in row}
    stale = next(p for p in range(x["k_cache"].shape[0]) if p not in owned)

    class Stale(ChunkReference):
        def graph_for(self, *args, **kwargs):
            g = super().graph_for(*args, **kwargs)
            g.table.fill_(stale)
            g.seq_q.fill_(9999)
            g.q_offsets.fill_(-1)
            return g

    executor = Stale()
    out = chunk_attention(**x, executor=executor)
    chunk_attention(**x, out=out, executor=executor)  # the next layer: the step's buffers as they are
    assert len(x["meta"].plans) == 1
    torch.testing.assert_close(out, _expected(x), atol=2e-5, rtol=2e-5)


def test_serves_only_long_chunks_without_window_sinks_or_softcap():
    base = Case("long", {"seqs": ((512, 700), (600, 600)), "H": 4, "Hkv": 2, "Dh": 64, "fused_q": True})
    x = _inputs(base, torch.float16, torch.device("cpu"))
    args = (x["q"], x["k_cache"], x["v_cache"], x["meta"])
    assert serves(*args)
    assert not serves(*args, sliding_window=128)
    assert not serves(*args, sinks=torch.zeros(4))
    assert not serves(*args, softcap=30.0)
    short = Case("short", {"seqs": ((511, 700), (600, 600)), "H": 4, "Hkv": 2, "Dh": 64})
    y = _inputs(short, torch.float16, torch.device("cpu"))
    assert not serves(y["q"], y["k_cache"], y["v_cache"], y["meta"]), "a sequence below MIN_QUERIES"
    z = _inputs(base, torch.float32, torch.device("cpu"))
    assert not serves(z["q"], z["k_cache"], z["v_cache"], z["meta"]), "fp32"
    wide = Case("d256", {"seqs": ((512, 700),), "H": 4, "Hkv": 2, "Dh": 256})
    w = _inputs(wide, torch.float16, torch.device("cpu"))
    assert not serves(w["q"], w["k_cache"], w["v_cache"], w["meta"]), "head dim 256"
    T = x["q"].shape[0]
    odd = torch.zeros(T, 4 * 64 + 4, dtype=torch.float16)[:, :4 * 64].view(T, 4, 64)  # a token stride of 260
    assert not serves(odd, *args[1:]), "a sequence's rows not 16-byte aligned"
    assert not attention_chunk.supported(*args, x["scale"]), "CPU tensors"


gpu = pytest.mark.skipif(not torch.cuda.is_available() or attention_chunk._cudnn() is None,
                         reason="needs a GPU with cudnn-frontend")


@gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_cudnn_matches_paged_attention_bf16(case):
    x = _inputs(case, torch.bfloat16, torch.device("cuda"))
    guard, out = _guarded_out(x)
    chunk_attention(**x, out=out)
    err = ((out.float() - _expected(x)).abs().max() / _expected(x).abs().max()).item()
    assert err < 1.6e-2
    assert (guard[out.shape[0]:] == 7.0).all(), "rows after the step's were written"


@gpu
def test_dispatch_sends_long_chunks_here_and_long_fresh_prompts_to_attention_cudnn():
    chunk = _inputs(Case("c", {"seqs": ((600, 5000),), "H": 32, "Hkv": 8, "Dh": 128, "fused_q": True}),
                    torch.bfloat16, torch.device("cuda"))
    assert registry.select("paged_attention", *chunk.values()).name == "cudnn_chunk"
    expected = _expected(chunk)
    err = ((paged_attention(*chunk.values()).float() - expected).abs().max() / expected.abs().max()).item()
    assert err < 1.6e-2
    fresh = _inputs(Case("f", {"seqs": ((4200, 4200),), "H": 32, "Hkv": 8, "Dh": 128}), torch.bfloat16,
                    torch.device("cuda"))
    assert registry.select("paged_attention", *fresh.values()).name == "cudnn"
    short = _inputs(Case("s", {"seqs": ((300, 900),), "H": 32, "Hkv": 8, "Dh": 128}), torch.bfloat16,
                    torch.device("cuda"))
    assert registry.select("paged_attention", *short.values()).name == "triton"
