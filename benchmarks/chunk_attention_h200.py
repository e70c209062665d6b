"""A prefill chunk's attention over a cached history, by the path the dispatcher takes, against cuDNN's fresh one.

A chunk of n > 512 queries over a history of cached keys is neither a fresh prompt (cuDNN, ``attention_cudnn``)
nor a turn (``attention_turn``, up to 512 queries): it runs Triton's paged prefill kernel. The restore planner
prices recomputing such a chunk from the fresh-prefill curve (cuDNN), and a cut load's blocks, computed as one
6.8k-token chunk after a 21.5k-token head, took far longer than that (sessions-h100-2026-12-06b.md). One layer of
Llama-3.1-8B's heads (32 q / 8 kv, Dh 128, bf16, pages of 16): for each (history, chunk) the time of
``paged_attention`` as dispatched (and which implementation it picked), and of cuDNN's fresh causal attention over
history + chunk tokens (what the curve's difference fresh(h + n) - fresh(h) stands for, in attention).
Beside them, candidate chunk paths over the history gathered from its pages (the gather is timed with them), each
checked against the dispatched output: ``flash`` (torch's FlashAttention-2 op, whose causal mask is lower-right
when there are fewer queries than keys), ``cudnn2`` (cuDNN over the history without a mask and over the chunk
causally, the two merged by their log-sum-exps), ``cudnn_mask`` (cuDNN with a lower-right boolean mask), and
cuDNN's paged SDPA through cudnn-frontend (our pages read in place, causal aligned bottom-right, GQA as is; built
before it is timed): ``cudnn_paged`` at the exact query count and pages, ``cudnn_paged_bucket`` at queries rounded up
to 256 and pages to 64 with the real lengths given (whether bottom-right alignment follows them).

    python benchmarks/chunk_attention_h200.py --out DIR [--histories 0,4096,21504] [--chunks 512,2048,6784]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
from pathlib import Path

import torch

from qml_kernels import registry
from qml_kernels.attention import AttentionMetadata, paged_attention
from qml_kernels.attention_cudnn import _sdpa
from moe_h200 import time_layer  # beside this script

H, HKV, D, PAGE = 32, 8, 128, 16
REPS = 5


def _gather(cache: torch.Tensor, meta: AttentionMetadata, total: int) -> torch.Tensor:
    """The sequence's keys (or values) as one run [1, Hkv, total, Dh], gathered through its block table."""
    pages = -(-total // PAGE)
    run = torch.index_select(cache, 0, meta.block_tables[0, :pages].long())
    return run.view(-1, HKV, D)[:total].transpose(0, 1).unsqueeze(0)


def flash_chunk(q, k_cache, v_cache, meta, total, scale):
    k, v = _gather(k_cache, meta, total), _gather(v_cache, meta, total)
    qb = q.transpose(0, 1).unsqueeze(0)
    o = torch.ops.aten._scaled_dot_product_flash_attention(qb, k, v, 0.0, is_causal=True, scale=scale)[0]
    return o[0].transpose(0, 1)


def _cudnn(q, k, v, causal, scale):
    o, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False,
                                                                 scale=scale)[:2]
    return o, lse.reshape(q.shape[0], q.shape[1], q.shape[2])


def cudnn2_chunk(q, k_cache, v_cache, meta, total, scale):
    n = q.shape[0]
    h = total - n
    k, v = _gather(k_cache, meta, total), _gather(v_cache, meta, total)
    qb = q.transpose(0, 1).unsqueeze(0)
    o2, l2 = _cudnn(qb, k[:, :, h:], v[:, :, h:], True, scale)
    if h == 0:
        return o2[0].transpose(0, 1)
    o1, l1 = _cudnn(qb, k[:, :, :h], v[:, :, :h], False, scale)
    lse = torch.logaddexp(l1, l2)
    o = o1 * torch.exp(l1 - lse).unsqueeze(-1) + o2 * torch.exp(l2 - lse).unsqueeze(-1)
    return o[0].transpose(0, 1).to(q.dtype)


def cudnn_mask_chunk(q, k_cache, v_cache, meta, total, scale):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    n = q.shape[0]
    k, v = _gather(k_cache, meta, total), _gather(v_cache, meta, total)
    mask = torch.ones(n, total, dtype=torch.bool, device=q.device).tril(total - n)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        o = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k, v, attn_mask=mask,
                                                             scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


class PagedChunk:
    """cuDNN paged SDPA for one sequence's chunk: rows [R, H, D] (the first n real), pages through the table."""

    def __init__(self, q, k_cache, meta, total, scale, rows, max_pages):
        import cudnn

        dt = cudnn.data_type
        io = dt.BFLOAT16
        self.q = torch.zeros(rows, H, D, device=q.device, dtype=q.dtype)
        self.o = torch.zeros_like(self.q)
        n = q.shape[0]
        self.table = torch.zeros(1, 1, max_pages, 1, dtype=torch.int32, device=q.device)
        pages = -(-total // PAGE)
        self.table[0, 0, :pages, 0] = meta.block_tables[0, :pages]
        self.seq_q = torch.full((1, 1, 1, 1), n, dtype=torch.int32, device=q.device)
        self.seq_kv = torch.full((1, 1, 1, 1), total, dtype=torch.int32, device=q.device)
        self.handle = cudnn.create_handle()
        g = cudnn.pygraph(io_data_type=io, intermediate_data_type=dt.FLOAT, compute_data_type=dt.FLOAT,
                          handle=self.handle)
        qdim, qstride = [1, H, rows, D], [rows * H * D, D, H * D, 1]
        t = {"q": g.tensor(name="q", dim=qdim, stride=qstride, data_type=io)}
        P, S = k_cache.shape[:2]
        st = k_cache.stride()
        for name in ("k", "v"):
            t[name] = g.tensor(name=name, dim=[P, HKV, S, D], stride=[st[0], st[2], st[1], st[3]], data_type=io)
        for name, buf in (("table", self.table), ("seq_q", self.seq_q), ("seq_kv", self.seq_kv)):
            t[name] = g.tensor(name=name, dim=list(buf.shape), stride=list(buf.stride()), data_type=dt.INT32)
        o, _ = g.sdpa(name="chunk", q=t["q"], k=t["k"], v=t["v"], attn_scale=scale, generate_stats=False,
                      diagonal_band_right_bound=0, diagonal_alignment=cudnn.diagonal_alignment.BOTTOM_RIGHT,
                      use_padding_mask=True, seq_len_q=t["seq_q"], seq_len_kv=t["seq_kv"],
                      paged_attention_k_table=t["table"], paged_attention_v_table=t["table"],
                      paged_attention_max_seq_len_kv=max_pages * PAGE)
        o.set_output(True).set_dim(qdim).set_stride(qstride).set_data_type(io)
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        self.g, self.t, self.out, self.cudnn = g, t, o, cudnn
        self.ws = torch.empty(max(g.get_workspace_size(), 1), dtype=torch.uint8, device=q.device)

    def __call__(self, q, k_cache, v_cache):
        n = q.shape[0]
        self.q[:n].copy_(q)
        t = self.t
        self.cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream().cuda_stream)
        self.g.execute({t["q"]: self.q, t["k"]: k_cache, t["v"]: v_cache, t["table"]: self.table,
                        t["seq_q"]: self.seq_q, t["seq_kv"]: self.seq_kv, self.out: self.o}, self.ws,
                       handle=self.handle)
        return self.o[:n]


_PAGED = {}


def _paged(bucket):
    def run(q, k_cache, v_cache, meta, total, scale):
        n, pages = q.shape[0], -(-total // PAGE)
        rows, max_pages = (-(-n // 256) * 256, -(-pages // 64) * 64) if bucket else (n, pages)
        key = (bucket, n, total)
        if key not in _PAGED:
            _PAGED[key] = PagedChunk(q, k_cache, meta, total, scale, rows, max_pages)
        return _PAGED[key](q, k_cache, v_cache)
    return run


CANDIDATES = {"cudnn_paged": _paged(False), "cudnn_paged_bucket": _paged(True), "flash": flash_chunk,
              "cudnn2": cudnn2_chunk, "cudnn_mask": cudnn_mask_chunk}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--histories", default="0,4096,21504")
    ap.add_argument("--chunks", default="512,2048,6784")
    args = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for h in map(int, args.histories.split(",")):
        for n in map(int, args.chunks.split(",")):
            total = h + n
            pages = -(-total // PAGE)
            k_cache = torch.randn(pages, PAGE, HKV, D, device=dev, dtype=torch.bfloat16, generator=gen)
            v_cache = torch.randn(pages, PAGE, HKV, D, device=dev, dtype=torch.bfloat16, generator=gen)
            q = torch.randn(n, H, D, device=dev, dtype=torch.bfloat16, generator=gen)
            meta = AttentionMetadata.build(list(range(h, total)), [list(range(pages))], [0, n], [total], dev)
            scale = D ** -0.5
            picked = registry.select("paged_attention", q, k_cache, v_cache, meta, scale).name
            dispatched = time_layer(lambda: paged_attention(q, k_cache, v_cache, meta, scale), dev, REPS)
            with registry.using(paged_attention="triton"):
                triton_ms = time_layer(lambda: paged_attention(q, k_cache, v_cache, meta, scale), dev, REPS)
            qf = torch.randn(1, H, total, D, device=dev, dtype=torch.bfloat16, generator=gen)
            kf = torch.randn(1, HKV, total, D, device=dev, dtype=torch.bfloat16, generator=gen)
            fresh_total = time_layer(lambda: _sdpa(qf, kf, kf, scale), dev, REPS)
            fresh_h = (time_layer(lambda: _sdpa(qf[:, :, :h], kf[:, :, :h], kf[:, :, :h], scale), dev, REPS)
                       if h >= 16 else 0.0)
            row = {"history": h, "chunk": n, "picked": picked, "dispatched_ms": dispatched, "triton_ms": triton_ms,
                   "cudnn_fresh_total_ms": fresh_total, "cudnn_fresh_history_ms": fresh_h,
                   "cudnn_difference_ms": fresh_total - fresh_h}
            print(f"history {h:6d} chunk {n:5d}: {picked:>10} {dispatched:7.3f} ms (triton {triton_ms:7.3f}); cuDNN "
                  f"fresh {total} - {h}: {fresh_total:.3f} - {fresh_h:.3f} = {fresh_total - fresh_h:.3f} ms",
                  flush=True)
            expected = paged_attention(q, k_cache, v_cache, meta, scale).float()
            for name, fn in CANDIDATES.items():
                try:
                    err = (fn(q, k_cache, v_cache, meta, total, scale).float() - expected).abs().max().item()
                    ms = time_layer(lambda: fn(q, k_cache, v_cache, meta, total, scale), dev, REPS)
                    row[name] = {"ms": ms, "max_abs_err": err}
                    print(f"    {name:>10}: {ms:7.3f} ms, max |err| {err:.2e}", flush=True)
                except Exception as e:  # a backend that rejects the shapes is an answer too
                    row[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                    print(f"    {name:>10}: {row[name]['error']}", flush=True)
            rows.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"chunk-attention-{datetime.date.today()}.json"
    out.write_text(json.dumps({"date": str(datetime.datetime.now()), "gpu": torch.cuda.get_device_name(),
                               "torch": torch.__version__, "host": platform.node(), "heads": [H, HKV, D],
                               "page": PAGE, "rows": rows}, indent=1))
    print("wrote", out)


if __name__ == "__main__":
    main()
