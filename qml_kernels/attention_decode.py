"""Paged decode attention with the keys split across programs (flash-decoding).

A decode step brings one query token per sequence: q ``[B, H, Dh]`` (row b belongs to
sequence b) attends to that sequence's ``L = context_lens[b]`` cached tokens, paged as in
``qml_kernels.attention`` (``k_cache, v_cache: [P, S, Hkv, Dh]``, ``block_tables [B, pages]``).
The query sits at position L - 1 and sees every cached key, or with a sliding window W
the last W of them. Sinks, softcap and scale follow ``paged_attention_ref``, the reference.

Why two stages: with one query row per sequence there is too little work per sequence for
one program per (sequence, head) to fill 132 SMs at small batch and long context. Stage 1
runs programs ``(b, kv head, split)``: each stacks the ``group = H / Hkv`` query heads of
one KV head into the rows of one tile (padded to 16 rows, the smallest tensor-core tile),
so every K/V element is read from HBM once per KV head, and walks its share of the keys
with an online softmax in fp32. It writes a normalized partial output and its log-sum-exp
(base 2) to an fp32 workspace ``[B, H, splits, Dh]`` + ``[B, H, splits]``. Stage 2 merges the
splits of one (sequence, head) by their log-sum-exps and adds the sink to the denominator
once. With one split, stage 1 writes the output itself and stage 2 is not launched.

Traffic: the visible K/V, ``2 * Hkv * Dh * sum_b min(L_b, W)`` elements, dominates; q, out,
the block tables and the workspace (``B * H * splits * (Dh + 1)`` fp32, written and read
once) are small. FLOPs: ``4 * H * Dh`` per visible key (q.k and p.v): at one query row per
KV-head group the kernel is memory-bound by far.

Sources: Dao et al., "Flash-Decoding for long-context inference" (2023); the split/merge
scheme of vLLM's and SGLang's Triton decode kernels and FlashInfer's ``merge_state``; the
sink fold of gpt-oss (denominator += exp(sink - max)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from qml_kernels import pdl
from qml_kernels.attention import AttentionMetadata, paged_attention_ref
from qml_kernels.registry import dispatch, register
from qml_kernels.workbench.spec import Case, OpSpec, register_spec

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_LOG2E = 1.4426950408889634
H200_SMS = 132


@dataclass(frozen=True)
class PagedDecodeAttentionConfig:
    """Launch tunables. ``block_n=None`` takes 128 keys per step up to head dim 128 and 32 above
    (the fastest on the H200: benchmarks/results/sweep-h200-paged_decode_attention-2026-11-30.md);
    ``num_splits=None`` chooses the split count per batch (``decode_num_splits``)."""

    block_n: int | None = None
    num_warps: int = 4
    num_stages: int = 3
    num_splits: int | None = None
    # split choice: enough programs for ~2 per SM, up to one per min_keys_per_split keys (one key step)
    target_programs: int = 2 * H200_SMS
    min_keys_per_split: int = 128
    max_splits: int = 32

    def __post_init__(self):
        if self.block_n is not None and (self.block_n < 16 or self.block_n & (self.block_n - 1)):
            raise ValueError(f"block_n must be a power of 2 >= 16 (a tl.dot dimension), got {self.block_n}")
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {self.num_splits}")
        if self.max_splits < 1 or self.min_keys_per_split < 1 or self.target_programs < 1:
            raise ValueError("max_splits, min_keys_per_split and target_programs must be >= 1")

    def keys_per_step(self, head_dim: int) -> int:
        return self.block_n or (128 if head_dim <= 128 else 32)


def decode_num_splits(batch: int, kv_heads: int, max_keys: int, config: PagedDecodeAttentionConfig) -> int:
    """Splits per (sequence, KV head) from host values only: enough programs to fill the GPU, up to
    one per ``min_keys_per_split`` of the longest sequence's visible keys, the last one partial.

    Rounded up, not down: the kernel deals whole key steps to the splits, so 386 keys (four 128-key steps)
    in 3 splits left one empty and two with two steps (as slow as 2 splits). On the H200, batch 1 under
    PDL with L2 scrubbed (attention-splits-h200-2026-12-03.md), Qwen3-30B-A3B heads: 130 keys 7.54 us in
    1 split, 5.84 in 2; 386 keys 8.83 in 3, 6.50 in 4; Llama-3.1-8B heads alike."""
    if config.num_splits is not None:
        return config.num_splits
    for_occupancy = -(-config.target_programs // max(1, batch * kv_heads))
    for_length = max(1, -(-max_keys // config.min_keys_per_split))
    return max(1, min(for_occupancy, for_length, config.max_splits))


@triton.jit
def _key_steps(L, window, HAS_WINDOW: tl.constexpr, BLOCK_N: tl.constexpr):
    """A sequence of ``L`` cached keys: its first visible position ``lo``, the start ``first`` of its first
    key step and the number of steps. Steps sit on a BLOCK_N grid of absolute positions, so only the first
    step of a window and the last one are partial; every step still holds a visible key, so no row max is
    -inf. Stage 1 deals these steps to its splits; the merge reads the splits they reach."""
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(L - window, 0)
    first = (lo // BLOCK_N) * BLOCK_N
    return lo, first, tl.cdiv(L - first, BLOCK_N)


@triton.jit
def _paged_decode_attention_kernel(
    q_ptr, k_ptr, v_ptr, block_tables_ptr, context_lens_ptr, sinks_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    H, num_splits, window, qk_scale, cap_scale,
    stride_q_t, stride_q_h, stride_k_p, stride_k_s, stride_k_h, stride_v_p, stride_v_s, stride_v_h,
    stride_bt, stride_o_t, stride_o_h,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, DIRECT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    pdl.enter(PDL)  # the newest key/value row is the kernel before's (rope_kv_write)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    L = tl.load(context_lens_ptr + b)
    lo, first, n_steps = _key_steps(L, window, HAS_WINDOW, BLOCK_N)
    if not DIRECT:
        # a split past this sequence's key steps has nothing to do and stores nothing: the merge reads
        # only the first min(num_splits, n_steps). A CUDA graph captures the split
        # count of its longest context; at a short one most of its programs end here
        if split >= n_steps:
            return
    per_split = tl.cdiv(n_steps, num_splits)
    step_lo = split * per_split
    step_hi = tl.minimum(step_lo + per_split, n_steps)

    rows = tl.arange(0, BLOCK_G)  # [BLOCK_G] query heads of this KV head, padded to a tensor-core tile
    heads = kvh * GROUP + rows
    row_ok = rows < GROUP
    d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    d_ok = d < HEAD_DIM
    b64 = b.to(tl.int64)
    q = tl.load(q_ptr + b64 * stride_q_t + heads[:, None] * stride_q_h + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)  # running max of the base-2 logits
    l = tl.zeros([BLOCK_G], tl.float32)  # running sum of 2^(logit - m)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + b64 * stride_bt
    for step in range(step_lo, step_hi):
        tok = first + step * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        valid = (tok >= lo) & (tok < L)
        # page ids are int64 before the multiply: page * stride passes 2^31 in caches over 4 GiB
        page = tl.load(bt_row + tok // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
        in_page = tok % PAGE_SIZE
        kv_mask = valid[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + (page * stride_k_p + in_page * stride_k_s + kvh * stride_k_h)[:, None] + d[None, :],
                    mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_ptr + (page * stride_v_p + in_page * stride_v_s + kvh * stride_v_h)[:, None] + d[None, :],
                    mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_G, BLOCK_N]
        if HAS_SOFTCAP:
            # c * tanh(x / c) with tanh from exp: saturates cleanly to +-1 when exp overflows
            t = s * qk_scale
            s = cap_scale * (1.0 - 2.0 / (tl.exp(2.0 * t) + 1.0))
        else:
            s = s * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])  # [BLOCK_G, BLOCK_N]
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new

    # l >= 1 once a key is seen (the max term is 2^0) and 0 when none was: flooring it at 1
    # turns an empty range into o = 0 and lse = -inf (weight 0 in stage 2) without 0 / 0
    if DIRECT:
        if HAS_SINKS:
            # the sink is a logit with no value: it only adds to the denominator
            sink = tl.load(sinks_ptr + heads, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
            l += tl.exp2(sink - m)
        o = acc / tl.maximum(l, 1.0)[:, None]
        tl.store(out_ptr + b64 * stride_o_t + heads[:, None] * stride_o_h + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        l = tl.maximum(l, 1.0)
        part = (b64 * H + heads) * num_splits + split  # [BLOCK_G]
        tl.store(part_lse_ptr + part, m + tl.log2(l), mask=row_ok)
        o = acc / l[:, None]
        tl.store(part_o_ptr + part[:, None] * HEAD_DIM + d[None, :], o, mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _paged_decode_attention_merge_kernel(
    part_o_ptr, part_lse_ptr, sinks_ptr, out_ptr, context_lens_ptr,
    H, num_splits, window, stride_o_t, stride_o_h,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SPLITS: tl.constexpr, HAS_SINKS: tl.constexpr,
    ACTIVE_FROM_LENS: tl.constexpr, HAS_WINDOW: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):
    # ACTIVE_FROM_LENS: decode's stage 1 stores only the splits a sequence's key steps reach
    # (``_key_steps`` of its context length); off, every split was stored (the prefill's split-KV
    # launch, whose workspace has this layout with one row per query token; context_lens_ptr unread)
    pdl.enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    sp = tl.arange(0, BLOCK_SPLITS)  # [BLOCK_SPLITS]
    d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    part = (b * H + h) * num_splits + sp
    active = num_splits
    if ACTIVE_FROM_LENS:
        _, _, n_steps = _key_steps(tl.load(context_lens_ptr + b), window, HAS_WINDOW, BLOCK_N)
        active = tl.minimum(n_steps, num_splits)
    lse = tl.load(part_lse_ptr + part, mask=sp < active, other=float("-inf"))
    used = lse > float("-inf")
    top = tl.max(lse, axis=0)
    top = tl.where(top > float("-inf"), top, 0.0)  # no keys at all (L = 0): keeps the weights 0, not NaN
    w = tl.exp2(lse - top)  # [BLOCK_SPLITS]
    # skip reading empty splits: they hold o = 0 and weigh 0
    o = tl.load(part_o_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=used[:, None] & (d[None, :] < HEAD_DIM),
                other=0.0)  # [BLOCK_SPLITS, BLOCK_D]
    num = tl.sum(w[:, None] * o, axis=0)  # [BLOCK_D]
    den = tl.sum(w, axis=0)
    if HAS_SINKS:
        den += tl.exp2(tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634 - top)
    # den >= 1 when a split saw keys (the top one weighs 2^0); with no keys num = 0 and the
    # floor keeps 0 / 0 out
    res = num / tl.maximum(den, 1.0)
    tl.store(out_ptr + b * stride_o_t + h * stride_o_h + d, res.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def _check_decode_batch(q, k_cache, v_cache, meta: AttentionMetadata, sinks, out) -> None:
    assert q.dim() == 3, f"q must be [T, H, Dh], got shape {tuple(q.shape)}"
    T, H, Dh = q.shape
    assert k_cache.dim() == 4, f"k_cache must be [P, S, Hkv, Dh], got shape {tuple(k_cache.shape)}"
    assert v_cache.shape == k_cache.shape, f"v_cache {tuple(v_cache.shape)} != k_cache {tuple(k_cache.shape)}"
    Hkv = k_cache.shape[2]
    assert k_cache.shape[3] == Dh, f"cache head dim {k_cache.shape[3]} != q head dim {Dh}"
    assert Hkv > 0 and H % Hkv == 0, f"H = {H} must be a multiple of Hkv = {Hkv}"
    assert q.dtype in _FLOAT_DTYPES, f"q must be fp32/fp16/bf16, got {q.dtype}"
    assert k_cache.dtype == v_cache.dtype == q.dtype, f"caches {k_cache.dtype}/{v_cache.dtype} != q {q.dtype}"
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        assert t.stride(-1) == 1, f"{name}: the last dimension must be contiguous, strides {t.stride()}"
    B = meta.num_seqs
    assert meta.is_decode and T == B and meta.cu_seqlens_q_host[-1] == T, \
        f"a decode batch has exactly one query row per sequence: T = {T}, {B} sequences, " \
        f"cu_seqlens_q ends at {meta.cu_seqlens_q_host[-1]}"
    bt, lens = meta.block_tables, meta.context_lens
    assert bt.dim() == 2 and bt.shape[0] == B and bt.dtype == torch.int32 and bt.stride(1) == 1, \
        f"block_tables must be [B, pages] int32 with contiguous rows, got {tuple(bt.shape)} {bt.dtype}"
    assert lens.shape == (B,) and lens.dtype == torch.int32, f"context_lens must be [B] int32, got {lens.dtype}"
    if sinks is not None:
        assert sinks.shape == (H,) and sinks.is_floating_point() and sinks.stride(0) == 1, \
            f"sinks must be a contiguous float [H = {H}], got {tuple(sinks.shape)} {sinks.dtype}"
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1, \
        f"out must be [T, H, Dh] {q.dtype} with a contiguous last dim, got {tuple(out.shape)} {out.dtype}"
    tensors = (q, k_cache, v_cache, bt, lens, out) + (() if sinks is None else (sinks,))
    devices = {t.device for t in tensors}
    assert len(devices) == 1, f"all tensors must be on one device, got {sorted(map(str, devices))}"


def paged_decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  meta: AttentionMetadata, scale: float, sliding_window: int | None = None,
                                  sinks: torch.Tensor | None = None, softcap: float | None = None,
                                  out: torch.Tensor | None = None,
                                  config: PagedDecodeAttentionConfig = PagedDecodeAttentionConfig()) -> torch.Tensor:
    """Decode attention over the paged cache -> out [B, H, Dh] in q's dtype.

    q: [B, H, Dh] (one row per sequence; any token/head strides, contiguous last dim);
    k_cache, v_cache: [P, S, Hkv, Dh] (any page/slot/head strides); meta: a decode batch
    (``meta.is_decode``); a sequence with context length 0 gets a row of zeros, as in the
    reference (harmless padding rows); sinks: [H] float or None.
    The launch depends on host values only: shapes and strides (the block table's row stride
    included), the scalar arguments, and ``max(meta.context_lens_host)``, which sets the split
    count and so the workspace size unless ``config.num_splits`` fixes it.
    """
    out = torch.empty_like(q) if out is None else out
    _check_decode_batch(q, k_cache, v_cache, meta, sinks, out)
    assert sliding_window is None or sliding_window >= 1, f"sliding_window must be >= 1, got {sliding_window}"
    assert softcap is None or softcap > 0, f"softcap must be > 0, got {softcap}"
    T, H, Dh = q.shape
    S, Hkv = k_cache.shape[1], k_cache.shape[2]
    if T == 0:
        return out
    max_len = max(meta.context_lens_host)
    assert meta.block_tables.shape[1] * S >= max_len, \
        f"block_tables hold {meta.block_tables.shape[1]} pages of {S}, the longest context has {max_len} tokens"
    max_keys = max_len if sliding_window is None else min(max_len, sliding_window)
    splits = decode_num_splits(T, Hkv, max_keys, config)
    group = H // Hkv
    block_d, block_n = triton.next_power_of_2(Dh), config.keys_per_step(Dh)
    if splits == 1:
        part_o = part_lse = out  # unused: stage 1 writes out itself
    else:
        # allocated per call from torch's caching allocator: cheap, and under CUDA graph capture
        # it comes from the graph's private pool, so replays reuse the same addresses
        part_o = torch.empty((T, H, splits, Dh), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((T, H, splits), dtype=torch.float32, device=q.device)
    if softcap is None:
        qk_scale, cap_scale = scale * _LOG2E, 1.0
    else:
        qk_scale, cap_scale = scale / softcap, softcap * _LOG2E
    sinks_arg = sinks if sinks is not None else out  # a placeholder pointer, never read
    _paged_decode_attention_kernel[(T, Hkv, splits)](
        q, k_cache, v_cache, meta.block_tables, meta.context_lens, sinks_arg, out, part_o, part_lse,
        H, splits, sliding_window or 0, qk_scale, cap_scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        meta.block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=Dh, PAGE_SIZE=S,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d, BLOCK_N=block_n,
        HAS_WINDOW=sliding_window is not None, HAS_SOFTCAP=softcap is not None, HAS_SINKS=sinks is not None,
        DIRECT=splits == 1, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl.launch_args(q),
    )
    if splits > 1:
        _paged_decode_attention_merge_kernel[(T, H)](
            part_o, part_lse, sinks_arg, out, meta.context_lens, H, splits, sliding_window or 0,
            out.stride(0), out.stride(1),
            HEAD_DIM=Dh, BLOCK_D=block_d, BLOCK_SPLITS=triton.next_power_of_2(splits),
            HAS_SINKS=sinks is not None, ACTIVE_FROM_LENS=True, HAS_WINDOW=sliding_window is not None,
            BLOCK_N=block_n,
            num_warps=4, **pdl.launch_args(q),
        )
    return out


def _supported(q, k_cache, v_cache, meta, *args, **kwargs) -> bool:
    return (q.dim() == 3 and k_cache.dim() == 4 and meta.is_decode and q.shape[0] == meta.num_seqs
            and q.dtype in _FLOAT_DTYPES and k_cache.dtype == v_cache.dtype == q.dtype
            and k_cache.shape[3] == q.shape[2] <= 256 and q.shape[1] % k_cache.shape[2] == 0
            and q.shape[1] // k_cache.shape[2] <= 16
            and all(t.stride(-1) == 1 for t in (q, k_cache, v_cache)))


register("paged_decode_attention", "reference", paged_attention_ref)
register("paged_decode_attention", "triton", paged_decode_attention_triton, devices=("cuda",), supports=_supported)

paged_decode_attention = dispatch("paged_decode_attention")


# -- workbench ------------------------------------------------------------------------------

def _make_inputs(case: Case, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> dict:
    d = case.dims
    lens, H, Hkv, Dh, S = list(d["ctx"]), d["H"], d["Hkv"], d["Dh"], d.get("S", 16)
    B = len(lens)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=gen.device).to(device=device, dtype=dtype)

    pages_per_seq = [-(-L // S) for L in lens]
    P = sum(pages_per_seq) + 1  # one spare page nobody owns
    order = torch.randperm(P, generator=gen, device=gen.device).tolist() if d.get("shuffle") else list(range(P))
    tables, used = [], 0
    for n in pages_per_seq:
        tables.append(order[used:used + n])
        used += n
    # the caches as the engine holds them: one layer's K and V views of a [layers, 2, P, S, Hkv, Dh] pool
    kv = randn(2, 2, P, S, Hkv, Dh)
    if d.get("fused"):
        # q as a strided view of a fused QKV projection row
        q = randn(B, (H + 2 * Hkv) * Dh)[:, : H * Dh].view(B, H, Dh)
    else:
        q = randn(B, H, Dh)
    slots = [tables[b][(L - 1) // S] * S + (L - 1) % S if L else -1 for b, L in enumerate(lens)]
    meta = AttentionMetadata.build(slots, tables, list(range(B + 1)), lens, device)
    sinks = None
    if d.get("sinks"):
        sinks = (2 * torch.randn(H, generator=gen, device=gen.device)).to(device)
    return {"q": q, "k_cache": kv[1, 0], "v_cache": kv[1, 1], "meta": meta, "scale": 1.0 / math.sqrt(Dh),
            "sliding_window": d.get("window"), "sinks": sinks, "softcap": d.get("softcap")}


def _visible_keys(inputs: dict) -> int:
    W = inputs["sliding_window"]
    return sum(L if W is None else min(L, W) for L in inputs["meta"].context_lens_host)


def _bytes(inputs: dict) -> int:
    q, k_cache = inputs["q"], inputs["k_cache"]
    Hkv, Dh = k_cache.shape[2], k_cache.shape[3]
    kv = 2 * _visible_keys(inputs) * Hkv * Dh * k_cache.element_size()  # each visible K and V row once
    return kv + 2 * q.numel() * q.element_size()  # + read q, write out


def _flops(inputs: dict) -> int:
    q = inputs["q"]
    return 4 * _visible_keys(inputs) * q.shape[1] * q.shape[2]  # q.k and p.v, 2 FLOPs per multiply-add


SMALL_CASES = (
    Case("one-token", {"ctx": [1], "H": 4, "Hkv": 1, "Dh": 64}, edge="1-token context, GQA group 4"),
    Case("one-page", {"ctx": [16], "H": 8, "Hkv": 2, "Dh": 64}, edge="context exactly one page"),
    Case("page-plus-one-mha", {"ctx": [17], "H": 2, "Hkv": 2, "Dh": 128}, edge="a page + 1; group 1 (MHA)"),
    Case("many-pages-shuffled", {"ctx": [150], "H": 8, "Hkv": 1, "Dh": 64, "shuffle": True},
         edge="10 pages in shuffled order; group 8"),
    Case("ragged", {"ctx": [3, 200, 33, 64], "H": 4, "Hkv": 2, "Dh": 64, "shuffle": True},
         edge="ragged batch of very different lengths, shuffled pages"),
    Case("window-small", {"ctx": [90, 7], "H": 4, "Hkv": 1, "Dh": 64, "window": 24},
         edge="window < context (starts mid-page), and window > the short one"),
    Case("window-large", {"ctx": [20], "H": 4, "Hkv": 2, "Dh": 64, "window": 128}, edge="window > context"),
    Case("sinks-window", {"ctx": [5, 70], "H": 16, "Hkv": 2, "Dh": 64, "window": 32, "sinks": True},
         edge="gpt-oss style: sinks + window, group 8"),
    Case("sinks-full", {"ctx": [40], "H": 4, "Hkv": 1, "Dh": 64, "sinks": True}, edge="sinks, no window"),
    Case("softcap-dh256", {"ctx": [40], "H": 2, "Hkv": 1, "Dh": 256, "softcap": 1.5},
         edge="head dim 256 (Gemma 3), softcap that bites"),
    Case("group16-fused-q", {"ctx": [33], "H": 16, "Hkv": 1, "Dh": 64, "fused": True},
         edge="group 16 fills the 16-row tile; q a strided view of fused QKV"),
    Case("page32", {"ctx": [70, 32], "H": 4, "Hkv": 1, "Dh": 64, "S": 32, "shuffle": True}, edge="page size 32"),
    Case("page64-dh128", {"ctx": [130], "H": 8, "Hkv": 2, "Dh": 128, "S": 64}, edge="page size 64, head dim 128"),
    Case("long-default-splits", {"ctx": [700], "H": 2, "Hkv": 1, "Dh": 64, "sinks": True, "shuffle": True},
         edge="long enough that the default config splits the keys (merge stage, sinks in the merge)"),
)


def _model_cases() -> tuple[Case, ...]:
    models = {
        "llama3.1-8b": ({"H": 32, "Hkv": 8, "Dh": 128}, "Llama-3.1-8B"),
        "qwen3-30b-a3b": ({"H": 32, "Hkv": 4, "Dh": 128}, "Qwen3-30B-A3B"),
    }
    cases = []
    for key, (dims, name) in models.items():
        for B, L in ((1, 32768), (1, 131072), (32, 8192), (256, 2048)):
            cases.append(Case(f"{key}-B{B}-ctx{L}", {"ctx": [L] * B, **dims, "shuffle": True},
                              edge=f"{name} decode, batch {B}, context {L}"))
    gpt_oss = {"H": 64, "Hkv": 8, "Dh": 64, "sinks": True, "shuffle": True}
    for B, L in ((1, 32768), (64, 4096)):
        cases.append(Case(f"gpt-oss-20b-sliding-B{B}-ctx{L}", {"ctx": [L] * B, **gpt_oss, "window": 128},
                          edge=f"gpt-oss-20b sliding layer (window 128, sinks), batch {B}"))
        cases.append(Case(f"gpt-oss-20b-full-B{B}-ctx{L}", {"ctx": [L] * B, **gpt_oss},
                          edge=f"gpt-oss-20b full layer (sinks), batch {B}"))
    cases.append(Case("gemma3-dh256-B8-ctx8192", {"ctx": [8192] * 8, "H": 4, "Hkv": 1, "Dh": 256, "shuffle": True},
                      edge="head dim 256 (Gemma 3 global layer), batch 8"))
    cases.append(Case("llama3.1-8b-ragged-B64", {"ctx": [64 * (i % 16 + 1) ** 2 for i in range(64)], "H": 32,
                                                  "Hkv": 8, "Dh": 128, "shuffle": True},
                      edge="Llama-3.1-8B, ragged batch of 64 (64 to 16384 tokens)"))
    return tuple(cases)


PAGED_DECODE_ATTENTION_SPEC = register_spec(OpSpec(
    op="paged_decode_attention",
    reference=paged_attention_ref,
    make_inputs=_make_inputs,
    cases=SMALL_CASES,
    model_cases=_model_cases(),
    bytes_moved=_bytes,
    flops=_flops,
    out_arg="out",
    launch_config=PagedDecodeAttentionConfig,
    notes="decode batches only (one query row per sequence); the reference is paged_attention_ref.",
))
