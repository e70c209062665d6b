"""RMSNorm, and RMSNorm fused with the residual add that precedes it.

``y = x / sqrt(mean(x^2) + eps) * (offset + w)``; Gemma stores ``w`` so that the
scale is ``1 + w`` (``offset=1``), Llama uses ``offset=0``.
"""

import torch


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """x: [T, D], weight: [D] -> [T, D] in x.dtype, computed in fp32."""
    xf = x.float()
    inv_rms = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)  # [T, 1]
    return (xf * inv_rms * (offset + weight.float())).to(x.dtype)


def add_rmsnorm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(rmsnorm(x + residual), x + residual)``; both [T, D] in x.dtype."""
    summed = (x.float() + residual.float()).to(x.dtype)  # [T, D]
    return rmsnorm_ref(summed, weight, eps, offset), summed


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    return rmsnorm_ref(x, weight, eps, offset)


def add_rmsnorm(x, residual, weight, eps: float, offset: float = 0.0):
    return add_rmsnorm_ref(x, residual, weight, eps, offset)
