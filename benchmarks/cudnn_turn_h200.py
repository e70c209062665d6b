"""The next turn's attention over a long cached history through cuDNN's paged SDPA (cudnn-frontend's graph
API), against our split-KV Triton launch, on the H200.

The sessions bench's GPU-history turn spends ~8.4 of its ~16 device ms in attention: 150 new queries over
27,339 cached keys at ~256-325 TFLOP/s a layer, where cuDNN reaches ~600 on long fresh prompts. Three forms:

- ``whole``: one call, Llama's GQA as is (32 query heads over 8 KV heads), the pages through cuDNN's block
  table, a bottom-right causal mask: everything the turn needs, no merge. Only ceil(n_q / 128) x 32 tiles.
- ``packed-sN``: the history's keys only (no mask: every new query sees all of them), cut into N runs of
  pages folded into the batch, each KV head's 4 query heads x n_q tokens packed as the rows of one head
  (MHA over the 8 KV heads: ~600 rows of 640 in 128-row tiles instead of 150 of 256), softmax stats out.
  What the turn would still need: its own keys (n_q of them, causal) and a merge of the N + 1 parts.
- ``gqa-sN``: the same runs, the query heads left as GQA.

Each form is checked against ``paged_attention_ref`` in fp32 (the parts merged in torch from their stats
for the split forms) before it is timed; the times are one call each, from a CUDA graph when cuDNN's
launch can be captured (else back-to-back eager calls between two events). The 2026-12-04 results were timed
with a graph loop of this script's own (7 replays of 16 calls, median); it now calls ``gemv_h200.graph_us``
(5 replays of 16 calls, median), as attention_pipeline_h200.py does.

    python benchmarks/cudnn_turn_h200.py --out DIR
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import time
import traceback
from pathlib import Path

import torch
from gemv_h200 import graph_us  # beside this script: the CUDA-graph timing loop

from qml_kernels import attention_turn
from qml_kernels.attention import AttentionMetadata, paged_attention_ref
from qml_kernels.attention_prefill import paged_prefill_attention_triton
from qml_kernels.attention_turn import turn_attention

H, HKV, DH, S = 32, 8, 128, 16
CASES = (("turn150-ctx27339", 150, 27339, True), ("turn150-ctx27339-inorder", 150, 27339, False),
         ("turn133-ctx8000", 133, 8000, True), ("turn219-ctx27339", 219, 27339, True),
         ("turn64-ctx27339", 64, 27339, True), ("turn400-ctx27339", 400, 27339, True),
         ("turn150-ctx60000", 150, 60000, True))
TOLERANCE = 1.6e-2


def _inputs(n_q: int, L: int, shuffle: bool, dev) -> dict:
    gen = torch.Generator(dev).manual_seed(0)
    pages = -(-L // S)
    P = pages + 8
    order = torch.randperm(P, generator=gen, device=dev).tolist() if shuffle else list(range(P))
    table = order[:pages]
    slots = [table[p // S] * S + p % S for p in range(L - n_q, L)]
    meta = AttentionMetadata.build(slots, [table], [0, n_q], [L], dev)
    k = torch.randn(P, S, HKV, DH, generator=gen, device=dev).bfloat16()
    v = torch.randn(P, S, HKV, DH, generator=gen, device=dev).bfloat16()
    q = torch.randn(n_q, H, DH, generator=gen, device=dev).bfloat16()
    return {"q": q, "k_cache": k, "v_cache": v, "meta": meta, "scale": 1.0 / math.sqrt(DH), "table": table}


def _time_us(fn) -> tuple[float, str]:
    """Median us of one call: from a CUDA graph (``gemv_h200.graph_us``, 16 calls a replay), else eager."""
    try:
        return graph_us(lambda _: fn(), 1), "graph"
    except Exception as exc:  # noqa: BLE001 - the eager form times it anyway
        print(f"  capture failed ({type(exc).__name__}: {str(exc)[:120]}); eager timing", flush=True)
        torch.cuda.synchronize()
        return _eager_us(fn), "eager"


def _eager_us(fn) -> float:
    """Median us of one call among 16 back-to-back eager calls (launch costs included when they exceed the GPU's)."""
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(16):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / 16)
    return sorted(times)[2]


class CudnnSdpa:
    """One cuDNN paged SDPA graph: q [B, Hq, Sq, D] (any strides), the K/V pools, block tables [B, 1, Pm, 1],
    per-batch lengths; o like q, stats [B, Hq, Sq, 1] fp32 when asked."""

    def __init__(self, cudnn, handle, q, k_pool, v_pool, table, causal: bool, stats: bool, scale: float):
        dt = cudnn.data_type
        g = cudnn.pygraph(io_data_type=dt.BFLOAT16, intermediate_data_type=dt.FLOAT, compute_data_type=dt.FLOAT,
                          handle=handle)
        B = q.shape[0]
        self.q_t = g.tensor(name="q", dim=list(q.shape), stride=list(q.stride()), data_type=dt.BFLOAT16)
        # the pools as cuDNN's containers [pages, H_kv, page, D], our token-major pages by their strides
        kd = [k_pool.shape[0], k_pool.shape[2], k_pool.shape[1], k_pool.shape[3]]
        ks = [k_pool.stride(0), k_pool.stride(2), k_pool.stride(1), k_pool.stride(3)]
        self.k_t = g.tensor(name="k", dim=kd, stride=ks, data_type=dt.BFLOAT16)
        self.v_t = g.tensor(name="v", dim=kd, stride=ks, data_type=dt.BFLOAT16)
        self.tk = g.tensor(name="tk", dim=list(table.shape), stride=list(table.stride()), data_type=dt.INT32)
        self.tv = g.tensor(name="tv", dim=list(table.shape), stride=list(table.stride()), data_type=dt.INT32)
        self.sq = g.tensor(name="sq", dim=[B, 1, 1, 1], stride=[1, 1, 1, 1], data_type=dt.INT32)
        self.skv = g.tensor(name="skv", dim=[B, 1, 1, 1], stride=[1, 1, 1, 1], data_type=dt.INT32)
        extra = {}
        if causal:
            extra = {"diagonal_alignment": cudnn.diagonal_alignment.BOTTOM_RIGHT, "diagonal_band_right_bound": 0}
        o, st = g.sdpa(name="sdpa", q=self.q_t, k=self.k_t, v=self.v_t, attn_scale=scale, generate_stats=stats,
                       use_padding_mask=True, seq_len_q=self.sq, seq_len_kv=self.skv,
                       paged_attention_k_table=self.tk, paged_attention_v_table=self.tv,
                       paged_attention_max_seq_len_kv=table.shape[2] * k_pool.shape[1], **extra)
        o.set_output(True).set_dim(list(q.shape)).set_stride(list(q.stride())).set_data_type(dt.BFLOAT16)
        self.o_t, self.st_t = o, st
        if stats:
            st.set_output(True).set_data_type(dt.FLOAT)
        t0 = time.perf_counter()
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        self.build_ms = (time.perf_counter() - t0) * 1e3
        self.g, self.handle, self.cudnn = g, handle, cudnn
        self.ws = torch.empty(max(g.get_workspace_size(), 1), dtype=torch.uint8, device=q.device)
        try:
            self.engine = str(g.selected_engine)
        except Exception:  # noqa: BLE001
            self.engine = "?"

    def run(self, q, k_pool, v_pool, table, sq, skv, o, stats=None):
        binds = {self.q_t: q, self.k_t: k_pool, self.v_t: v_pool, self.tk: table, self.tv: table,
                 self.sq: sq, self.skv: skv, self.o_t: o}
        if stats is not None:
            binds[self.st_t] = stats
        # cuDNN launches on its handle's stream: follow torch's (a CUDA graph captures on a side stream)
        self.cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream().cuda_stream)
        self.g.execute(binds, self.ws, handle=self.handle)


def _merge(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """[(o [T, H, D] fp32, lse [T, H] natural log)] -> the softmax over all their keys."""
    lse = torch.stack([p[1] for p in parts])  # [N, T, H]
    top = torch.logsumexp(lse, 0)
    w = torch.exp(lse - top)  # [N, T, H]
    return sum(w[i][..., None] * parts[i][0] for i in range(len(parts)))


def _own_part(x: dict, n_q: int, L: int):
    """The new tokens over their own keys (causal), in fp32 torch: o [T, H, D], lse [T, H]."""
    table = x["table"]
    keys = torch.arange(L - n_q, L, device=x["q"].device)
    slots = torch.tensor(table, device=keys.device)[keys // S] * S + keys % S
    k = x["k_cache"].reshape(-1, HKV, DH)[slots].float().repeat_interleave(H // HKV, 1)  # [n, H, D]
    v = x["v_cache"].reshape(-1, HKV, DH)[slots].float().repeat_interleave(H // HKV, 1)
    s = torch.einsum("thd,khd->htk", x["q"].float(), k) * x["scale"]
    s = s + torch.triu(torch.full((n_q, n_q), float("-inf"), device=s.device), 1)
    lse = torch.logsumexp(s, -1)  # [H, T]
    o = torch.einsum("htk,khd->thd", torch.softmax(s, -1), v)
    return o, lse.t()


def _runs(hist: int, n: int) -> list[tuple[int, int]]:
    """The history's pages cut into n runs of whole pages (the last run ends at ``hist`` keys)."""
    pages = -(-hist // S)
    cuts = [pages * i // n for i in range(n + 1)]
    return [(cuts[i] * S, min(cuts[i + 1] * S, hist)) for i in range(n) if cuts[i + 1] > cuts[i]]


def _case(name: str, n_q: int, L: int, shuffle: bool, forms: str, cudnn, handle, dev, rows: list,
          stop_at: float) -> None:
    """Check and time the forms on one case, appending a row per form to ``rows``."""
    x = _inputs(n_q, L, shuffle, dev)
    ref = paged_attention_ref(x["q"].float(), x["k_cache"].float(), x["v_cache"].float(), x["meta"],
                              x["scale"]).float()
    flops = 4 * H * DH * (n_q * (L - n_q) + n_q * (n_q + 1) // 2)
    hist = L - n_q

    def record(form, fn, check, extra=None):
        row = {"case": name, "form": form, **(extra or {})}
        try:
            got = check()
            err = ((got - ref).abs().max() / ref.abs().max()).item()
            row["rel_err"] = float(f"{err:.2e}")
            if not math.isfinite(err) or err > TOLERANCE:
                row["error"] = "differs from the reference"
            us, how = _time_us(fn)
            row.update(us=round(us, 1), tflops=round(flops / us / 1e6, 1), timing=how)
            row["eager_us"] = round(_eager_us(fn), 1)
        except Exception as exc:  # noqa: BLE001 - unsupported by cuDNN, out of memory: not a candidate
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            traceback.print_exc()
        rows.append(row)
        print(json.dumps(row), flush=True)

    out = torch.empty_like(x["q"])
    ours = {"q": x["q"], "k_cache": x["k_cache"], "v_cache": x["v_cache"], "meta": x["meta"], "scale": x["scale"],
            "out": out}
    record("ours", lambda: paged_prefill_attention_triton(**ours),
           lambda: paged_prefill_attention_triton(**ours).float())
    # the landed path (qml_kernels.attention_turn): cuDNN over the history's pages, Triton over the rest
    turn_meta = AttentionMetadata.build(x["meta"].slot_mapping.cpu(), [x["table"]], [0, n_q], [L], dev)
    turn = {**ours, "meta": turn_meta}
    with attention_turn.builds():
        ok = attention_turn.supported(**turn)
    if ok:
        t0 = time.perf_counter()
        turn_attention(**turn)
        torch.cuda.synchronize()
        first_ms = (time.perf_counter() - t0) * 1e3
        record("turn", lambda: turn_attention(**turn), lambda: turn_attention(**turn).float(),
               {"runs": next(iter(turn_meta.plans.values())).runs, "first_call_ms": round(first_ms, 1)})
    else:
        rows.append({"case": name, "form": "turn", "error": "not supported"})

    # whole: one call, GQA, bottom-right causal, o straight into the [T, H, D] layout
    table = torch.tensor(x["table"], dtype=torch.int32, device=dev).view(1, 1, -1, 1)
    qv = x["q"].unsqueeze(0).permute(0, 2, 1, 3)  # [1, H, T, D] view of [T, H, D]
    ov = out.unsqueeze(0).permute(0, 2, 1, 3)
    sq = torch.tensor([n_q], dtype=torch.int32, device=dev).view(1, 1, 1, 1)
    skv = torch.tensor([L], dtype=torch.int32, device=dev).view(1, 1, 1, 1)
    try:
        whole = CudnnSdpa(cudnn, handle, qv, x["k_cache"], x["v_cache"], table, True, False, x["scale"])
        extra = {"build_ms": round(whole.build_ms, 1), "engine": whole.engine[:80]}

        def run_whole():
            whole.run(qv, x["k_cache"], x["v_cache"], table, sq, skv, ov)

        record("whole", run_whole, lambda: (run_whole(), out.float())[1], extra)
    except Exception as exc:  # noqa: BLE001
        rows.append({"case": name, "form": "whole", "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
        traceback.print_exc()
        print(json.dumps(rows[-1]), flush=True)

    own = _own_part(x, n_q, L)
    G = H // HKV
    for n_runs in (1, 2, 3, 4, 6, 8) if forms == "all" else ():
        if time.perf_counter() > stop_at:
            break
        runs = _runs(hist, n_runs)
        N = len(runs)
        width = max(-(-(b - a) // S) for a, b in runs)
        tab = torch.zeros(N, 1, width, 1, dtype=torch.int32, device=dev)
        for i, (a, b) in enumerate(runs):
            pages = x["table"][a // S: -(-b // S)]
            tab[i, 0, : len(pages), 0] = torch.tensor(pages, dtype=torch.int32)
        skv_n = torch.tensor([b - a for a, b in runs], dtype=torch.int32, device=dev).view(N, 1, 1, 1)
        for form in ("packed", "gqa"):
            if form == "packed":
                # rows of KV head h: its G query heads' n_q tokens, token-major ([T, Hkv, G, D] -> [Hkv, T*G, D])
                rows_q = G * n_q
                qp = x["q"].view(n_q, HKV, G, DH).permute(1, 0, 2, 3).reshape(HKV, rows_q, DH)
                qb = qp.unsqueeze(0).expand(N, HKV, rows_q, DH).contiguous()
            else:
                rows_q = n_q
                qb = x["q"].permute(1, 0, 2).unsqueeze(0).expand(N, H, n_q, DH).contiguous()
            ob = torch.empty_like(qb)
            hq = qb.shape[1]
            st = torch.empty(N, hq, rows_q, 1, dtype=torch.float32, device=dev)
            sq_n = torch.full((N, 1, 1, 1), rows_q, dtype=torch.int32, device=dev)
            try:
                graph = CudnnSdpa(cudnn, handle, qb, x["k_cache"], x["v_cache"], tab, False, True, x["scale"])
            except Exception as exc:  # noqa: BLE001
                rows.append({"case": name, "form": f"{form}-s{N}", "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
                traceback.print_exc()
                print(json.dumps(rows[-1]), flush=True)
                continue

            def run_split(graph=graph, qb=qb, ob=ob, st=st, sq_n=sq_n, skv_n=skv_n, tab=tab):
                graph.run(qb, x["k_cache"], x["v_cache"], tab, sq_n, skv_n, ob, st)

            def check(form=form, ob=ob, st=st, N=N, run_split=run_split):
                run_split()
                parts = []
                for i in range(N):
                    if form == "packed":
                        o = ob[i].float().view(HKV, n_q, G, DH).permute(1, 0, 2, 3).reshape(n_q, H, DH)
                        lse = st[i, :, :, 0].view(HKV, n_q, G).permute(1, 0, 2).reshape(n_q, H)
                    else:
                        o = ob[i].float().permute(1, 0, 2)
                        lse = st[i, :, :, 0].t()
                    parts.append((o, lse))
                return _merge(parts + [own])

            record(f"{form}-s{N}", run_split, check,
                   {"build_ms": round(graph.build_ms, 1), "engine": graph.engine[:80], "history_only": True})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--kv-heads", type=int, default=8, help="8: Llama-3.1-8B's heads; 4: Qwen3-30B-A3B's")
    parser.add_argument("--forms", default="all", help="'all', or 'path': ours, whole and the landed path only")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    global HKV
    HKV = args.kv_heads
    dev = torch.device("cuda")
    import cudnn  # the GPU side only

    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    meta_out = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
                "torch": torch.__version__, "cudnn_backend": cudnn.backend_version(),
                "cudnn_frontend": getattr(cudnn, "__version__", "?"),
                "command": "python benchmarks/cudnn_turn_h200.py --out DIR " + " ".join(
                    f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
                "heads": {"q": H, "kv": args.kv_heads, "dim": DH}}
    import triton
    meta_out["triton"] = triton.__version__
    print(json.dumps(meta_out), flush=True)
    rows = []
    stop_at = time.perf_counter() + args.seconds
    for name, n_q, L, shuffle in CASES:
        if time.perf_counter() > stop_at:
            break
        _case(name, n_q, L, shuffle, args.forms, cudnn, handle, dev, rows, stop_at)
        torch.cuda.empty_cache()
    (args.out / f"cudnn-turn-h200-kv{HKV}.json").write_text(json.dumps({**meta_out, "rows": rows}, indent=1))
    print("\ncase                       form          us   TFLOP/s  eager us  err")
    for r in rows:
        print(f"{r['case']:26s} {r['form']:10s} {r.get('us', float('nan')):8.1f} {r.get('tflops', float('nan')):8.1f}"
              f" {r.get('eager_us', float('nan')):8.1f}"
              f"  {r.get('rel_err', '')} {r.get('error', '')[:60]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
