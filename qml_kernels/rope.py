"""Rotary position embedding (RoPE) applied to q and k together, in one launch.

Each rotated pair ``(a, b)`` of a head at a token with angle ``θ`` becomes
``(a·cos θ - b·sin θ, b·cos θ + a·sin θ)``. Two layouts pair the dimensions differently:
- rotate-half (HF / NeoX): dimension i pairs with i + R/2;
- interleaved (GPT-J, what llama.cpp's GGUF Llama weights are permuted for): 2i pairs with 2i+1.
Only the first R = ``2 * cos.shape[-1]`` dimensions of each head rotate (partial rotary);
the rest pass through unchanged.

Layouts: q ``[T, H, Dh]`` and k ``[T, Hkv, Dh]`` with a contiguous last dimension and
any token/head strides (they are usually views into the fused QKV projection), cos/sin
``[T, R/2]`` fp32 from ``rope_cos_sin``.
Traffic: one read and one write of every q/k element plus the tables: per token of
Llama-3.1-8B in bf16, 2·40·128·2 B = 20 KiB of q/k against 512 B of cos/sin, at
3 FLOPs per rotated element: purely memory-bound. The tables are computed once per
forward pass and shared by every layer; computing cos/sin inside the kernel would save at
most those 2.5% of the bytes, at the price of fp32 sin/cos of angles up to ~1e5 rad on
the GPU, so the kernel reads them.

Frequencies: plain ``theta^(-2i/R)``, optionally rescaled for long context by the
``llama3`` rule (Llama 3.1), ``linear`` interpolation, or YaRN (which also scales
cos/sin by an attention factor).

Sources: Su et al., "RoFormer" (2021); Peng et al., "YaRN" (2023); the rope_type rules of
HF transformers' ``modeling_rope_utils`` (llama3, linear, yarn), which the tests compare against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from qml_kernels.registry import dispatch, register
from qml_kernels.workbench.spec import Case, OpSpec, register_spec

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# -- frequencies ----------------------------------------------------------------------------

@dataclass(frozen=True)
class RopeScaling:
    kind: str  # "linear" | "llama3" | "yarn"
    factor: float
    original_max_position: int = 0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn: round the ramp bounds to whole dimensions
    attention_factor: float | None = None  # yarn: cos/sin scale; default 0.1 ln(factor) + 1

    def __post_init__(self):
        if self.kind not in ("linear", "llama3", "yarn"):
            raise ValueError(f"unknown rope scaling {self.kind!r} (linear, llama3 and yarn are supported)")
        if self.factor <= 0:
            raise ValueError(f"rope scaling factor must be positive, got {self.factor}")
        if self.kind in ("llama3", "yarn") and self.original_max_position <= 0:
            raise ValueError(f"{self.kind} rope scaling needs original_max_position")


def rope_inv_freq(rotary_dim: int, theta: float, scaling: RopeScaling | None = None) -> tuple[torch.Tensor, float]:
    """Returns (inv_freq [R/2] fp32, attention_scaling): the angle per position of each pair.

    Computed in fp64 and rounded once, so it can differ from transformers' fp32
    computation by a few units in the last place.
    """
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim  # [R/2]
    inv_freq = 1.0 / theta**exponents
    if scaling is None:
        return inv_freq.float(), 1.0
    if scaling.kind == "linear":
        return (inv_freq / scaling.factor).float(), 1.0
    if scaling.kind == "llama3":
        # wavelengths shorter than orig/high_freq_factor keep their frequency, longer than
        # orig/low_freq_factor are divided by factor, and those between are blended smoothly
        wavelen = 2 * math.pi / inv_freq
        orig = scaling.original_max_position
        smooth = (orig / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
        out = torch.where(wavelen < orig / scaling.high_freq_factor, inv_freq, blended)
        out = torch.where(wavelen > orig / scaling.low_freq_factor, inv_freq / scaling.factor, out)
        return out.float(), 1.0
    # yarn: dimensions that rotate many times within the original context keep their
    # frequency (extrapolate), slow ones are interpolated by factor, with a linear ramp between
    orig = scaling.original_max_position

    def dim_for(rotations: float) -> float:
        return rotary_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_for(scaling.beta_fast), dim_for(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    idx = torch.arange(rotary_dim // 2, dtype=torch.float64)
    ramp = ((idx - low) / (high - low)).clamp(0, 1)  # 0: keep frequency, 1: interpolate
    out = inv_freq * (1 - ramp) + inv_freq / scaling.factor * ramp
    attn = scaling.attention_factor
    if attn is None:
        attn = 0.1 * math.log(scaling.factor) + 1.0 if scaling.factor > 1 else 1.0
    return out.float(), attn


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float = 1.0):
    """positions: [T] int -> (cos, sin): [T, R/2] fp32."""
    angles = positions.to(torch.float32)[:, None] * inv_freq.to(positions.device)[None, :]  # [T, R/2]
    return angles.cos() * attention_scaling, angles.sin() * attention_scaling


# -- kernel ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class RopeConfig:
    """Launch tunables. ``block_h=None`` picks the heads per program from the rotary width."""

    # heads per program (power of 2); 16 was fastest on the H200 for head_dim 128 in both layouts
    # (benchmarks/results/sweep-h200-all-2026-11-30.md); None derives it from the rotary width
    block_h: int | None = 16
    num_warps: int = 4

    def __post_init__(self):
        if self.block_h is not None and (self.block_h < 1 or self.block_h & (self.block_h - 1)):
            raise ValueError(f"RopeConfig.block_h must be a power of 2, got {self.block_h}")

    def heads_per_program(self, max_heads: int, block_half: int) -> int:
        # 16-byte vectors need 8 bf16 per thread in each half-tile: 8 * 32 * num_warps elements
        wanted = self.block_h or max(1, 8 * 32 * self.num_warps // block_half)
        return min(wanted, triton.next_power_of_2(max_heads))


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr,
    H, HKV,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h,
    stride_qo_t, stride_qo_h, stride_ko_t, stride_ko_h,
    stride_cos_t, stride_sin_t,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr, INTERLEAVED: tl.constexpr, COPY_PASS: tl.constexpr,
):
    # grid: (tokens, head blocks of q then of k); tokens go on axis 0, the only one that
    # is not capped at 65535 programs
    t = tl.program_id(0).to(tl.int64)  # T * stride passes 2^31 for long prefills of fused QKV rows
    block = tl.program_id(1)
    q_blocks = tl.cdiv(H, BLOCK_H)
    # a handful of scalar selects let one straight-line body serve both tensors
    is_q = block < q_blocks
    src = tl.where(is_q, q_ptr + t * stride_q_t, k_ptr + t * stride_k_t)
    dst = tl.where(is_q, q_out_ptr + t * stride_qo_t, k_out_ptr + t * stride_ko_t)
    stride_src_h = tl.where(is_q, stride_q_h, stride_k_h)
    stride_dst_h = tl.where(is_q, stride_qo_h, stride_ko_h)
    n_heads = tl.where(is_q, H, HKV)
    heads = tl.where(is_q, block, block - q_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    head_ok = heads[:, None] < n_heads  # [BLOCK_H, 1]
    src_rows = src + heads[:, None] * stride_src_h  # [BLOCK_H, 1]
    dst_rows = dst + heads[:, None] * stride_dst_h

    i = tl.arange(0, BLOCK_HALF)  # [BLOCK_HALF] pair index
    c = tl.load(cos_ptr + t * stride_cos_t + i, mask=i < HALF, other=0.0)[None, :]  # [1, BLOCK_HALF]
    s = tl.load(sin_ptr + t * stride_sin_t + i, mask=i < HALF, other=0.0)[None, :]
    if INTERLEAVED:
        # one contiguous load of the rotated span, then split the pairs in registers: two
        # stride-2 loads would issue scalar instead of 16-byte vector loads
        d = tl.arange(0, 2 * BLOCK_HALF)[None, :]  # [1, 2 * BLOCK_HALF]
        mask = head_ok & (d < 2 * HALF)
        x = tl.load(src_rows + d, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_H, 2 * BLOCK_HALF]
        a, b = tl.split(tl.reshape(x, (BLOCK_H, BLOCK_HALF, 2)))  # [BLOCK_H, BLOCK_HALF] each
        y = tl.reshape(tl.join(a * c - b * s, b * c + a * s), (BLOCK_H, 2 * BLOCK_HALF))
        tl.store(dst_rows + d, y.to(dst.dtype.element_ty), mask=mask)
    else:
        mask = head_ok & (i[None, :] < HALF)  # [BLOCK_H, BLOCK_HALF]
        a = tl.load(src_rows + i[None, :], mask=mask, other=0.0).to(tl.float32)
        b = tl.load(src_rows + HALF + i[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(dst_rows + i[None, :], (a * c - b * s).to(dst.dtype.element_ty), mask=mask)
        tl.store(dst_rows + HALF + i[None, :], (b * c + a * s).to(dst.dtype.element_ty), mask=mask)
    if COPY_PASS:
        p = 2 * HALF + tl.arange(0, BLOCK_PASS)[None, :]  # [1, BLOCK_PASS]
        mask = head_ok & (p < HEAD_DIM)
        tl.store(dst_rows + p, tl.load(src_rows + p, mask=mask), mask=mask)


def _check_heads(name: str, t: torch.Tensor, T: int, Dh: int) -> None:
    assert t.dim() == 3, f"{name} must be [T, heads, Dh], got shape {tuple(t.shape)}"
    assert t.shape[0] == T and t.shape[2] == Dh, f"{name}: shape {tuple(t.shape)}, expected [{T}, *, {Dh}]"
    assert t.stride(-1) == 1, f"{name}: the last dimension must be contiguous, strides {t.stride()}"


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.stride() == b.stride()


def rope_triton(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False,
                *, out: tuple[torch.Tensor, torch.Tensor] | None = None,
                config: RopeConfig = RopeConfig()) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, H, Dh], k: [T, Hkv, Dh], cos/sin: [T, R/2] fp32 -> rotated (q, k) in q's dtype.

    ``out`` mirrors the return value: a pair ``(q_out, k_out)`` shaped like q and k, with any
    token/head strides. In place is allowed and is what the engine wants: ``out=(q, k)``
    rotates the views of the fused QKV buffer where they lie (each program reads all of its
    elements before it writes any, and no two programs share one). Outputs must otherwise not
    overlap the inputs.
    """
    T, H, Dh = q.shape if q.dim() == 3 else (0, 0, 0)
    _check_heads("q", q, T, Dh)
    _check_heads("k", k, T, Dh)
    assert q.dtype in _FLOAT_DTYPES and k.dtype == q.dtype, f"q, k: one float dtype, got {q.dtype}, {k.dtype}"
    half = cos.shape[-1] if cos.dim() == 2 else -1
    for name, table in (("cos", cos), ("sin", sin)):
        assert table.shape == (T, half), f"{name} must be [T, R/2] = [{T}, {half}], got {tuple(table.shape)}"
        assert table.dtype == torch.float32, f"{name} must be fp32, got {table.dtype}"
        assert table.stride(-1) == 1, f"{name}: the last dimension must be contiguous, strides {table.stride()}"
    assert 0 < 2 * half <= Dh, f"rotary dim 2 * {half} must be in (0, head_dim {Dh}]"
    if out is None:
        out = (torch.empty(q.shape, dtype=q.dtype, device=q.device),
               torch.empty(k.shape, dtype=k.dtype, device=k.device))
    assert isinstance(out, (tuple, list)) and len(out) == 2, "out must be a pair (q_out, k_out)"
    q_out, k_out = out
    for name, o, like in (("q_out", q_out, q), ("k_out", k_out, k)):
        assert o.shape == like.shape, f"{name}: shape {tuple(o.shape)}, expected {tuple(like.shape)}"
        assert o.dtype == like.dtype, f"{name}: dtype {o.dtype}, expected {like.dtype}"
        assert o.stride(-1) == 1, f"{name}: the last dimension must be contiguous, strides {o.stride()}"
    devices = {t.device for t in (q, k, cos, sin, q_out, k_out)}
    assert len(devices) == 1, f"all tensors must be on one device, got {sorted(map(str, devices))}"
    Hkv = k.shape[1]
    if T == 0 or H + Hkv == 0:
        return q_out, k_out

    # in place, the pass-through dimensions are already where they belong
    in_place = _same_view(q_out, q) and _same_view(k_out, k)
    constexprs = _constexprs(H, Hkv, Dh, half, interleaved, in_place, config)
    block_h = constexprs["BLOCK_H"]
    grid = (T, triton.cdiv(H, block_h) + triton.cdiv(Hkv, block_h))
    _rope_kernel[grid](
        q, k, q_out, k_out, cos, sin,
        H, Hkv,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        cos.stride(0), sin.stride(0),
        **constexprs, num_warps=config.num_warps,
    )
    return q_out, k_out


def _constexprs(H: int, Hkv: int, Dh: int, half: int, interleaved: bool, in_place: bool,
                config: RopeConfig) -> dict:
    """The kernel's compile-time parameters for heads of width Dh with R/2 = half rotated pairs."""
    block_half = triton.next_power_of_2(half)
    pass_dims = Dh - 2 * half
    return {"HEAD_DIM": Dh, "HALF": half, "BLOCK_H": config.heads_per_program(max(H, Hkv), block_half),
            "BLOCK_HALF": block_half, "BLOCK_PASS": triton.next_power_of_2(max(pass_dims, 1)),
            "INTERLEAVED": bool(interleaved), "COPY_PASS": pass_dims > 0 and not in_place}


# -- reference ------------------------------------------------------------------------------

def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x: [T, H, Dh] -> rotated copy in fp32; cos/sin: [T, R/2]."""
    x = x.float()
    half = cos.shape[-1]
    rot = 2 * half
    c, s = cos[:, None, :], sin[:, None, :]  # [T, 1, R/2]
    if interleaved:
        x1, x2 = x[..., 0:rot:2], x[..., 1:rot:2]  # [T, H, R/2]
        rotated = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)  # [T, H, R]
    else:
        x1, x2 = x[..., :half], x[..., half:rot]
        rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)  # [T, H, R]
    return torch.cat((rotated, x[..., rot:]), dim=-1)


def rope_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False,
             *, out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, H, Dh], k: [T, Hkv, Dh], cos/sin: [T, R/2] -> rotated (q, k) in their dtypes."""
    q_rot = _rotate(q, cos, sin, interleaved).to(q.dtype)
    k_rot = _rotate(k, cos, sin, interleaved).to(k.dtype)
    if out is None:
        return q_rot, k_rot
    out[0].copy_(q_rot)
    out[1].copy_(k_rot)
    return out[0], out[1]


def _supported(q, k, cos, sin, *rest, **kwargs) -> bool:
    return (q.dim() == 3 and k.dim() == 3 and cos.dim() == 2 and q.dtype in _FLOAT_DTYPES
            and k.dtype == q.dtype and k.shape[2] == q.shape[2] and 0 < 2 * cos.shape[-1] <= q.shape[2]
            and cos.dtype == sin.dtype == torch.float32
            and all(t.stride(-1) == 1 for t in (q, k, cos, sin)))


register("rope", "reference", rope_ref)
register("rope", "triton", rope_triton, devices=("cuda",), supports=_supported)

_rope = dispatch("rope")


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False,
         *, out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q: [T, H, Dh] and k: [T, Hkv, Dh] by cos/sin: [T, R/2] -> (q, k).

    New tensors by default; ``out=(q, k)`` rotates in place (views with any token/head strides).
    """
    return _rope(q, k, cos, sin, interleaved, out=out)


# -- workbench ------------------------------------------------------------------------------

def _make_inputs(case: Case, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> dict:
    d = case.dims
    T, H, Hkv, Dh = d["T"], d["H"], d["Hkv"], d["Dh"]
    R = d.get("R", Dh)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=gen.device).to(device=device, dtype=dtype)

    if d.get("fused", False):
        # q and k as the engine sees them: views into one [T, (H + 2 Hkv) Dh] projection
        qkv = randn(T, (H + 2 * Hkv) * Dh)
        q, k = qkv[:, : H * Dh].view(T, H, Dh), qkv[:, H * Dh: (H + Hkv) * Dh].view(T, Hkv, Dh)
    else:
        q, k = randn(T, H, Dh), randn(T, Hkv, Dh)
    positions = torch.randint(0, 1 << 15, (T,), generator=gen, device=gen.device).to(device)
    inv_freq, _ = rope_inv_freq(R, d.get("theta", 10000.0))
    cos, sin = rope_cos_sin(positions, inv_freq)
    return {"q": q, "k": k, "cos": cos, "sin": sin, "interleaved": d.get("interleaved", False)}


def _bytes(inputs: dict) -> int:
    q, k, cos = inputs["q"], inputs["k"], inputs["cos"]
    # read and write every q/k element (the pass-through ones are copied), read cos and sin
    return 2 * (q.numel() + k.numel()) * q.element_size() + 2 * cos.numel() * cos.element_size()


def _flops(inputs: dict) -> int:
    q, k, cos = inputs["q"], inputs["k"], inputs["cos"]
    pairs = (q.shape[1] + k.shape[1]) * cos.numel()  # T * (H + Hkv) * R/2
    return 6 * pairs  # 4 multiplies and 2 adds per pair


SMALL_CASES = (
    Case("one-token", {"T": 1, "H": 4, "Hkv": 2, "Dh": 64}, edge="1 token (decode), GQA"),
    Case("mqa-interleaved", {"T": 5, "H": 3, "Hkv": 1, "Dh": 32, "interleaved": True},
         edge="interleaved pairs, odd H, one kv head"),
    Case("partial-rotary", {"T": 3, "H": 4, "Hkv": 2, "Dh": 64, "R": 32},
         edge="R = Dh/2: half of each head passes through"),
    Case("partial-interleaved", {"T": 3, "H": 2, "Hkv": 2, "Dh": 80, "R": 32, "interleaved": True},
         edge="head_dim 80, R 32 (phi-2 style): non-power-of-2 pass-through tail"),
    Case("odd-half", {"T": 2, "H": 3, "Hkv": 1, "Dh": 48, "interleaved": True},
         edge="R/2 = 24: masked tail of the pair block, interleaved"),
    Case("odd-half-rotate", {"T": 2, "H": 2, "Hkv": 2, "Dh": 48, "R": 40},
         edge="R/2 = 20 rotate-half with an 8-dim pass-through"),
    Case("fused-views", {"T": 3, "H": 10, "Hkv": 2, "Dh": 32, "fused": True},
         edge="strided views of a fused QKV row; q spans two head blocks, the last partly masked"),
)


def _model_cases() -> tuple[Case, ...]:
    cases = []
    for T, what in ((1, "decode"), (128, "prefill 128"), (8192, "prefill 8192")):
        cases.append(Case(f"llama3.1-8b-T{T}", {"T": T, "H": 32, "Hkv": 8, "Dh": 128, "theta": 500000.0,
                                                 "fused": True}, edge=f"Llama-3.1-8B {what}, fused QKV views"))
        cases.append(Case(f"qwen3-30b-a3b-T{T}", {"T": T, "H": 32, "Hkv": 4, "Dh": 128, "theta": 1e6},
                          edge=f"Qwen3-30B-A3B {what} (q/k are contiguous after q_norm/k_norm)"))
    cases.append(Case("llama3.1-8b-gguf-T8192", {"T": 8192, "H": 32, "Hkv": 8, "Dh": 128, "theta": 500000.0,
                                                  "fused": True, "interleaved": True},
                      edge="Llama-3.1-8B GGUF: interleaved pairs, prefill 8192"))
    return tuple(cases)


ROPE_SPEC = register_spec(OpSpec(
    op="rope",
    reference=rope_ref,
    make_inputs=_make_inputs,
    cases=SMALL_CASES,
    model_cases=_model_cases(),
    bytes_moved=_bytes,
    flops=_flops,
    out_arg="out",
    launch_config=RopeConfig,
    notes="returns a pair; `out` is a pair (q_out, k_out) mirroring it. In place: out=(q, k).",
))
