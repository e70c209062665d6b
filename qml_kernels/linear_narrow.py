"""Token-narrow GEMM: ``y = x @ w.T`` for a turn's ~100-256 tokens, with the weight's rows as the MMA's rows.

Why. The next turn of a conversation is ~150 new tokens over a long history, run in the prefill graph
of 160 tokens. In the H200 profile of that turn (``engine-h200-gputurn-hostturn-afterfresh-arrival-2026-12-04.json``,
Llama-3.1-8B) cuBLAS's four GEMMs a layer took 160 us: gate_up 76 (nvjet 256x96 tiles), down 40.5 (64x192,
split-K, plus its reduction), qkv 22.7 (144x64), o 16.8 (96x64). A layer's weights are 436 MB (97 us at
~4.5 TB/s) and 160 tokens are 70 GFLOP (91 us at the 765 TFLOP/s measured peak): at 160 FLOPs per weight
byte the call sits at the H200's ridge (~170), where both ceilings are near and neither is reached (2.7 TB/s,
440 TFLOP/s). cuBLAS's tiles of 96 or 192 tokens compute 160 tokens as 192 (1.2x the tensor-core work), and
its smaller projections (qkv, o: 16-23 us for 8-11 us of weights) run below the weight stream's rate.

What. The product is computed transposed, ``y^T = w @ x^T``: output features are the MMA's rows
(``BLOCK_F`` = 64, 128 or 256, whole at every Llama/Qwen width) and tokens its columns. wgmma takes
columns in multiples of 8, Triton's tiles are powers of two, so the tokens are covered by one tile or
two (``token_tiles``: 160 -> 128 + 32, no padding; 150 -> the same 160; 133 -> 128 + 16). Each program owns
``BLOCK_F`` features for all tokens: it reads its weight rows once (from HBM, exactly once over the
grid) and all of x (``T x K``: 1.2 MB at 150 x 4096 bf16, from L2). Per byte loaded a 128 x 160 tile
does 71 useful FLOPs, a 256 x 160 one 98. Where the feature tiles are too few to keep the SMs busy
(4096 outputs are 32 tiles of 128), K is split into ``split_k`` ranges whose fp32 partials a second,
small kernel adds in a fixed order (the result does not depend on timing).

Everything moves through TMA tensor descriptors (zero-filled past T, N and K: no masks); the output
tile is stored transposed through a descriptor over ``y`` (clipped at T and N).

Which of this, the Triton GEMM (``qml_kernels.linear``) or cuBLAS runs a shape is the tuning table's
choice, from measurements on the GPU (``benchmarks/linear_table.py``); untuned shapes run cuBLAS.

Measured on the H200 (``benchmarks/results/linear-narrow-h200-2026-12-05.json``): behind cuBLAS at every turn
size, 161 us for a layer's four GEMMs at 160 tokens at the best configs against cuBLAS's 146 (gate_up's weights
streamed at 3.04 TB/s against cuBLAS's 3.45), so the table names no shape for it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

MAX_TOKENS = 256  # one program covers all tokens: two tiles of at most 128 + 128 (or one of 256)
_SMEM_BUDGET = 220 * 1024
_TMA_BOX_MAX = 256
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class NarrowConfig:
    """Launch tunables of the token-narrow GEMM (the token tiles follow from T, ``token_tiles``)."""

    block_f: int = 128  # output features per program (the MMA's rows: 64 per warpgroup)
    block_k: int = 64  # reduction step (64 bf16 = one 128-byte swizzled row per TMA copy)
    split_k: int = 1  # K ranges per feature tile; > 1 adds fp32 partials in a second kernel
    num_warps: int = 8
    num_stages: int = 4

    def __post_init__(self):
        if self.block_f not in (64, 128, 256):
            raise ValueError(f"NarrowConfig.block_f must be 64, 128 or 256, got {self.block_f}")
        if self.block_k < 16 or self.block_k > _TMA_BOX_MAX or self.block_k & (self.block_k - 1):
            raise ValueError(f"NarrowConfig.block_k must be a power of 2 in [16, 256], got {self.block_k}")
        if self.split_k < 1 or self.split_k > 16:
            raise ValueError(f"NarrowConfig.split_k must be in [1, 16], got {self.split_k}")
        if self.num_warps < 4 or self.num_stages < 1:
            raise ValueError("NarrowConfig.num_warps must be >= 4 (one warpgroup) and num_stages >= 1")


def token_tiles(T: int) -> tuple[int, int]:
    """The token tiles (a, b) covering ``T`` tokens: powers of two of at least 16, ``b`` = 0 for none.

    Two tiles where they cover T with fewer columns than the next power of two (150 -> (128, 32));
    one where they would not (200 -> (256, 0))."""
    if T < 1 or T > MAX_TOKENS:
        raise ValueError(f"the token-narrow GEMM takes 1 to {MAX_TOKENS} tokens, got {T}")
    whole = max(16, triton.next_power_of_2(T))
    a = max(16, 1 << (T.bit_length() - 1))
    if a >= T:
        return whole, 0
    b = max(16, triton.next_power_of_2(T - a))
    return (a, b) if a + b < whole and b <= a else (whole, 0)


def default_narrow_config(T: int, N: int, K: int, dtype: torch.dtype, num_sms: int = 132) -> NarrowConfig:
    """The heuristic's config (the tuning table overrides it): 128 features a program where that gives
    at least half as many programs as SMs, else 64; then the fewest K splits that reach half the SMs
    (each split adds ``2 * T * N * 4`` bytes of partials to the weight's ``N * K * elem``)."""
    elem = dtype.itemsize
    block_k = 128 // elem
    block_f = 128 if triton.cdiv(N, 128) * 2 >= num_sms else 64
    tiles = triton.cdiv(N, block_f)
    split = 1
    k_steps = triton.cdiv(K, block_k)
    while tiles * split * 2 < num_sms and split < 8 and k_steps // (split * 2) >= 4:
        split *= 2
    a, b = token_tiles(T)
    stage = (block_f + a + b) * block_k * elem
    epilogue = a * block_f * (4 if split > 1 else elem)  # the transposed tile: fp32 partials, or y's dtype
    stages = max(2, min(4, (_SMEM_BUDGET - epilogue) // stage))
    return NarrowConfig(block_f, block_k, split, 8 if block_f >= 128 else 4, stages)


@triton.jit
def _narrow_kernel(
    w_desc, xa_desc, xb_desc,  # TMA: w [N, K] in [BLOCK_F, BLOCK_K] boxes; x [T, K] in [TOK_A | TOK_B, BLOCK_K]
    ya_desc, yb_desc,  # TMA: y [T, N] in [TOK_A | TOK_B, BLOCK_F] boxes (SPLIT == 1)
    part_ptr,  # fp32 [SPLIT, T, N] partial sums (SPLIT > 1)
    T, N, K, k_per_split,  # k_per_split: a multiple of BLOCK_K
    BLOCK_F: tl.constexpr, BLOCK_K: tl.constexpr, TOK_A: tl.constexpr, TOK_B: tl.constexpr,
    SPLIT: tl.constexpr, PRECISION: tl.constexpr,
):
    off_f = tl.program_id(0) * BLOCK_F
    split = tl.program_id(1)
    k_start = split * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    acc_a = tl.zeros((BLOCK_F, TOK_A), dtype=tl.float32)
    if TOK_B > 0:
        acc_b = tl.zeros((BLOCK_F, TOK_B), dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        # boxes past T, N or K are zero-filled: the padded tokens and K columns add nothing
        w = w_desc.load([off_f, k])  # [BLOCK_F, BLOCK_K], read once over the whole grid
        xa = xa_desc.load([0, k])  # [TOK_A, BLOCK_K], every program's: from L2
        acc_a = tl.dot(w, xa.T, acc_a, input_precision=PRECISION)
        if TOK_B > 0:  # the same weight tile against the tokens after the first tile
            xb = xb_desc.load([TOK_A, k])
            acc_b = tl.dot(w, xb.T, acc_b, input_precision=PRECISION)
    if SPLIT == 1:
        # the transposed tile goes to y's [tokens, features] layout; TMA clips it at T and N
        ya_desc.store([0, off_f], tl.trans(acc_a).to(ya_desc.dtype))
        if TOK_B > 0:
            yb_desc.store([TOK_A, off_f], tl.trans(acc_b).to(yb_desc.dtype))
    else:
        feats = off_f + tl.arange(0, BLOCK_F)
        base = part_ptr + split.to(tl.int64) * T * N
        toks = tl.arange(0, TOK_A)
        tl.store(base + toks[:, None] * N + feats[None, :], tl.trans(acc_a),
                 mask=(toks[:, None] < T) & (feats[None, :] < N))
        if TOK_B > 0:
            toks = TOK_A + tl.arange(0, TOK_B)
            tl.store(base + toks[:, None] * N + feats[None, :], tl.trans(acc_b),
                     mask=(toks[:, None] < T) & (feats[None, :] < N))


@triton.jit
def _narrow_sum_kernel(part_ptr, y_ptr, TN, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """y = the sum of the SPLIT partials, in split order (deterministic), cast to y's dtype."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < TN
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(part_ptr + s * TN + offs, mask=mask, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def _tma_ready(t: torch.Tensor) -> bool:
    return (t.dim() == 2 and t.stride(1) == 1 and t.data_ptr() % 16 == 0
            and (t.stride(0) * t.element_size()) % 16 == 0)


def narrow_capable(x, weight, out=None) -> bool:
    """Whether the token-narrow GEMM can run these arguments (shapes, dtypes, TMA alignment)."""
    return (isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor) and x.dim() == 2 and weight.dim() == 2
            and 1 <= x.shape[0] <= MAX_TOKENS and x.shape[1] == weight.shape[1] and x.shape[1] > 0
            and x.dtype in _FLOAT_DTYPES and weight.dtype == x.dtype and _tma_ready(x) and _tma_ready(weight)
            and (weight.shape[0] * x.element_size()) % 16 == 0
            and (out is None or (isinstance(out, torch.Tensor) and _tma_ready(out) and out.is_contiguous())))


def linear_narrow(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None,
                  config: NarrowConfig | None = None) -> torch.Tensor:
    """x: [T, K] (T <= 256), weight: [N, K] -> [T, N] in x.dtype (fp32 accumulation), features as the MMA's rows."""
    assert narrow_capable(x, weight, out), (
        f"linear_narrow: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}: needs 1 to "
        f"{MAX_TOKENS} tokens, matching K and dtypes, 16-byte aligned contiguous rows (and a contiguous out)")
    T, K = x.shape
    N = weight.shape[0]
    if out is None:
        out = torch.empty((T, N), device=x.device, dtype=x.dtype)
    assert out.shape == (T, N) and out.dtype == x.dtype and out.device == x.device, \
        f"out: {tuple(out.shape)} {out.dtype} on {out.device}, expected {(T, N)} {x.dtype} on {x.device}"
    if N == 0:
        return out
    if config is None:
        config = (NarrowConfig(block_f=64, block_k=64, split_k=1, num_warps=4, num_stages=2)
                  if x.device.type == "cpu" else default_narrow_config(T, N, K, x.dtype, _sm_count(x.device)))
    bf, bk = config.block_f, config.block_k
    a, b = token_tiles(T)
    k_steps = triton.cdiv(K, bk)
    split = min(config.split_k, k_steps)
    k_per_split = triton.cdiv(k_steps, split) * bk
    split = triton.cdiv(K, k_per_split)  # (no empty split: each covers at least one K step)
    part = torch.empty((split, T, N), device=x.device, dtype=torch.float32) if split > 1 else out
    xa, ya = TensorDescriptor.from_tensor(x, [a, bk]), TensorDescriptor.from_tensor(out, [a, bf])
    # (one token tile: the second tile's descriptors are never read, the first ones stand in)
    xb = TensorDescriptor.from_tensor(x, [b, bk]) if b else xa
    yb = TensorDescriptor.from_tensor(out, [b, bf]) if b else ya
    _narrow_kernel[(triton.cdiv(N, bf), split)](
        TensorDescriptor.from_tensor(weight, [bf, bk]), xa, xb, ya, yb,
        part, T, N, K, k_per_split,
        BLOCK_F=bf, BLOCK_K=bk, TOK_A=a, TOK_B=b, SPLIT=split,
        # fp32 in full precision, as torch's default fp32 matmul (TF32 off)
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if split > 1:
        block = 1024
        _narrow_sum_kernel[(triton.cdiv(T * N, block),)](part, out, T * N, SPLIT=split, BLOCK=block, num_warps=4)
    return out


def _sm_count(device: torch.device) -> int:
    return _sm_count_of(device.index or 0)


@functools.cache
def _sm_count_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
