"""Linear layers: ``y = x @ w.T`` with weights stored ``[N, K]`` (output rows, as checkpoints do)."""

import torch
import torch.nn.functional as F


def linear_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x: [T, K], weight: [N, K] -> [T, N] in x.dtype, accumulated in fp32."""
    return (x.float() @ weight.float().T).to(x.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # torch's matmul is the vendor GEMM on every device (cuBLAS on CUDA, oneDNN/MKL on CPU)
    return F.linear(x, weight)
