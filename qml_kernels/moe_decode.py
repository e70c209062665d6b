"""The expert FFN of a decode step (1 to 4 tokens) as two weight streams (``moe_decode``).

At decode a Qwen3-30B-A3B MoE layer reads the 8 chosen experts' weights for one token: gate+up
``8 x 1536 x 2048`` and down ``8 x 2048 x 768`` bf16, 75.5 MB a layer, 3.6 GB a step (0.86 ms at
4.22 TB/s). ``moe_forward``'s grouped path does it in five launches (the router's linear, the fused
route-and-align, two ``moe_gemm`` tiles of 16 padded rows with one real row, a combine): on the H200
the two GEMMs took 1.27 ms a step (68% of the copy ceiling) and the five launches ~2 ms of 3.5
(``benchmarks/results/engine-h200-qwen3-30b-a3b-fusedroute-2026-12-01.md``).

This path is gemv-shaped (``qml_kernels.gemv``'s structure: each program streams ``[BLOCK_N, BLOCK_K]``
tiles of contiguous weight rows and accumulates products elementwise in fp32, summing over k once
after the loop; no tensor cores, which one real row would waste) and needs no grouping:

1. ``_gate_up_kernel``, program ``(pair p = t·k + j, BLOCK_N rows of I)``: the expert of the pair,
   the gate rows and the up rows beside them, ``h[p] = silu(x[t] · gate) * (x[t] · up)`` ``[T·k, I]``.
2. ``_down_kernel``, program ``(token t, BLOCK_N rows of D)``: the k pairs' rows of their experts'
   down weights stacked into one ``[k·BLOCK_N, BLOCK_K]`` tile (all k experts' loads in flight at
   once), each row's sum weighted by the pair's router weight, the k partial rows summed in
   registers: ``out[t] = sum_j weight[t, j] · (h[t·k + j] @ w_down[e_j].T)``. The combine needs no
   launch and ``y [T·k, D]`` never reaches memory.

Routing: with ``route_inline`` (the default) neither kernel reads ids: every program computes its
token's top-k from the ``[T, E]`` logits itself (``moe_routing._route_tile``, the router's own
softmax, ties to the lower id, renormalisation; 128 logits from L2, a few hundred cycles), so the
router launch goes too and the layer's FFN is three launches: the router's linear and these two.
Without it, ``moe_router`` runs first and the kernels read its ids and weights.

Only the chosen experts are read; a token's k experts are distinct, so at one token nothing is
read twice. At T tokens two tokens may share an expert and both read it (4 tokens of top-8 over
128 experts: ~28.5 distinct of 32 pairs, 12% extra): past ``MAX_TOKENS`` the grouped GEMMs win.

Measured on the H200 (2026-12-01, ``benchmarks/moe_decode_h200.py``, 8 layers of Qwen3-30B-A3B experts in
a CUDA graph; ``benchmarks/results/moe-decode-h200-2026-12-01.md``), it lost to the grouped path it was
meant to replace, so ``moe_forward`` keeps the grouped path unless ``QML_MOE_DECODE=1``:

| tokens | grouped path (5 launches' worth: route, 2 GEMMs, combine) | this path, best config of a 42-config sweep |
|---:|---:|---:|
| 1 | 34.1 us a layer | 36.0 (routing inline), 35.0 (``moe_router`` first) |
| 4 | 81.2 | 122.6, 105.7 |

With the default config the 30B-A3B decode step went from 3.553 to 3.911 ms (600 -> 506 launches, but
gate+up 24.4 us a layer = 2.1 TB/s and down 16.2 us = 1.6 TB/s, where the grouped GEMMs stream 2.9).
Expected: the dense GEMV's ~3.7 TB/s. What we read from it: plain loads feeding FMAs are not
pipelined the way ``tl.dot`` operands are (``cp.async`` stages), and with a few hundred programs
that is too few bytes in flight; the inline top-k (8 rounds of two cross-warp reductions) also
delays every program's first weight load by more than the router launch it saves.

Sources: the matrix-vector structure is textbook; the fused-MoE idea of reading only the routed
experts is vLLM's / SGLang's; the kernels are ours.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from qml_kernels.moe_routing import _FLOAT_DTYPES, _route_tile, draw_expert_ids, moe_router, moe_router_ref
from qml_kernels.registry import dispatch, register
from qml_kernels.workbench.spec import Case, OpSpec, register_spec

MAX_TOKENS = 4  # tokens this path takes (its tiles do not grow with T; duplicate expert reads do)
# off by default: on the H200 the grouped path was faster (see the module docstring); QML_MOE_DECODE=1 takes this one
MOE_DECODE = os.environ.get("QML_MOE_DECODE", "0") == "1"
ROUTE_INLINE = os.environ.get("QML_MOE_DECODE_ROUTE_INLINE", "1") != "0"


@dataclass(frozen=True)
class MoEDecodeConfig:
    """Launch tunables of the two kernels (rows per program, reduction step, warps)."""

    gate_up_block_n: int = 4  # gate rows (and as many up rows) per program
    gate_up_block_k: int = 512
    gate_up_warps: int = 4
    down_block_n: int = 4  # output rows per program, for each of the k pairs
    down_block_k: int = 256
    down_warps: int = 8

    def __post_init__(self):
        for name in ("gate_up_block_n", "gate_up_block_k", "down_block_n", "down_block_k"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"MoEDecodeConfig.{name} must be a power of 2, got {value}")
        for name in ("gate_up_block_k", "down_block_k"):
            if getattr(self, name) < 16:
                raise ValueError(f"MoEDecodeConfig.{name} must be >= 16, got {getattr(self, name)}")
        if self.gate_up_warps < 1 or self.down_warps < 1:
            raise ValueError("MoEDecodeConfig warps must be >= 1")


@triton.jit
def _token_route(logits_ptr, ids_ptr, weights_ptr, token, T, E, stride_logits,
                 TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, ROUTE_INLINE: tl.constexpr,
                 BLOCK_E: tl.constexpr, BLOCK_TOPK: tl.constexpr):
    """The k (weights, ids) of ``token`` as [BLOCK_TOPK] vectors: from the logits, or moe_router's."""
    slots = tl.arange(0, BLOCK_TOPK)
    if ROUTE_INLINE:
        sel_w, sel_id = _route_tile(logits_ptr, token + tl.arange(0, 1), T, E, stride_logits, TOP_K, RENORMALIZE,
                                    1, BLOCK_E, BLOCK_TOPK)  # [1, BLOCK_TOPK]
        w = tl.reshape(sel_w, [BLOCK_TOPK])
        ids = tl.reshape(sel_id, [BLOCK_TOPK])
    else:
        w = tl.load(weights_ptr + token * TOP_K + slots, mask=slots < TOP_K, other=0.0)
        ids = tl.load(ids_ptr + token * TOP_K + slots, mask=slots < TOP_K, other=0)
    return tl.where(slots < TOP_K, w, 0.0), tl.where(slots < TOP_K, ids, 0)


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, h_ptr, logits_ptr, ids_ptr, weights_ptr, T, E, FFN, K,
    stride_x, stride_we, stride_wn, stride_h, stride_logits,
    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, ROUTE_INLINE: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_TOPK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pair = tl.program_id(0)
    token = pair // TOP_K
    _, ids = _token_route(logits_ptr, ids_ptr, weights_ptr, token, T, E, stride_logits, TOP_K, RENORMALIZE,
                          ROUTE_INLINE, BLOCK_E, BLOCK_TOPK)
    expert = tl.sum(tl.where(tl.arange(0, BLOCK_TOPK) == pair % TOP_K, ids, 0), axis=0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] of the FFN width
    row_ok = rows < FFN
    ks = tl.arange(0, BLOCK_K)
    # w[expert] is [2·FFN, K]: gate row n, and its up row FFN + n
    gate_ptrs = w_ptr + expert.to(tl.int64) * stride_we + rows.to(tl.int64)[:, None] * stride_wn + ks[None, :]
    up_ptrs = gate_ptrs + FFN * stride_wn
    x_ptrs = x_ptr + token.to(tl.int64) * stride_x + ks
    acc_gate = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = ks < K - k0
        x = tl.load(x_ptrs, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        gate = tl.load(gate_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        up = tl.load(up_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        acc_gate += gate.to(tl.float32) * x
        acc_up += up.to(tl.float32) * x
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    g = tl.sum(acc_gate, axis=1)
    u = tl.sum(acc_up, axis=1)
    # silu(g) = g / (1 + exp(-g)); exp overflows to inf for g < -88 and the result is 0
    h = g / (1.0 + tl.exp(-g)) * u
    tl.store(h_ptr + pair.to(tl.int64) * stride_h + rows, h.to(h_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _down_kernel(
    h_ptr, w_ptr, out_ptr, logits_ptr, ids_ptr, weights_ptr, T, E, D, K,
    stride_h, stride_we, stride_wn, stride_out, stride_logits,
    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, ROUTE_INLINE: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_TOPK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    token = tl.program_id(0)
    weights, ids = _token_route(logits_ptr, ids_ptr, weights_ptr, token, T, E, stride_logits, TOP_K, RENORMALIZE,
                                ROUTE_INLINE, BLOCK_E, BLOCK_TOPK)
    # the tile's rows r = j·BLOCK_N + n: output row n of pair j's expert
    r = tl.arange(0, BLOCK_TOPK * BLOCK_N)
    slot = r // BLOCK_N
    pick = slot[:, None] == tl.arange(0, BLOCK_TOPK)[None, :]  # [BLOCK_TOPK·BLOCK_N, BLOCK_TOPK]
    expert = tl.sum(tl.where(pick, ids[None, :], 0), axis=1)
    weight = tl.sum(tl.where(pick, weights[None, :], 0.0), axis=1)
    rows = tl.program_id(1) * BLOCK_N + r % BLOCK_N
    ok = (slot < TOP_K) & (rows < D)
    ks = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + expert.to(tl.int64)[:, None] * stride_we + rows.to(tl.int64)[:, None] * stride_wn + ks[None, :]
    h_ptrs = h_ptr + (token * TOP_K + tl.minimum(slot, TOP_K - 1)).to(tl.int64)[:, None] * stride_h + ks[None, :]
    acc = tl.zeros([BLOCK_TOPK * BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = ks < K - k0
        m = ok[:, None] & k_ok[None, :]
        w = tl.load(w_ptrs, mask=m, other=0.0)
        h = tl.load(h_ptrs, mask=m, other=0.0)  # the k rows of h, each repeated BLOCK_N times (from L1)
        acc += w.to(tl.float32) * h.to(tl.float32)
        w_ptrs += BLOCK_K
        h_ptrs += BLOCK_K
    y = tl.sum(acc, axis=1) * weight  # [BLOCK_TOPK·BLOCK_N]: each pair's row, weighted
    y = tl.sum(tl.reshape(y, [BLOCK_TOPK, BLOCK_N]), axis=0)  # [BLOCK_N]: the k pairs summed
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(out_ptr + token.to(tl.int64) * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=cols < D)


def moe_decode_triton(x: torch.Tensor, router_logits: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                      top_k: int, renormalize: bool, *, out: torch.Tensor | None = None,
                      config: MoEDecodeConfig | None = None, route_inline: bool | None = None) -> torch.Tensor:
    """x [T, D] (T <= MAX_TOKENS), router_logits [T, E], w_gate_up [E, 2I, D], w_down [E, D, I] ->
    [T, D] in x.dtype: the sum over each token's top-k experts of weight · SwiGLU expert(x).
    ``route_inline``: None takes ``ROUTE_INLINE``; False runs ``moe_router`` first."""
    assert _supported(x, router_logits, w_gate_up, w_down, top_k), \
        f"moe_decode: x {x.dtype} {tuple(x.shape)}, logits {tuple(router_logits.shape)}, w_gate_up " \
        f"{tuple(w_gate_up.shape)}, w_down {tuple(w_down.shape)}, top_k {top_k}: needs 1-{MAX_TOKENS} tokens, " \
        "matching dtypes and contiguous rows"
    T, D = x.shape
    E, two_ffn, _ = w_gate_up.shape
    ffn = two_ffn // 2
    if out is None:
        out = torch.empty((T, D), dtype=x.dtype, device=x.device)
    assert out.shape == (T, D) and out.dtype == x.dtype and out.stride(-1) == 1, \
        f"out: {out.dtype} {tuple(out.shape)}, expected {x.dtype} {(T, D)} with contiguous rows"
    config = config or MoEDecodeConfig()
    inline = ROUTE_INLINE if route_inline is None else route_inline
    if inline:
        ids = weights = router_logits  # unread (the kernels route from the logits)
    else:
        weights, ids = moe_router(router_logits, top_k, renormalize)
    h = torch.empty((T * top_k, ffn), dtype=x.dtype, device=x.device)
    common = dict(TOP_K=top_k, RENORMALIZE=bool(renormalize), ROUTE_INLINE=bool(inline),
                  BLOCK_E=triton.next_power_of_2(E), BLOCK_TOPK=triton.next_power_of_2(top_k))
    block_k = min(config.gate_up_block_k, max(16, triton.next_power_of_2(D)))
    _gate_up_kernel[(T * top_k, triton.cdiv(ffn, config.gate_up_block_n))](
        x, w_gate_up, h, router_logits, ids, weights, T, E, ffn, D,
        x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), h.stride(0), router_logits.stride(0),
        BLOCK_N=config.gate_up_block_n, BLOCK_K=block_k, num_warps=config.gate_up_warps, **common,
    )
    block_k = min(config.down_block_k, max(16, triton.next_power_of_2(ffn)))
    _down_kernel[(T, triton.cdiv(D, config.down_block_n))](
        h, w_down, out, router_logits, ids, weights, T, E, D, ffn,
        h.stride(0), w_down.stride(0), w_down.stride(1), out.stride(0), router_logits.stride(0),
        BLOCK_N=config.down_block_n, BLOCK_K=block_k, num_warps=config.down_warps, **common,
    )
    return out


def moe_decode_ref(x: torch.Tensor, router_logits: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                   top_k: int, renormalize: bool) -> torch.Tensor:
    """The same FFN as a loop over tokens and their experts in fp32 (h rounded to x's dtype, as the
    kernels store it): [T, D] in x.dtype."""
    weights, ids = moe_router_ref(router_logits, top_k, renormalize)
    ffn = w_gate_up.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        for j in range(top_k):
            e = int(ids[t, j])
            gate_up = w_gate_up[e].float() @ x[t].float()  # [2I]
            h = (torch.nn.functional.silu(gate_up[:ffn]) * gate_up[ffn:]).to(x.dtype).float()
            out[t] += weights[t, j] * (w_down[e].float() @ h)
    return out.to(x.dtype)


def _supported(x, router_logits, w_gate_up, w_down, top_k, *args, **kwargs) -> bool:
    tensors = (x, router_logits, w_gate_up, w_down)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return False
    if x.dim() != 2 or router_logits.dim() != 2 or w_gate_up.dim() != 3 or w_down.dim() != 3:
        return False
    T, D = x.shape
    E, two_ffn, K = w_gate_up.shape
    return (1 <= T <= MAX_TOKENS and x.dtype in _FLOAT_DTYPES and w_gate_up.dtype == x.dtype
            and w_down.dtype == x.dtype and router_logits.dtype in _FLOAT_DTYPES
            and router_logits.shape == (T, E) and K == D and two_ffn % 2 == 0
            and tuple(w_down.shape) == (E, D, two_ffn // 2) and 1 <= top_k <= E
            and all(t.stride(-1) == 1 for t in tensors) and len({t.device for t in tensors}) == 1)


def decode_applies(x: torch.Tensor, router_logits: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                   top_k: int) -> bool:
    """``moe_forward`` takes this path: switched on, on a GPU, for up to MAX_TOKENS tokens."""
    return MOE_DECODE and x.is_cuda and _supported(x, router_logits, w_gate_up, w_down, top_k)


register("moe_decode", "reference", moe_decode_ref)
register("moe_decode", "triton", moe_decode_triton, devices=("cuda",), supports=_supported)
moe_decode = dispatch("moe_decode")


# -- workbench ------------------------------------------------------------------------------

def _make_inputs(case: Case, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> dict:
    d = case.dims
    T, E, k, D, ffn = d["T"], d["E"], d["k"], d["D"], d["I"]

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen, device=gen.device)).to(device=device, dtype=dtype)

    logits = 2.0 * torch.randn(T, E, generator=gen, device=gen.device)
    if d.get("ties"):
        logits = logits.round()  # many equal logits per row: ties go to the lower id
    if d.get("spread") == "hot":
        logits[:, 0] += 50.0  # every token's first choice is expert 0
    elif d.get("spread") == "shared":  # the tokens choose the same k experts
        ids = draw_expert_ids(1, E, k, gen)[0]
        logits[:, ids.long()] += 50.0
    return {"x": randn(T, D), "router_logits": logits.to(device=device, dtype=dtype),
            "w_gate_up": randn(E, 2 * ffn, D, scale=D**-0.5), "w_down": randn(E, D, ffn, scale=ffn**-0.5),
            "top_k": k, "renormalize": d.get("renormalize", True)}


def _bytes(inputs: dict) -> int:
    # the chosen experts' weights (each pair's: the kernels read a shared expert once per pair)
    T, E = inputs["router_logits"].shape
    k, w_gu, w_d = inputs["top_k"], inputs["w_gate_up"], inputs["w_down"]
    return (T * k * (w_gu[0].numel() + w_d[0].numel()) + 2 * inputs["x"].numel()) * inputs["x"].element_size()


def _flops(inputs: dict) -> int:
    T, k = inputs["x"].shape[0], inputs["top_k"]
    return 2 * T * k * (inputs["w_gate_up"][0].numel() + inputs["w_down"][0].numel())


CASES = (
    Case("one-token", {"T": 1, "E": 16, "k": 4, "D": 64, "I": 48}, edge="decode: 4 of 16 experts, one K step"),
    Case("four-tokens", {"T": 4, "E": 8, "k": 2, "D": 40, "I": 24},
         edge="MAX_TOKENS tokens; K and rows not multiples of the tiles"),
    Case("prime-experts", {"T": 3, "E": 61, "k": 3, "D": 72, "I": 28, "renormalize": False},
         edge="E=61 (prime), k=3 (not a power of 2: unused slots), weights not renormalised"),
    Case("ties", {"T": 2, "E": 32, "k": 8, "D": 64, "I": 32, "ties": True},
         edge="integer logits: ties to the lower expert id, as moe_router"),
    Case("shared-experts", {"T": 4, "E": 16, "k": 4, "D": 48, "I": 40, "spread": "shared"},
         edge="all tokens choose the same experts (each pair still reads its own)"),
    Case("all-experts", {"T": 2, "E": 4, "k": 4, "D": 600, "I": 300},
         edge="k = E; several K steps with tails (D 600, I 300)"),
)

MODEL_CASES = tuple(
    Case(f"qwen3-30b-a3b-T{T}", {"T": T, "E": 128, "k": 8, "D": 2048, "I": 768},
         edge=f"Qwen3-30B-A3B's experts, {T} decode token(s)")
    for T in (1, 2, 4))

MOE_DECODE_SPEC = register_spec(OpSpec(
    op="moe_decode",
    reference=moe_decode_ref,
    make_inputs=_make_inputs,
    cases=CASES,
    model_cases=MODEL_CASES,
    bytes_moved=_bytes,
    flops=_flops,
    out_arg="out",
    launch_config=MoEDecodeConfig,
    notes="the whole expert FFN for 1-4 tokens: routing from the logits, gate+up with SwiGLU, down with the combine",
))
