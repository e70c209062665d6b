"""Decode-shaped linear layers (1 to 4 tokens): ``y = x @ w.T`` as a stream of the weight.

At decode a linear layer reads its whole weight to produce a few rows: 2 FLOPs per weight
element, so the op is bound by memory bandwidth (H200: ~4.2 TB/s copy ceiling) and tensor
cores buy nothing. cuBLAS reaches 3.3-4.1 TB/s on Llama-3.1-8B's large matrices but less on
the small ones: the attention output projection (4096x4096, 33.5 MB) runs split-K with a
second reduction kernel (2.7 TB/s inside the decode graph), Qwen3-30B-A3B's projections
(2048-wide) 1.3-1.6 TB/s.

``gemv_triton``: one program per ``block_n`` output features walks the reduction dimension in
``block_k`` steps. Each step loads a ``[block_n, block_k]`` tile of the weight (contiguous rows)
and the ``[T, block_k]`` slice of x, and accumulates the products elementwise in fp32 registers
(``[T, block_n, block_k]``); the sum over k is taken once, after the loop, so the loop holds
no cross-thread reduction. Many small programs (N / block_n of them, several per SM) keep the
loads of many rows in flight at once, which is what streaming needs (Little's law: ~6 MB in
flight across the GPU at 4.2 TB/s). One launch, no split-K pass.

It is a ``linear`` implementation (``qml_kernels.linear``): the tuning table names it for the
(dtype, N, K, token bucket) where it measured faster than cuBLAS on the GPU, with its config.

Sources: the matrix-vector structure is textbook; the elementwise accumulation with a final
reduction is the usual way to keep a Triton reduction out of a streaming loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from qml_kernels import pdl

MAX_TOKENS = 4  # rows of x one call takes: the accumulator grows with them
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class GemvConfig:
    """Launch tunables: output features per program, reduction step, warps."""

    block_n: int = 4
    block_k: int = 512
    num_warps: int = 4

    def __post_init__(self):
        for name in ("block_n", "block_k"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"GemvConfig.{name} must be a power of 2, got {value}")
        if self.block_k < 16:
            raise ValueError(f"GemvConfig.block_k must be >= 16, got {self.block_k}")
        if self.num_warps < 1:
            raise ValueError(f"GemvConfig.num_warps must be >= 1, got {self.num_warps}")


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, T, N, K, stride_x, stride_w, stride_y,
                 T_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output features
    row_ok = rows < N
    tokens = tl.arange(0, T_PAD)
    token_ok = tokens < T
    ks = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_w + ks[None, :]  # [BLOCK_N, BLOCK_K]
    x_ptrs = x_ptr + tokens[:, None] * stride_x + ks[None, :]  # [T_PAD, BLOCK_K]
    acc = tl.zeros([T_PAD, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = ks < K - k0
        w = tl.load(w_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        x = tl.load(x_ptrs, mask=token_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += x[:, None, :] * w[None, :, :]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    y = tl.sum(acc, axis=2)  # [T_PAD, BLOCK_N]
    y_ptrs = y_ptr + tokens[:, None] * stride_y + rows[None, :]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=token_ok[:, None] & row_ok[None, :])


def gemv_capable(x, weight, out=None) -> bool:
    """Whether ``gemv_triton`` takes these arguments: 1 to MAX_TOKENS rows, contiguous last dims."""
    return (isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor) and x.dim() == 2
            and weight.dim() == 2 and 1 <= x.shape[0] <= MAX_TOKENS and x.shape[1] == weight.shape[1]
            and x.shape[1] > 0 and x.dtype in _FLOAT_DTYPES and weight.dtype == x.dtype
            and x.stride(1) == 1 and weight.stride(1) == 1 and x.device == weight.device
            and (out is None or (isinstance(out, torch.Tensor) and out.stride(-1) == 1)))


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None,
                config: GemvConfig | None = None) -> torch.Tensor:
    """x: [T, K] (T <= MAX_TOKENS), weight: [N, K] -> [T, N] in x.dtype, accumulated in fp32."""
    assert gemv_capable(x, weight, out), \
        f"gemv: x {x.dtype} {tuple(x.shape)}, weight {weight.dtype} {tuple(weight.shape)}: needs 1-{MAX_TOKENS} " \
        "rows of matching dtype with contiguous last dimensions"
    T, K = x.shape
    N = weight.shape[0]
    if out is None:
        out = torch.empty((T, N), dtype=x.dtype, device=x.device)
    assert out.shape == (T, N) and out.dtype == x.dtype, f"out: {out.dtype} {tuple(out.shape)}, expected {(T, N)}"
    config = config or GemvConfig()
    block_k = min(config.block_k, max(16, triton.next_power_of_2(K)))
    _gemv_kernel[(triton.cdiv(N, config.block_n),)](
        x, weight, out, T, N, K, x.stride(0), weight.stride(0), out.stride(0),
        T_PAD=triton.next_power_of_2(T), BLOCK_N=config.block_n, BLOCK_K=block_k, num_warps=config.num_warps,
        **pdl.launch_args(x),
    )
    return out
