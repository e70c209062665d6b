"""Gated activations over a fused gate-up input: SwiGLU and GeGLU.

The gate and up projections are computed by one GEMM into ``[T, 2I]``
(gate first, then up), so the activation reads one tensor and writes half of it.
"""

import torch
import torch.nn.functional as F


def swiglu_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2I] -> silu(gate) * up: [T, I]."""
    gate, up = gate_up.float().chunk(2, dim=-1)  # [T, I] each
    return (F.silu(gate) * up).to(gate_up.dtype)


def geglu_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2I] -> gelu_tanh(gate) * up: [T, I] (Gemma's activation)."""
    gate, up = gate_up.float().chunk(2, dim=-1)  # [T, I] each
    return (F.gelu(gate, approximate="tanh") * up).to(gate_up.dtype)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    return swiglu_ref(gate_up)


def geglu(gate_up: torch.Tensor) -> torch.Tensor:
    return geglu_ref(gate_up)
