"""Gated activations over a fused gate-up input: SwiGLU and GeGLU.

The gate and up projections are computed by one GEMM into ``[T, 2I]``
(gate first, then up), so the activation reads one tensor and writes half of it:
``y = act(gate) * up``, with ``act = silu`` (SwiGLU: Llama, Qwen) or the tanh
approximation of GELU (GeGLU: Gemma).

Traffic: reads ``2·T·I`` and writes ``T·I`` elements; under 20 FLOPs per output, so
the kernel is memory-bound and is judged in GB/s. Both activations are
``g · sigmoid(c(g))``: silu has ``c(g) = g``, and since ``(1 + tanh(u)) / 2 = sigmoid(2u)``
the tanh-GELU has ``c(g) = 2·sqrt(2/pi)·(g + 0.044715·g^3)``; one exponential each.

Sources: Shazeer, "GLU Variants Improve Transformer" (2020); Hendrycks & Gimpel,
"Gaussian Error Linear Units" (2016) for the tanh approximation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from qml_kernels import pdl
from qml_kernels.registry import dispatch, register
from qml_kernels.workbench.spec import Case, OpSpec, register_spec

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class GatedActivationConfig:
    """Launch tunables shared by SwiGLU and GeGLU."""

    # 1024 columns over 128 threads: 8 per thread, one 16-byte load of gate and of up in bf16
    block_i: int = 1024
    num_warps: int = 4

    def __post_init__(self):
        if self.block_i < 1 or self.block_i & (self.block_i - 1):
            raise ValueError(f"GatedActivationConfig.block_i must be a power of 2, got {self.block_i}")


@triton.jit
def _gated_activation_kernel(
    gate_up_ptr, out_ptr, I, stride_in, stride_out,
    GELU_TANH: tl.constexpr, BLOCK_I: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.enter(PDL)
    # rows on grid axis 0 (up to 2^31 - 1) since prefill T can pass axis 1's 65535 limit
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)  # [BLOCK_I]
    mask = cols < I
    gate_ptrs = gate_up_ptr + row * stride_in + cols
    g = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate_ptrs + I, mask=mask, other=0.0).to(tl.float32)
    if GELU_TANH:
        # 2 * sqrt(2 / pi): the factor 2 turns the tanh into a sigmoid
        z = 1.5957691216057308 * (g + 0.044715 * g * g * g)
    else:
        z = g
    # exp(-z) overflows to inf for z < -88 and the sigmoid correctly becomes 0
    y = g / (1.0 + tl.exp(-z)) * u
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(gate_up: torch.Tensor, out: torch.Tensor | None, gelu_tanh: bool,
            config: GatedActivationConfig) -> torch.Tensor:
    assert gate_up.dim() == 2, f"gate_up must be [T, 2I], got shape {tuple(gate_up.shape)}"
    assert gate_up.dtype in _FLOAT_DTYPES, f"gate_up: unsupported dtype {gate_up.dtype}"
    assert gate_up.stride(-1) == 1, f"gate_up: the last dimension must be contiguous, strides {gate_up.stride()}"
    T, two_i = gate_up.shape
    assert two_i % 2 == 0, f"gate_up's last dimension must be even (gate then up), got {two_i}"
    I = two_i // 2
    if out is None:
        out = torch.empty((T, I), dtype=gate_up.dtype, device=gate_up.device)
    assert out.shape == (T, I), f"out: shape {tuple(out.shape)}, expected {(T, I)}"
    assert out.dtype == gate_up.dtype, f"out: dtype {out.dtype}, expected {gate_up.dtype}"
    assert out.device == gate_up.device, f"out on {out.device}, gate_up on {gate_up.device}"
    assert out.stride(-1) == 1, f"out: the last dimension must be contiguous, strides {out.stride()}"
    if T == 0 or I == 0:
        return out
    block_i = min(config.block_i, triton.next_power_of_2(I))
    _gated_activation_kernel[(T, triton.cdiv(I, block_i))](
        gate_up, out, I, gate_up.stride(0), out.stride(0),
        GELU_TANH=gelu_tanh, BLOCK_I=block_i, num_warps=config.num_warps, **pdl.launch_args(gate_up),
    )
    return out


def swiglu_triton(gate_up: torch.Tensor, *, out: torch.Tensor | None = None,
                  config: GatedActivationConfig = GatedActivationConfig()) -> torch.Tensor:
    """gate_up: [T, 2I] -> silu(gate) * up: [T, I] in gate_up.dtype."""
    return _launch(gate_up, out, gelu_tanh=False, config=config)


def geglu_triton(gate_up: torch.Tensor, *, out: torch.Tensor | None = None,
                 config: GatedActivationConfig = GatedActivationConfig()) -> torch.Tensor:
    """gate_up: [T, 2I] -> gelu_tanh(gate) * up: [T, I] in gate_up.dtype."""
    return _launch(gate_up, out, gelu_tanh=True, config=config)


def swiglu_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2I] -> silu(gate) * up: [T, I]."""
    gate, up = gate_up.float().chunk(2, dim=-1)  # [T, I] each
    return (F.silu(gate) * up).to(gate_up.dtype)


def geglu_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2I] -> gelu_tanh(gate) * up: [T, I] (Gemma's activation)."""
    gate, up = gate_up.float().chunk(2, dim=-1)  # [T, I] each
    return (F.gelu(gate, approximate="tanh") * up).to(gate_up.dtype)


def _supported(gate_up, *args, **kwargs) -> bool:
    return (gate_up.dim() == 2 and gate_up.dtype in _FLOAT_DTYPES and gate_up.stride(-1) == 1
            and gate_up.shape[-1] % 2 == 0)


register("swiglu", "reference", swiglu_ref)
register("swiglu", "triton", swiglu_triton, devices=("cuda",), supports=_supported)
register("geglu", "reference", geglu_ref)
register("geglu", "triton", geglu_triton, devices=("cuda",), supports=_supported)

_swiglu = dispatch("swiglu")
_geglu = dispatch("geglu")


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU. gate_up: [T, 2I] (gate first, then up) -> silu(gate) * up: [T, I] in gate_up.dtype."""
    return _swiglu(gate_up)


def geglu(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU. gate_up: [T, 2I] (gate first, then up) -> gelu_tanh(gate) * up: [T, I] in gate_up.dtype."""
    return _geglu(gate_up)


# -- workbench ------------------------------------------------------------------------------

def _make_inputs(case: Case, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> dict:
    T, I = case.dims["T"], case.dims["I"]
    # scale 3 puts gates well into both tails, where silu/gelu saturate and the sigmoid's exp overflows
    gate_up = 3.0 * torch.randn(T, 2 * I, generator=gen, device=gen.device)  # [T, 2I]
    return {"gate_up": gate_up.to(device=device, dtype=dtype)}


def _bytes_moved(inputs: dict) -> int:
    gate_up = inputs["gate_up"]
    return gate_up.numel() * gate_up.element_size() * 3 // 2  # read gate and up, write half as much


SMALL_CASES = (
    Case("one-token", {"T": 1, "I": 256}, edge="1 token (decode): a single program"),
    Case("odd-width", {"T": 3, "I": 333}, edge="odd I: up starts at an odd offset, masked tail"),
    Case("multi-block", {"T": 2, "I": 1500}, edge="I > BLOCK_I: two column blocks per row, partial last one"),
    Case("many-rows", {"T": 65, "I": 24}, edge="narrow rows: 65 programs of 24 columns"),
)


def _model_cases() -> tuple[Case, ...]:
    cases = []
    for T, what in ((1, "decode"), (128, "prefill 128"), (8192, "prefill 8192")):
        cases.append(Case(f"llama3.1-8b-T{T}", {"T": T, "I": 14336}, edge=f"Llama-3.1-8B FFN, {what}"))
        # Qwen3-30B-A3B routes each token to 8 experts of FFN width 768: rows are (token, expert) pairs
        cases.append(Case(f"qwen3-30b-a3b-T{T}", {"T": 8 * T, "I": 768}, edge=f"Qwen3-30B-A3B experts, {what}"))
    return tuple(cases)


SWIGLU_SPEC = register_spec(OpSpec(
    op="swiglu",
    reference=swiglu_ref,
    make_inputs=_make_inputs,
    cases=SMALL_CASES,
    model_cases=_model_cases(),
    bytes_moved=_bytes_moved,
    flops=lambda inputs: 4 * inputs["gate_up"].numel() // 2,  # exp, add, divide, multiply per output
    out_arg="out",
    launch_config=GatedActivationConfig,
))

GEGLU_SPEC = register_spec(OpSpec(
    op="geglu",
    reference=geglu_ref,
    make_inputs=_make_inputs,
    cases=SMALL_CASES,
    model_cases=_model_cases(),
    bytes_moved=_bytes_moved,
    flops=lambda inputs: 9 * inputs["gate_up"].numel() // 2,  # the cubic polynomial, then as SwiGLU
    out_arg="out",
    launch_config=GatedActivationConfig,
))
