"""RMSNorm, and RMSNorm fused with the residual add that precedes it.

``y = x / sqrt(mean(x^2) + eps) * (offset + w)``; Gemma stores ``w`` so that the
scale is ``1 + w`` (``offset=1``), Llama uses ``offset=0``. ``add_rmsnorm`` first
forms the new residual stream ``s = x + residual`` (rounded to the activation dtype,
as the unfused pair of ops would store it) and returns ``(rmsnorm(s), s)``.

Layout: rows ``[T, D]`` with a contiguous last dimension (any row stride), weight ``[D]``.
Traffic: RMSNorm reads x and writes y, ``2·T·D`` elements (+ D for the weight);
the fused add reads x and residual and writes y and s, ``4·T·D``: unfused it would
be ``3·T·D`` for the add plus ``2·T·D`` for the norm. About 4 FLOPs per element, so
both are purely memory-bound (H200: ~4.2 TB/s against ~1000 dense bf16 TFLOP/s).

Sources: Zhang & Sennrich, "Root Mean Square Layer Normalization" (2019); the Gemma
``1 + w`` convention from the HF Gemma modeling code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from qml_kernels import pdl
from qml_kernels.registry import dispatch, register
from qml_kernels.workbench.spec import Case, OpSpec, register_spec

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class RMSNormConfig:
    """Launch tunables. ``None`` picks the size from the row width at launch time."""

    block_d: int | None = None  # row chunk width (power of 2); None: the whole row up to 8192, else 4096
    block_t: int | None = None  # rows per program; None: enough rows for a tile of ~2048 elements
    num_warps: int = 8

    def __post_init__(self):
        for name in ("block_d", "block_t"):
            value = getattr(self, name)
            if value is not None and (value < 1 or value & (value - 1)):
                raise ValueError(f"RMSNormConfig.{name} must be a power of 2, got {value}")

    def tile(self, T: int, D: int) -> tuple[int, int]:
        """(BLOCK_T, BLOCK_D) for rows of width D."""
        # 8192 fp32 values over 256 threads is 32 registers each: a whole Llama/Qwen row stays
        # in registers, so x is read from HBM exactly once. Wider rows take two passes anyway,
        # and half-width chunks halve the live sum-of-squares accumulator.
        block_d = self.block_d or (triton.next_power_of_2(D) if D <= 8192 else 4096)
        # narrow rows (per-head q/k norm, D=128) would leave most of a program's lanes idle
        block_t = self.block_t or max(1, 2048 // block_d)
        return min(block_t, triton.next_power_of_2(T)), block_d


@triton.jit
def _rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    T, D, stride_x, stride_res, stride_out, stride_res_out,
    eps, offset,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, ONE_CHUNK: tl.constexpr, ADD_RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,
):
    # one program normalises BLOCK_T rows; res_ptr/res_out_ptr are unused unless ADD_RESIDUAL
    pdl.enter(PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    rows = rows.to(tl.int64)  # T * stride passes 2^31 for long prefills of wide rows
    row_ok = rows < T
    cols = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    x_rows = x_ptr + rows[:, None] * stride_x
    out_rows = out_ptr + rows[:, None] * stride_out
    res_rows = res_ptr + rows[:, None] * stride_res
    res_out_rows = res_out_ptr + rows[:, None] * stride_res_out

    if ONE_CHUNK:
        mask = row_ok[:, None] & (cols[None, :] < D)  # [BLOCK_T, BLOCK_D]
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if ADD_RESIDUAL:
            r = tl.load(res_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            s = (x + r).to(res_out_ptr.dtype.element_ty)
            tl.store(res_out_rows + cols[None, :], s, mask=mask)
            # normalise the stored (rounded) sum, so y is exactly rmsnorm of what the next layer reads
            x = s.to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)  # [BLOCK_T]
        w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)  # [BLOCK_D]
        y = x * inv_rms[:, None] * (offset + w)[None, :]
        tl.store(out_rows + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        # rows wider than one chunk: a first pass for the sum of squares, a second to scale.
        # The second pass re-reads x (or the sum it stored), which is mostly served by L2.
        sq = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
        for start in range(0, D, BLOCK_D):
            c = start + cols
            mask = row_ok[:, None] & (c[None, :] < D)
            x = tl.load(x_rows + c[None, :], mask=mask, other=0.0).to(tl.float32)
            if ADD_RESIDUAL:
                r = tl.load(res_rows + c[None, :], mask=mask, other=0.0).to(tl.float32)
                s = (x + r).to(res_out_ptr.dtype.element_ty)
                tl.store(res_out_rows + c[None, :], s, mask=mask)
                x = s.to(tl.float32)
            sq += x * x
        inv_rms = tl.rsqrt(tl.sum(sq, axis=1) / D + eps)  # [BLOCK_T]
        for start in range(0, D, BLOCK_D):
            c = start + cols
            mask = row_ok[:, None] & (c[None, :] < D)
            # the same thread that stored s reads it back (same layout), so no barrier is needed
            if ADD_RESIDUAL:
                x = tl.load(res_out_rows + c[None, :], mask=mask, other=0.0).to(tl.float32)
            else:
                x = tl.load(x_rows + c[None, :], mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + c, mask=c < D, other=0.0).to(tl.float32)
            y = x * inv_rms[:, None] * (offset + w)[None, :]
            tl.store(out_rows + c[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def _check_rows(name: str, t: torch.Tensor, like: torch.Tensor) -> None:
    assert t.shape == like.shape, f"{name}: shape {tuple(t.shape)}, expected {tuple(like.shape)}"
    assert t.dtype == like.dtype, f"{name}: dtype {t.dtype}, expected {like.dtype}"
    assert t.device == like.device, f"{name}: device {t.device}, expected {like.device}"
    assert t.stride(-1) == 1, f"{name}: the last dimension must be contiguous, strides {t.stride()}"


def _launch(x, residual, weight, eps, offset, out, residual_out, config: RMSNormConfig) -> None:
    assert x.dim() == 2, f"x must be [T, D], got shape {tuple(x.shape)}"
    assert x.dtype in _FLOAT_DTYPES, f"x: unsupported dtype {x.dtype}"
    assert x.stride(-1) == 1, f"x: the last dimension must be contiguous, strides {x.stride()}"
    T, D = x.shape
    assert weight.shape == (D,), f"weight must be [{D}], got {tuple(weight.shape)}"
    assert weight.is_contiguous() and weight.dtype in _FLOAT_DTYPES, "weight: contiguous fp32/fp16/bf16"
    assert weight.device == x.device, f"weight on {weight.device}, x on {x.device}"
    _check_rows("out", out, x)
    if residual is not None:
        _check_rows("residual", residual, x)
        _check_rows("residual_out", residual_out, x)
    if T == 0:
        return
    block_t, block_d = config.tile(T, D)
    res, res_out = (residual, residual_out) if residual is not None else (x, out)
    _rmsnorm_kernel[(triton.cdiv(T, block_t),)](
        x, res, weight, out, res_out,
        T, D, x.stride(0), res.stride(0), out.stride(0), res_out.stride(0),
        float(eps), float(offset),
        BLOCK_T=block_t, BLOCK_D=block_d, ONE_CHUNK=D <= block_d, ADD_RESIDUAL=residual is not None,
        num_warps=config.num_warps, **pdl.launch_args(x),
    )


def rmsnorm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0, *,
                   out: torch.Tensor | None = None, config: RMSNormConfig = RMSNormConfig()) -> torch.Tensor:
    """x: [T, D], weight: [D] -> [T, D] in x.dtype. ``out`` may be ``x`` (in place)."""
    out = torch.empty_like(x) if out is None else out
    _launch(x, None, weight, eps, offset, out, None, config)
    return out


def add_rmsnorm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0, *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None, config: RMSNormConfig = RMSNormConfig(),
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [T, D], weight: [D] -> (normed [T, D], x + residual [T, D]), both in x.dtype.

    ``out`` mirrors the return value: a pair ``(normed, summed)`` of [T, D] tensors. In place
    is allowed: ``out=(x, residual)`` overwrites both inputs, because every element is read
    before it is written, by the thread that writes it.
    """
    if out is None:
        out = (torch.empty_like(x), torch.empty_like(x))
    assert isinstance(out, (tuple, list)) and len(out) == 2, "out must be a pair (normed, summed)"
    _launch(x, residual, weight, eps, offset, out[0], out[1], config)
    return out[0], out[1]


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


def _supported(x, *rest, **kwargs) -> bool:
    tensors = [x, *(t for t in (*rest, *kwargs.values()) if isinstance(t, torch.Tensor))]
    return (x.dim() == 2 and x.dtype in _FLOAT_DTYPES
            and all(t.stride(-1) == 1 and t.dtype in _FLOAT_DTYPES for t in tensors))


register("rmsnorm", "reference", rmsnorm_ref)
register("rmsnorm", "triton", rmsnorm_triton, devices=("cuda",), supports=_supported)
register("add_rmsnorm", "reference", add_rmsnorm_ref)
register("add_rmsnorm", "triton", add_rmsnorm_triton, devices=("cuda",), supports=_supported)

_rmsnorm = dispatch("rmsnorm")
_add_rmsnorm = dispatch("add_rmsnorm")


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """RMSNorm of each row. x: [T, D], weight: [D] -> [T, D] in x.dtype (scale is ``offset + weight``)."""
    return _rmsnorm(x, weight, eps, offset)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [T, D], weight: [D] -> (rmsnorm(x + residual) [T, D], x + residual [T, D])."""
    return _add_rmsnorm(x, residual, weight, eps, offset)


# -- workbench ------------------------------------------------------------------------------

def _make_inputs(case: Case, dtype: torch.dtype, device: torch.device, gen: torch.Generator,
                 with_residual: bool) -> dict:
    T, D = case.dims["T"], case.dims["D"]
    offset = case.dims.get("offset", 0.0)

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen, device=gen.device)).to(device=device, dtype=dtype)

    # Gemma's stored weights sit near 0 (scale 1 + w); Llama's near 1
    weight = randn(D, scale=0.1) + (1.0 - offset)
    inputs = {"x": randn(T, D, scale=2.0)}
    if with_residual:
        inputs["residual"] = randn(T, D, scale=2.0)
    return {**inputs, "weight": weight, "eps": case.dims.get("eps", 1e-6), "offset": offset}


def _make_rmsnorm_inputs(case, dtype, device, gen):
    return _make_inputs(case, dtype, device, gen, with_residual=False)


def _make_add_rmsnorm_inputs(case, dtype, device, gen):
    return _make_inputs(case, dtype, device, gen, with_residual=True)


def _rmsnorm_bytes(inputs: dict) -> int:
    x, w = inputs["x"], inputs["weight"]
    return 2 * x.numel() * x.element_size() + w.numel() * w.element_size()  # read x, write y; weight


def _add_rmsnorm_bytes(inputs: dict) -> int:
    x, w = inputs["x"], inputs["weight"]
    return 4 * x.numel() * x.element_size() + w.numel() * w.element_size()  # read x, r; write y, s


SMALL_CASES = (
    Case("one-token", {"T": 1, "D": 256}, edge="1 token (decode), one row per program"),
    Case("odd-hidden", {"T": 5, "D": 321}, edge="odd D: masked tail of the only chunk"),
    Case("narrow-rows", {"T": 37, "D": 64}, edge="D=64: several rows per program, last tile half empty"),
    Case("gemma-offset", {"T": 4, "D": 640, "offset": 1.0, "eps": 1e-6},
         edge="scale = 1 + w (Gemma-3-270M hidden), non-power-of-2 D"),
    Case("long-row", {"T": 1, "D": 8195, "eps": 1e-5},
         edge="D > 8192: three 4096-wide chunks, the two-pass path, odd tail"),
)


def _model_cases(extra: tuple[Case, ...] = ()) -> tuple[Case, ...]:
    cases = []
    for T, what in ((1, "decode"), (128, "prefill 128"), (8192, "prefill 8192")):
        cases.append(Case(f"llama3.1-8b-T{T}", {"T": T, "D": 4096, "eps": 1e-5}, edge=f"Llama-3.1-8B {what}"))
        cases.append(Case(f"qwen3-30b-a3b-T{T}", {"T": T, "D": 2048, "eps": 1e-6}, edge=f"Qwen3-30B-A3B {what}"))
    return (*cases, *extra)


# Qwen3 normalises q and k per head (D = head_dim = 128) before RoPE: rows = tokens x heads
_QK_NORM_CASES = tuple(
    Case(f"qwen3-q-norm-T{T}", {"T": T * 32, "D": 128, "eps": 1e-6}, edge=f"per-head q norm, {T} tokens x 32 heads")
    for T in (1, 128, 8192)
)

RMSNORM_SPEC = register_spec(OpSpec(
    op="rmsnorm",
    reference=rmsnorm_ref,
    make_inputs=_make_rmsnorm_inputs,
    cases=SMALL_CASES,
    model_cases=_model_cases(_QK_NORM_CASES),
    bytes_moved=_rmsnorm_bytes,
    flops=lambda inputs: 4 * inputs["x"].numel(),  # square, sum, scale by 1/rms, scale by w
    out_arg="out",
    launch_config=RMSNormConfig,
))

ADD_RMSNORM_SPEC = register_spec(OpSpec(
    op="add_rmsnorm",
    reference=add_rmsnorm_ref,
    make_inputs=_make_add_rmsnorm_inputs,
    cases=SMALL_CASES,
    model_cases=_model_cases(),
    bytes_moved=_add_rmsnorm_bytes,
    flops=lambda inputs: 5 * inputs["x"].numel(),  # the add, then rmsnorm's four
    out_arg="out",
    launch_config=RMSNormConfig,
    notes="returns a pair; `out` is a pair (normed, summed) mirroring it. In place: out=(x, residual).",
))
