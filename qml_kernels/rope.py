"""Rotary position embedding (RoPE) applied to q and k together.

Two layouts pair the rotated dimensions differently:
- rotate-half (HF / NeoX): dimension i pairs with i + R/2;
- interleaved (GPT-J, what llama.cpp's GGUF Llama weights are permuted for): 2i pairs with 2i+1.
Only the first R = ``rotary_dim`` dimensions of each head rotate; the rest pass through.

Frequencies: plain ``theta^(-2i/R)``, optionally rescaled for long context by the
``llama3`` rule (Llama 3.1), ``linear`` interpolation, or YaRN (which also scales
cos/sin by an attention factor).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


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
    """Returns (inv_freq [R/2] fp32, attention_scaling): the angle per position of each pair."""
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


def rope_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False):
    """q: [T, H, Dh], k: [T, Hkv, Dh], cos/sin: [T, R/2] -> rotated (q, k) in their dtypes."""
    return _rotate(q, cos, sin, interleaved).to(q.dtype), _rotate(k, cos, sin, interleaved).to(k.dtype)


def rope(q, k, cos, sin, interleaved: bool = False):
    return rope_ref(q, k, cos, sin, interleaved)
