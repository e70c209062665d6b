"""RoPE on q and k fused with the write of k and v into the paged KV cache, in one launch.

Computes what ``rope`` followed by ``kv_write`` computes: q is rotated (in place when
``out=q``), k is rotated and written, with v unrotated, to the cache slots of ``slot_mapping``
(slot = page * S + offset; a negative slot skips that token's K/V, as for padding rows). The
rotated k is never written back to the QKV buffer: attention reads K only from the cache.
Rotation layouts are rope's: rotate-half (i pairs with i + R/2) or interleaved pairs (2i with
2i+1), over the first R = ``2 * cos.shape[-1]`` dims of each head; the rest pass through.

Layouts: q ``[T, H, Dh]``, k and v ``[T, Hkv, Dh]`` with a contiguous last dimension and any
token/head strides (views into the fused QKV projection), cos/sin ``[T, R/2]`` fp32, caches
``[P, S, Hkv, Dh]`` (last dimension contiguous, any other strides), ``slot_mapping [T]`` int.
Traffic per token of Llama-3.1-8B in bf16: read q, k, v (48 heads x 256 B = 12 KiB) and cos/sin
(512 B), write q in place and k, v into the cache (12 KiB), at 3 FLOPs per rotated element:
memory-bound. The unfused pair moves at least 28 KiB (rope writes k back, kv_write reads it
again, and its boolean gather of the valid slots copies k and v once more) over several
launches, and that gather waits for the device to count the valid slots; here it is one
launch with no host sync, which a decode step captured in a CUDA graph needs.

Sources: Su et al., "RoFormer" (2021) for the rotation; Kwon et al., "Efficient Memory
Management for LLM Serving with PagedAttention" (2023) for the slot-mapped page layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from qml_kernels import pdl
from qml_kernels.attention import kv_write_ref
from qml_kernels.registry import dispatch, register
from qml_kernels.rope import rope_cos_sin, rope_inv_freq, rope_ref
from qml_kernels.workbench.spec import Case, OpSpec, register_spec

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_SLOT_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class RopeKVWriteConfig:
    """Launch tunables; None derives each from the shapes (see ``resolve``).

    A program handles one token's block of q heads, or one token's block of kv heads (k and v
    together). Hkv is small (4-8), so the kv half-tile ``[Hkv, R/2]`` is what limits the vector
    width: ``num_warps`` defaults to the most warps (up to 4) that still give each thread 8
    elements of it, i.e. 16-byte bf16 loads and stores.
    """

    block_h: int | None = None  # q heads per program (power of 2)
    block_hkv: int | None = None  # kv heads per program (power of 2)
    num_warps: int | None = None

    def __post_init__(self):
        for name in ("block_h", "block_hkv", "num_warps"):
            value = getattr(self, name)
            if value is not None and (value < 1 or value & (value - 1)):
                raise ValueError(f"RopeKVWriteConfig.{name} must be a power of 2, got {value}")

    def resolve(self, H: int, Hkv: int, block_half: int) -> tuple[int, int, int]:
        """(q heads per program, kv heads per program, warps) for R/2 pairs padded to block_half."""
        block_hkv = min(self.block_hkv or 16, triton.next_power_of_2(max(Hkv, 1)))
        threads_for_16_bytes = block_hkv * block_half // 8
        num_warps = self.num_warps or max(1, min(4, _floor_pow2(threads_for_16_bytes // 32)))
        # two 16-byte vectors per thread in each q half-tile: for Llama's and Qwen3's shapes a q
        # program then moves as many bytes as a kv program moves for k and v together
        block_h = self.block_h or max(1, 16 * 32 * num_warps // block_half)
        return min(block_h, triton.next_power_of_2(max(H, 1))), block_hkv, num_warps


def _floor_pow2(n: int) -> int:
    return 1 << (n.bit_length() - 1) if n > 0 else 0


@triton.jit
def _inv_rms(src, rows_ok, eps, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """1 / sqrt(mean(x^2) + eps) over each row of src [BLOCK_H, 1] (whole heads), fp32 -> [BLOCK_H, 1]."""
    d = tl.arange(0, BLOCK_D)[None, :]
    x = tl.load(src + d, mask=rows_ok & (d < HEAD_DIM), other=0.0).to(tl.float32)
    return 1.0 / tl.sqrt(tl.sum(x * x, axis=1)[:, None] / HEAD_DIM + eps)


@triton.jit
def _rotate_rows(src, dst, rows_ok, cos_row, sin_row, inv_rms, w_ptr,
                 HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, INTERLEAVED: tl.constexpr,
                 HAS_NORM: tl.constexpr):
    """Rotates the first 2 * HALF dims of the rows src [BLOCK_H, 1] into dst, computing in fp32.
    HAS_NORM: each element is first scaled by its row's ``inv_rms`` [BLOCK_H, 1] and its dim's
    weight (``w_ptr``, [Dh]): the RMSNorm that Qwen3 applies to each q and k head before RoPE."""
    i = tl.arange(0, BLOCK_HALF)[None, :]  # [1, BLOCK_HALF] pair index
    # cos/sin are loaded as a full tile in the rows' own layout (the repeats hit L1): a 1-D load
    # as wide as the program's threads is reshuffled through shared memory behind barriers
    pairs = tl.zeros((BLOCK_H, BLOCK_HALF), dtype=tl.int32) + i  # [BLOCK_H, BLOCK_HALF]
    c = tl.load(cos_row + pairs, mask=rows_ok & (i < HALF), other=0.0)
    s = tl.load(sin_row + pairs, mask=rows_ok & (i < HALF), other=0.0)
    if INTERLEAVED:
        # one contiguous load of the pairs, split in registers: stride-2 loads would not vectorise
        d = tl.arange(0, 2 * BLOCK_HALF)[None, :]  # [1, 2 * BLOCK_HALF]
        mask = rows_ok & (d < 2 * HALF)
        x = tl.load(src + d, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_H, 2 * BLOCK_HALF]
        if HAS_NORM:
            x = x * inv_rms * tl.load(w_ptr + d, mask=d < 2 * HALF, other=0.0).to(tl.float32)
        a, b = tl.split(tl.reshape(x, (BLOCK_H, BLOCK_HALF, 2)))  # [BLOCK_H, BLOCK_HALF] each
        y = tl.reshape(tl.join(a * c - b * s, b * c + a * s), (BLOCK_H, 2 * BLOCK_HALF))
        tl.store(dst + d, y.to(dst.dtype.element_ty), mask=mask)
    else:
        mask = rows_ok & (i < HALF)  # [BLOCK_H, BLOCK_HALF]
        a = tl.load(src + i, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(src + HALF + i, mask=mask, other=0.0).to(tl.float32)
        if HAS_NORM:
            a = a * inv_rms * tl.load(w_ptr + i, mask=i < HALF, other=0.0).to(tl.float32)
            b = b * inv_rms * tl.load(w_ptr + HALF + i, mask=i < HALF, other=0.0).to(tl.float32)
        tl.store(dst + i, (a * c - b * s).to(dst.dtype.element_ty), mask=mask)
        tl.store(dst + HALF + i, (b * c + a * s).to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _copy_dims(src, dst, rows_ok, inv_rms, w_ptr, START: tl.constexpr, STOP: tl.constexpr, BLOCK: tl.constexpr,
               HAS_NORM: tl.constexpr):
    """Copies dims [START, STOP) of the rows src [BLOCK_H, 1] to dst, converting the dtype (and
    scaling as ``_rotate_rows`` does with HAS_NORM)."""
    d = START + tl.arange(0, BLOCK)[None, :]  # [1, BLOCK]
    mask = rows_ok & (d < STOP)
    x = tl.load(src + d, mask=mask)
    if HAS_NORM:
        x = x.to(tl.float32) * inv_rms * tl.load(w_ptr + d, mask=d < STOP, other=0.0).to(tl.float32)
    tl.store(dst + d, x.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kv_write_kernel(
    q_ptr, k_ptr, v_ptr, q_out_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, qn_ptr, kn_ptr, eps,
    H, HKV, PAGE_SIZE,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h, stride_qo_t, stride_qo_h,
    stride_cos_t, stride_sin_t,
    stride_kc_p, stride_kc_s, stride_kc_h, stride_vc_p, stride_vc_s, stride_vc_h,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HKV: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr, BLOCK_D: tl.constexpr,
    INTERLEAVED: tl.constexpr, Q_COPY_PASS: tl.constexpr, HAS_PASS: tl.constexpr, HAS_NORM: tl.constexpr,
    PDL: tl.constexpr,
):
    # grid: (tokens, q head blocks then kv head blocks); tokens on axis 0, the only one not
    # capped at 65535 programs
    pdl.enter(PDL)
    t = tl.program_id(0).to(tl.int64)  # T * stride passes 2^31 for long prefills of fused QKV rows
    block = tl.program_id(1)
    q_blocks = tl.cdiv(H, BLOCK_H)
    cos_row, sin_row = cos_ptr + t * stride_cos_t, sin_ptr + t * stride_sin_t
    if block < q_blocks:
        heads = block * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
        rows_ok = heads[:, None] < H  # [BLOCK_H, 1]
        src = q_ptr + t * stride_q_t + heads[:, None] * stride_q_h  # [BLOCK_H, 1]
        dst = q_out_ptr + t * stride_qo_t + heads[:, None] * stride_qo_h
        inv = 1.0
        if HAS_NORM:
            inv = _inv_rms(src, rows_ok, eps, HEAD_DIM, BLOCK_D)
        _rotate_rows(src, dst, rows_ok, cos_row, sin_row, inv, qn_ptr, HALF, BLOCK_H, BLOCK_HALF, INTERLEAVED,
                     HAS_NORM)
        if Q_COPY_PASS:
            _copy_dims(src, dst, rows_ok, inv, qn_ptr, 2 * HALF, HEAD_DIM, BLOCK_PASS, HAS_NORM)
    else:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            page, offset = slot // PAGE_SIZE, slot % PAGE_SIZE
            heads = (block - q_blocks) * BLOCK_HKV + tl.arange(0, BLOCK_HKV)  # [BLOCK_HKV]
            rows_ok = heads[:, None] < HKV  # [BLOCK_HKV, 1]
            k_src = k_ptr + t * stride_k_t + heads[:, None] * stride_k_h  # [BLOCK_HKV, 1]
            k_dst = k_cache_ptr + page * stride_kc_p + offset * stride_kc_s + heads[:, None] * stride_kc_h
            inv = 1.0
            if HAS_NORM:
                inv = _inv_rms(k_src, rows_ok, eps, HEAD_DIM, BLOCK_D)
            _rotate_rows(k_src, k_dst, rows_ok, cos_row, sin_row, inv, kn_ptr, HALF, BLOCK_HKV, BLOCK_HALF,
                         INTERLEAVED, HAS_NORM)
            if HAS_PASS:
                _copy_dims(k_src, k_dst, rows_ok, inv, kn_ptr, 2 * HALF, HEAD_DIM, BLOCK_PASS, HAS_NORM)
            v_src = v_ptr + t * stride_v_t + heads[:, None] * stride_v_h
            v_dst = v_cache_ptr + page * stride_vc_p + offset * stride_vc_s + heads[:, None] * stride_vc_h
            _copy_dims(v_src, v_dst, rows_ok, 1.0, kn_ptr, 0, HEAD_DIM, BLOCK_D, False)


def _check_heads(name: str, t: torch.Tensor, T: int, Dh: int) -> None:
    assert t.dim() == 3, f"{name} must be [T, heads, Dh], got shape {tuple(t.shape)}"
    assert t.shape[0] == T and t.shape[2] == Dh, f"{name}: shape {tuple(t.shape)}, expected [{T}, *, {Dh}]"
    assert t.stride(-1) == 1, f"{name}: the last dimension must be contiguous, strides {t.stride()}"


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.stride() == b.stride()


def _constexprs(H: int, Hkv: int, Dh: int, half: int, interleaved: bool, in_place: bool,
                config: RopeKVWriteConfig, norm: bool = False) -> tuple[dict, int]:
    """(the kernel's compile-time parameters, num_warps) for heads of width Dh with R/2 = half pairs."""
    block_half = triton.next_power_of_2(half)
    block_h, block_hkv, num_warps = config.resolve(H, Hkv, block_half)
    pass_dims = Dh - 2 * half
    return {"HEAD_DIM": Dh, "HALF": half, "BLOCK_H": block_h, "BLOCK_HKV": block_hkv, "BLOCK_HALF": block_half,
            "BLOCK_PASS": triton.next_power_of_2(max(pass_dims, 1)), "BLOCK_D": triton.next_power_of_2(Dh),
            "INTERLEAVED": bool(interleaved), "Q_COPY_PASS": pass_dims > 0 and (norm or not in_place),
            "HAS_PASS": pass_dims > 0, "HAS_NORM": bool(norm)}, num_warps


def rope_kv_write_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                         interleaved: bool = False, *, out: torch.Tensor | None = None,
                         q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                         norm_eps: float = 1e-6, config: RopeKVWriteConfig = RopeKVWriteConfig()):
    """See ``rope_kv_write``. Slots must be distinct and below P * S: checking would synchronise."""
    T, H, Dh = q.shape if q.dim() == 3 else (0, 0, 0)
    _check_heads("q", q, T, Dh)
    _check_heads("k", k, T, Dh)
    _check_heads("v", v, T, Dh)
    Hkv = k.shape[1]
    assert v.shape[1] == Hkv, f"k and v must have the same heads, got {k.shape[1]} and {v.shape[1]}"
    assert q.dtype in _FLOAT_DTYPES and k.dtype == v.dtype == q.dtype, \
        f"q, k, v: one float dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
    half = cos.shape[-1] if cos.dim() == 2 else -1
    for name, table in (("cos", cos), ("sin", sin)):
        assert table.shape == (T, half), f"{name} must be [T, R/2] = [{T}, {half}], got {tuple(table.shape)}"
        assert table.dtype == torch.float32, f"{name} must be fp32, got {table.dtype}"
        assert table.stride(-1) == 1, f"{name}: the last dimension must be contiguous, strides {table.stride()}"
    assert 0 < 2 * half <= Dh, f"rotary dim 2 * {half} must be in (0, head_dim {Dh}]"
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        assert cache.dim() == 4 and cache.shape[2:] == (Hkv, Dh), \
            f"{name} must be [P, S, Hkv, Dh] = [*, *, {Hkv}, {Dh}], got {tuple(cache.shape)}"
        assert cache.stride(-1) == 1, f"{name}: the last dimension must be contiguous, strides {cache.stride()}"
    assert k_cache.shape == v_cache.shape, f"caches differ: {tuple(k_cache.shape)} vs {tuple(v_cache.shape)}"
    assert k_cache.dtype in _FLOAT_DTYPES and v_cache.dtype == k_cache.dtype, \
        f"caches: one float dtype, got {k_cache.dtype}, {v_cache.dtype}"
    assert slot_mapping.shape == (T,) and slot_mapping.dtype in _SLOT_DTYPES and slot_mapping.is_contiguous(), \
        f"slot_mapping must be a contiguous [{T}] int32/int64, got {tuple(slot_mapping.shape)} {slot_mapping.dtype}"
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    assert out.shape == q.shape and out.dtype == q.dtype, \
        f"out: {tuple(out.shape)} {out.dtype}, expected {tuple(q.shape)} {q.dtype}"
    assert out.stride(-1) == 1, f"out: the last dimension must be contiguous, strides {out.stride()}"
    devices = {t.device for t in (q, k, v, cos, sin, k_cache, v_cache, slot_mapping, out)}
    assert len(devices) == 1, f"all tensors must be on one device, got {sorted(map(str, devices))}"
    norm = _check_norms(q_norm, k_norm, Dh, q.device)
    if T == 0:
        return out, k_cache, v_cache

    # in place, q's pass-through dimensions are already where they belong (unless normalised)
    constexprs, num_warps = _constexprs(H, Hkv, Dh, half, interleaved, _same_view(out, q), config, norm)
    grid = (T, triton.cdiv(H, constexprs["BLOCK_H"]) + triton.cdiv(Hkv, constexprs["BLOCK_HKV"]))
    _rope_kv_write_kernel[grid](
        q, k, v, out, cos, sin, k_cache, v_cache, slot_mapping,
        q_norm if norm else cos, k_norm if norm else cos, float(norm_eps),  # (unread without norms)
        H, Hkv, k_cache.shape[1],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        cos.stride(0), sin.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2),
        **constexprs, num_warps=num_warps, **pdl.launch_args(q),
    )
    return out, k_cache, v_cache


def _check_norms(q_norm, k_norm, Dh: int, device) -> bool:
    """Whether per-head q/k norms are given (both or neither, [Dh] each, on q's device)."""
    assert (q_norm is None) == (k_norm is None), "q_norm and k_norm go together"
    if q_norm is None:
        return False
    for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
        assert w.shape == (Dh,) and w.is_contiguous() and w.device == device, \
            f"{name} must be a contiguous [{Dh}] on {device}, got {tuple(w.shape)} on {w.device}"
    return True


def rope_kv_write_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      interleaved: bool = False, *, out: torch.Tensor | None = None,
                      q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                      norm_eps: float = 1e-6):
    """(``rmsnorm`` per head,) ``rope`` then ``kv_write``, by their references: see ``rope_kv_write``.
    The norm stays in fp32 into the rotation (one rounding at the end, as the kernel does)."""
    if _check_norms(q_norm, k_norm, q.shape[-1], q.device):
        def normed(x, w):
            xf = x.float()
            return xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + norm_eps) * w.float()

        q_rot, k_rot = rope_ref(normed(q, q_norm), normed(k, k_norm), cos, sin, interleaved)
        q_rot, k_rot = q_rot.to(q.dtype), k_rot.to(k.dtype)
    else:
        q_rot, k_rot = rope_ref(q, k, cos, sin, interleaved)
    kv_write_ref(k_rot, v, k_cache, v_cache, slot_mapping)
    if out is None:
        return q_rot, k_cache, v_cache
    out.copy_(q_rot)
    return out, k_cache, v_cache


def _supported(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, *rest, **kwargs) -> bool:
    return (q.dim() == k.dim() == v.dim() == 3 and cos.dim() == 2 and k_cache.dim() == 4
            and q.dtype in _FLOAT_DTYPES and k.dtype == v.dtype == q.dtype
            and k_cache.dtype in _FLOAT_DTYPES and v_cache.dtype == k_cache.dtype
            and k_cache.shape == v_cache.shape and k_cache.shape[2:] == k.shape[1:] == v.shape[1:]
            and k.shape[2] == q.shape[2] and 0 < 2 * cos.shape[-1] <= q.shape[2]
            and cos.dtype == sin.dtype == torch.float32 and slot_mapping.dtype in _SLOT_DTYPES
            and slot_mapping.is_contiguous()
            and all(t.stride(-1) == 1 for t in (q, k, v, cos, sin, k_cache, v_cache)))


register("rope_kv_write", "reference", rope_kv_write_ref)
register("rope_kv_write", "triton", rope_kv_write_triton, devices=("cuda",), supports=_supported)

_rope_kv_write = dispatch("rope_kv_write")


def rope_kv_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                  interleaved: bool = False, *, out: torch.Tensor | None = None,
                  q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, norm_eps: float = 1e-6):
    """Rotates q and k by cos/sin and writes k, v into the paged cache -> (q_out, k_cache, v_cache).

    q: [T, H, Dh]; k, v: [T, Hkv, Dh]; cos, sin: [T, R/2] fp32; k_cache, v_cache: [P, S, Hkv, Dh];
    slot_mapping: [T] int (page * S + offset, negative: skip the token). q_out is a new tensor,
    or ``out`` ([T, H, Dh] like q): ``out=q`` rotates q in place. k and v are not modified.
    q_norm, k_norm ([Dh], together): each q and k head is RMS-normalised with these weights
    (``norm_eps``) before it is rotated, Qwen3's per-head norms folded into the same launch.
    """
    return _rope_kv_write(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, interleaved, out=out,
                          q_norm=q_norm, k_norm=k_norm, norm_eps=norm_eps)


# -- workbench ------------------------------------------------------------------------------

def _slots(d: dict, gen: torch.Generator) -> torch.Tensor:
    """[T] int64 slots of the case's pattern over a pool of P pages of S tokens."""
    T, P, S = d["T"], d["P"], d["S"]
    pattern = d.get("slots", "run")
    if pattern == "shuffled":
        return torch.randperm(P * S, generator=gen, device=gen.device)[:T]
    # "run": T consecutive positions of one sequence from ``start``, its pages scattered in the pool
    start = d.get("start", 0)
    pages = torch.randperm(P, generator=gen, device=gen.device)  # [P]
    positions = start + torch.arange(T, device=gen.device)  # [T]
    slots = pages[positions // S] * S + positions % S
    if pattern == "padded":
        # padding rows (CUDA-graph batches, chunk tails) carry any negative slot
        skip = (torch.arange(T, device=gen.device) % 3 == 1) | (torch.arange(T, device=gen.device) == T - 1)
        slots = torch.where(skip, -1 - torch.arange(T, device=gen.device), slots)
    return slots


def _make_inputs(case: Case, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> dict:
    d = case.dims
    T, H, Hkv, Dh, P, S = d["T"], d["H"], d["Hkv"], d["Dh"], d["P"], d["S"]
    R = d.get("R", Dh)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=gen.device).to(device=device, dtype=dtype)

    # q, k, v as the engine sees them: views into one [T, (H + 2 Hkv) Dh] projection
    qkv = randn(T, (H + 2 * Hkv) * Dh)
    q, k, v = (part.view(T, -1, Dh) for part in qkv.split([H * Dh, Hkv * Dh, Hkv * Dh], dim=-1))
    if d.get("qk_norm", False):
        q, k = q.contiguous(), k.contiguous()  # Qwen3's per-head q/k norms produce new tensors
    # a pool already holding other tokens: slots the op does not target must keep their values
    k_cache, v_cache = randn(P, S, Hkv, Dh), randn(P, S, Hkv, Dh)
    slots = _slots(d, gen)
    positions = d.get("start", 0) + torch.arange(T, device=gen.device)
    inv_freq, _ = rope_inv_freq(R, d.get("theta", 10000.0))
    cos, sin = rope_cos_sin(positions, inv_freq.to(gen.device))
    inputs = {"q": q, "k": k, "v": v, "cos": cos.to(device), "sin": sin.to(device), "k_cache": k_cache,
              "v_cache": v_cache, "slot_mapping": slots.to(device), "interleaved": d.get("interleaved", False)}
    if d.get("norm", False):  # Qwen3's per-head norms folded in: q, k stay views of the fused rows
        inputs.update(q_norm=randn(Dh), k_norm=randn(Dh), norm_eps=1e-6)
    return inputs


def _bytes(inputs: dict) -> int:
    q, k, v, cos, cache = inputs["q"], inputs["k"], inputs["v"], inputs["cos"], inputs["k_cache"]
    read = (q.numel() + k.numel() + v.numel()) * q.element_size() + 2 * cos.numel() * cos.element_size() \
        + inputs["slot_mapping"].numel() * inputs["slot_mapping"].element_size()
    write = q.numel() * q.element_size() + (k.numel() + v.numel()) * cache.element_size()
    return read + write


def _flops(inputs: dict) -> int:
    pairs = (inputs["q"].shape[1] + inputs["k"].shape[1]) * inputs["cos"].numel()  # T * (H + Hkv) * R/2
    return 6 * pairs  # 4 multiplies and 2 adds per pair


SMALL_CASES = (
    Case("one-token", {"T": 1, "H": 4, "Hkv": 2, "Dh": 32, "P": 4, "S": 4, "start": 6},
         edge="1 token (decode) in the middle of a page"),
    Case("page-boundary", {"T": 6, "H": 2, "Hkv": 1, "Dh": 32, "P": 6, "S": 4, "start": 3},
         edge="a run from the last slot of a page across two page boundaries into scattered pages"),
    Case("negative-slots", {"T": 7, "H": 2, "Hkv": 2, "Dh": 32, "P": 4, "S": 4, "start": 1, "slots": "padded"},
         edge="padding rows with negative slots: q still rotates, K/V are not written"),
    Case("shuffled-slots", {"T": 7, "H": 2, "Hkv": 1, "Dh": 32, "P": 4, "S": 4, "slots": "shuffled"},
         edge="slots in random order over the whole pool"),
    Case("gqa", {"T": 3, "H": 10, "Hkv": 2, "Dh": 32, "P": 2, "S": 4, "start": 2},
         edge="GQA 5:1, q spans two head blocks of the default config, the last partly masked"),
    Case("partial-rotary", {"T": 3, "H": 4, "Hkv": 2, "Dh": 64, "R": 32, "P": 2, "S": 4},
         edge="R = Dh/2: the pass-through half of k is copied into the cache"),
    Case("interleaved", {"T": 5, "H": 3, "Hkv": 1, "Dh": 32, "P": 3, "S": 4, "start": 2, "interleaved": True},
         edge="interleaved pairs (GGUF Llama), odd H, one kv head"),
    Case("partial-interleaved", {"T": 3, "H": 2, "Hkv": 2, "Dh": 80, "R": 32, "P": 2, "S": 4,
                                 "interleaved": True, "slots": "shuffled"},
         edge="head_dim 80, R 32, interleaved: non-power-of-2 head and pass-through tail"),
    Case("odd-half", {"T": 2, "H": 2, "Hkv": 2, "Dh": 48, "R": 40, "P": 2, "S": 4, "qk_norm": True},
         edge="R/2 = 20 rotate-half with an 8-dim pass-through; contiguous q/k beside a strided v"),
    Case("qk-norm", {"T": 3, "H": 4, "Hkv": 2, "Dh": 32, "P": 4, "S": 4, "start": 2, "norm": True},
         edge="Qwen3's per-head q/k RMSNorm folded in, on views of the fused QKV rows"),
    Case("qk-norm-partial-interleaved", {"T": 2, "H": 3, "Hkv": 1, "Dh": 48, "R": 32, "P": 2, "S": 4,
                                         "interleaved": True, "norm": True, "slots": "padded"},
         edge="the norm with a pass-through tail (normalised too), interleaved pairs, padding rows"),
)


def _model_cases() -> tuple[Case, ...]:
    # 4096 pages of 16 tokens: a 64k-token pool per layer, far larger than L2, with each
    # sequence's pages scattered in it; prefills start mid-page
    pool = {"P": 4096, "S": 16}
    cases = []
    for T, start, what in ((1, 1000, "decode"), (128, 200, "prefill 128"), (8192, 40, "prefill 8192")):
        cases.append(Case(f"llama3.1-8b-T{T}", {"T": T, "H": 32, "Hkv": 8, "Dh": 128, "theta": 500000.0,
                                                 "start": start, **pool},
                          edge=f"Llama-3.1-8B {what}, fused QKV views"))
        cases.append(Case(f"qwen3-30b-a3b-T{T}", {"T": T, "H": 32, "Hkv": 4, "Dh": 128, "theta": 1e6,
                                                   "start": start, "qk_norm": True, **pool},
                          edge=f"Qwen3-30B-A3B {what} (q/k contiguous after q_norm/k_norm)"))
        cases.append(Case(f"qwen3-30b-a3b-T{T}-norm", {"T": T, "H": 32, "Hkv": 4, "Dh": 128, "theta": 1e6,
                                                        "start": start, "norm": True, **pool},
                          edge=f"Qwen3-30B-A3B {what}, q/k norms folded in (fused QKV views)"))
    return tuple(cases)


ROPE_KV_WRITE_SPEC = register_spec(OpSpec(
    op="rope_kv_write",
    reference=rope_kv_write_ref,
    make_inputs=_make_inputs,
    cases=SMALL_CASES,
    model_cases=_model_cases(),
    bytes_moved=_bytes,
    flops=_flops,
    out_arg=None,
    launch_config=RopeKVWriteConfig,
    notes="returns (q_out, k_cache, v_cache), the caches written in place and compared whole (the slots not "
          "targeted hold random values that must survive). No poisoned out: the caches cannot be poisoned "
          "without hiding that, and q_out is a fresh tensor. In place: out=q.",
))
