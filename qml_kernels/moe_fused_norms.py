"""A decode step's MoE layer fused with the RMSNorms on either side of it (``moe_norm_route``,
``moe_combine_rmsnorm``).

A Qwen3-30B-A3B decode step spends most of its 48 layers' time in launches that move almost
nothing. Around the experts' two grouped GEMMs a layer ran five kernels: the residual add and
RMSNorm before the FFN, the router's GEMV (128 x 2048), the fused routing (``moe_route``), and
after the GEMMs the weighted combine, then the next layer's residual add and RMSNorm. Without
PDL the H200's graph profile read 2.0 + ~2.5 + 4.5 us before the GEMMs and 1.4 + 2.0 us after,
each launch mostly one memory round trip and a ramp (results/engine-h200-qwen3-30b-a3b-moedecode-
2026-12-01.json). Here they are two launches:

``moe_norm_route`` (entry): ``s = h + residual``, ``x = rmsnorm(s)``, ``logits = x @ router.T``,
then ``moe_route`` of the logits. The router's weight (E x D, 512 KB for Qwen3-30B-A3B) is read by
``E / BLOCK_EN`` programs, each of which forms ``s`` and the row's inverse RMS itself (a few KB from
L2: cheaper than a launch boundary) and its ``BLOCK_EN`` logits. Program 0 stores ``s`` and ``x``.
Each program stores its logits (rounded to the activation dtype, as ``linear`` returns them) to a
small workspace and counts itself done on a device counter (an ``acq_rel`` atomic after a CTA
barrier: its stores happen before the count); the program that counts last routes and groups
all the rows (``moe_route``'s code: ``_route_tile``, ``_store_route``) and puts the counter back to
0 for the next launch (a CUDA graph replays the same counter).

``moe_combine_rmsnorm`` (exit): ``h = sum_j weights[t, j] * y[t·k + j]`` rounded to the activation
dtype (``moe_combine``), then ``add_rmsnorm(h, residual, w)``: one program per token holding the
token's ``k`` expert rows ``[k, D]`` and its residual row, so ``h`` never reaches memory.

Both equal the unfused ops up to fp32 summation order (the references are their compositions), and
apply to a few tokens only (``MAX_TOKENS``): the entry's last program routes every token, the exit
holds whole rows. ``Qwen3Layer.feed_forward`` (qml_runtime/models/qwen3.py) runs a decode-sized MoE layer
between them when ``QML_FUSED_MOE_NORM=1``; it returns a ``PendingCombine`` that the next norm
(``combine_add_rmsnorm``) takes in.

Measured, and off by default (H200, 2026-12-03, benchmarks/results/moe-fused-norms-h200-2026-12-03.md):
expected a layer's five launches around the GEMMs (~9.5 + ~3.4 us without PDL) to shrink by a few
microseconds; got, in CUDA graphs under PDL, the separate entry 8.3 us a layer against 8.3 for the best
fused config (14.0 for a loop of 256-wide GEMV steps), the separate exit 3.3 against 4.1-5.8 for the fused
one, and Qwen3-30B-A3B's batch-1 decode step 3.199 ms with the separate ops against 3.219-3.259 fused.
Under PDL a launch boundary costs little: what a step waits for is each op's chain of dependent memory
round trips and cross-warp reductions, and one program doing the combine's and the norm's work in turn
is longer than eight programs combining and one normalising. The routing's own ~4.8 us (one program, ~15
reductions in a row) is the longest link of the entry either way.

Traffic: entry ``E·D`` router weights + ``2·T·D`` in, ``2·T·D`` out; exit ``T·k·D + T·D`` in, ``2·T·D``
out. Both are latency-bound at decode sizes: the point was the launches saved.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from qml_kernels import moe_decode, pdl
from qml_kernels.linear import linear_ref
from qml_kernels.moe_route import _blocks as _route_blocks
from qml_kernels.moe_route import _store_route, moe_route_ref, within_default_tile
from qml_kernels.moe_routing import _FLOAT_DTYPES, _route_tile, moe_combine_ref, padded_rows
from qml_kernels.registry import dispatch, register
from qml_kernels.rmsnorm import add_rmsnorm, add_rmsnorm_ref
from qml_kernels.workbench.spec import Case, OpSpec, register_spec

FUSED_MOE_NORM = os.environ.get("QML_FUSED_MOE_NORM", "0") == "1"  # off: measured no faster (module doc)
MAX_TOKENS = 4  # rows the entry's last program routes (moe_route's default one-hot tile at top-8 of 128)
MAX_D = 8192  # one chunk of a row in registers
MAX_EXIT_TILE = 16384  # the exit's [k, D] expert rows, held by one program


@dataclass(frozen=True)
class MoEFusedNormsConfig:
    """Launch tunables: router rows and reduction step per entry program, warps of each kernel."""

    # the fastest of seven entry configs and four exit warp counts on the H200 (moe-fused-norms-h200-2026-12-03.md):
    # the router's whole row in one step (a loop of 256-wide steps waited out one load per step: 14.0 us)
    block_en: int = 2  # router rows (experts) per entry program: E / block_en programs
    block_kc: int = 2048  # reduction step of the entry's GEMV (capped at the row)
    entry_warps: int = 4
    exit_warps: int = 2

    def __post_init__(self):
        for name in ("block_en", "block_kc"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"MoEFusedNormsConfig.{name} must be a power of 2, got {value}")

    @classmethod
    def from_env(cls, text: str | None) -> "MoEFusedNormsConfig":
        """``QML_MOE_FUSED_NORMS="block_en=4,entry_warps=8"`` (an A/B of launch configs in a whole process)."""
        if not text:
            return cls()
        fields = dict(part.split("=", 1) for part in text.split(",") if part.strip())
        return cls(**{key.strip(): int(value) for key, value in fields.items()})


DEFAULT_CONFIG = MoEFusedNormsConfig.from_env(os.environ.get("QML_MOE_FUSED_NORMS"))


@triton.jit
def _moe_norm_route_kernel(
    h_ptr, res_ptr, norm_w_ptr, router_ptr, x_ptr, res_out_ptr, logits_ptr, counter_ptr,
    weights_ptr, ids_ptr, sorted_pairs_ptr, offsets_ptr, inverse_ptr,
    T, D, E, R, stride_h, stride_res, stride_router, stride_x, stride_res_out, eps, offset,
    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, ALIGN: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_EN: tl.constexpr, BLOCK_KC: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PAD_COLS: tl.constexpr, BLOCK_TAIL: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.enter(PDL)
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_T)
    row_ok = rows < T
    # the whole rows once: s = h + residual rounded as add_rmsnorm stores it, and its inverse RMS
    cols = tl.arange(0, BLOCK_D)
    mask = row_ok[:, None] & (cols < D)[None, :]
    h = tl.load(h_ptr + rows[:, None] * stride_h + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    r = tl.load(res_ptr + rows[:, None] * stride_res + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s = (h + r).to(res_out_ptr.dtype.element_ty).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(s * s, axis=1) / D + eps)  # [BLOCK_T]
    if pid == 0:
        w = tl.load(norm_w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
        x = s * inv_rms[:, None] * (offset + w)[None, :]
        tl.store(res_out_ptr + rows[:, None] * stride_res_out + cols[None, :],
                 s.to(res_out_ptr.dtype.element_ty), mask=mask)
        tl.store(x_ptr + rows[:, None] * stride_x + cols[None, :], x.to(x_ptr.dtype.element_ty), mask=mask)

    # this program's router rows: x is formed again chunk by chunk (the same arithmetic, so the same
    # values as program 0 stores), accumulated elementwise and summed once after the loop (gemv's form)
    experts = pid * BLOCK_EN + tl.arange(0, BLOCK_EN)
    e_ok = experts < E
    ks = tl.arange(0, BLOCK_KC)
    acc = tl.zeros([BLOCK_T, BLOCK_EN, BLOCK_KC], dtype=tl.float32)
    for k0 in range(0, D, BLOCK_KC):
        kk = k0 + ks
        k_ok = kk < D
        m = row_ok[:, None] & k_ok[None, :]
        hc = tl.load(h_ptr + rows[:, None] * stride_h + kk[None, :], mask=m, other=0.0).to(tl.float32)
        rc = tl.load(res_ptr + rows[:, None] * stride_res + kk[None, :], mask=m, other=0.0).to(tl.float32)
        sc = (hc + rc).to(res_out_ptr.dtype.element_ty).to(tl.float32)
        wc = tl.load(norm_w_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
        xc = (sc * inv_rms[:, None] * (offset + wc)[None, :]).to(x_ptr.dtype.element_ty).to(tl.float32)
        wr = tl.load(router_ptr + experts.to(tl.int64)[:, None] * stride_router + kk[None, :],
                     mask=e_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)  # [BLOCK_EN, BLOCK_KC]
        acc += xc[:, None, :] * wr[None, :, :]
    logits = tl.sum(acc, axis=2)  # [BLOCK_T, BLOCK_EN]
    tl.store(logits_ptr + rows[:, None] * E + experts[None, :], logits.to(logits_ptr.dtype.element_ty),
             mask=row_ok[:, None] & e_ok[None, :])

    # every thread's logits are stored before the count (barrier), and the count releases them to the
    # program that counts last, whose acquire makes them visible to its loads
    tl.debug_barrier()
    done = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if done == tl.num_programs(0) - 1:
        sel_w, sel_id = _route_tile(logits_ptr, rows, T, E, E, TOP_K, RENORMALIZE, BLOCK_T, BLOCK_E, BLOCK_K)
        _store_route(sel_w, sel_id, rows, T, E, R, weights_ptr, ids_ptr, sorted_pairs_ptr, offsets_ptr,
                     inverse_ptr, TOP_K, ALIGN, BLOCK_T, BLOCK_E, BLOCK_K, PAD_COLS, BLOCK_TAIL)
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")  # ready for the next launch


@triton.jit
def _moe_combine_rmsnorm_kernel(
    y_ptr, weights_ptr, res_ptr, norm_w_ptr, x_ptr, res_out_ptr,
    D, stride_y, stride_res, stride_x, stride_res_out, eps, offset,
    TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.enter(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    slots = tl.arange(0, BLOCK_K)
    pairs = token * TOP_K + slots
    w = tl.load(weights_ptr + pairs, mask=slots < TOP_K, other=0.0)  # [BLOCK_K]
    # the k rows in one load, all in flight at once (moe_combine's form)
    y = tl.load(y_ptr + pairs[:, None] * stride_y + cols[None, :],
                mask=(slots < TOP_K)[:, None] & col_ok[None, :], other=0.0)
    h = tl.sum(w[:, None] * y.to(tl.float32), axis=0)  # [BLOCK_D]
    h = h.to(res_out_ptr.dtype.element_ty).to(tl.float32)  # what moe_combine would store
    r = tl.load(res_ptr + token * stride_res + cols, mask=col_ok, other=0.0).to(tl.float32)
    s = (h + r).to(res_out_ptr.dtype.element_ty)
    tl.store(res_out_ptr + token * stride_res_out + cols, s, mask=col_ok)
    s = s.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(s * s, axis=0) / D + eps)
    nw = tl.load(norm_w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    x = s * inv_rms * (offset + nw)
    tl.store(x_ptr + token * stride_x + cols, x.to(x_ptr.dtype.element_ty), mask=col_ok)


# -- launches ---------------------------------------------------------------------------------

_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counter(device: torch.device) -> torch.Tensor:
    """The entry kernel's done-counter on ``device``: zero between launches (the last program resets
    it), so one int32 per device serves every layer, replay and stream in turn."""
    counter = _COUNTERS.get(device)
    if counter is None:
        counter = _COUNTERS[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return counter


def _check_rows(name: str, t: torch.Tensor, shape: tuple, dtype: torch.dtype) -> None:
    assert t.shape == shape and t.dtype == dtype and t.stride(-1) == 1, \
        f"{name} must be {dtype} {list(shape)} with a contiguous last dimension, got {t.dtype} {tuple(t.shape)}"


def moe_norm_route_triton(h: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                          router: torch.Tensor, top_k: int, renormalize: bool, block_size: int,
                          offset: float = 0.0, *, out: tuple[torch.Tensor, ...] | None = None,
                          config: MoEFusedNormsConfig | None = None):
    """h, residual [T, D], norm_weight [D], router [E, D] -> (x [T, D], h + residual [T, D], weights [T, k]
    fp32, ids [T, k], sorted_pairs [R], expert_offsets [E+1], inverse [T·k]) in one launch: ``add_rmsnorm``,
    ``linear`` (the router) and ``moe_route``. ``out``: seven tensors to write into, as the result."""
    assert _norm_route_supported(h, residual, norm_weight, eps, router, top_k, renormalize, block_size), \
        f"moe_norm_route: h {h.dtype} {tuple(h.shape)}, router {router.dtype} {tuple(router.shape)}, top_k {top_k}: " \
        f"needs 1-{MAX_TOKENS} rows of width <= {MAX_D} and matching dtypes"
    T, D = h.shape
    E = router.shape[0]
    dev = h.device
    R = padded_rows(T * top_k, E, block_size)
    shapes = ((T, D), (T, D), (T, top_k), (T, top_k), (R,), (E + 1,), (T * top_k,))
    dtypes = (h.dtype, h.dtype, torch.float32) + (torch.int32,) * 4
    if out is None:
        out = tuple(torch.empty(shape, dtype=dtype, device=dev) for shape, dtype in zip(shapes, dtypes))
    assert len(out) == 7, "out must be seven tensors, as the result"
    for i, (t, shape, dtype) in enumerate(zip(out, shapes, dtypes)):
        _check_rows(f"out[{i}]", t, shape, dtype)
        assert t.is_contiguous() and t.device == dev, f"out[{i}] must be contiguous on {dev}"
    x, summed, weights, ids, sorted_pairs, offsets, inverse = out
    config = config or DEFAULT_CONFIG
    logits = torch.empty((T, E), dtype=h.dtype, device=dev)  # the programs' logits, read by the last one
    blocks = _route_blocks(T, E, top_k, block_size)
    _moe_norm_route_kernel[(triton.cdiv(E, config.block_en),)](
        h, residual, norm_weight, router, x, summed, logits, _counter(dev),
        weights, ids, sorted_pairs, offsets, inverse,
        T, D, E, R, h.stride(0), residual.stride(0), router.stride(0), x.stride(0), summed.stride(0),
        float(eps), float(offset),
        TOP_K=top_k, RENORMALIZE=bool(renormalize), ALIGN=block_size, BLOCK_D=triton.next_power_of_2(D),
        BLOCK_EN=config.block_en, BLOCK_KC=min(config.block_kc, triton.next_power_of_2(D)), **blocks,
        num_warps=config.entry_warps, **pdl.launch_args(h),
    )
    return x, summed, weights, ids, sorted_pairs, offsets, inverse


def moe_norm_route_ref(h: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                       router: torch.Tensor, top_k: int, renormalize: bool, block_size: int, offset: float = 0.0):
    """``add_rmsnorm`` -> ``linear`` (router logits in the activation dtype) -> ``moe_route``."""
    x, summed = add_rmsnorm_ref(h, residual, norm_weight, eps, offset)
    return (x, summed, *moe_route_ref(linear_ref(x, router), top_k, renormalize, block_size))


def moe_combine_rmsnorm_triton(y: torch.Tensor, weights: torch.Tensor, residual: torch.Tensor,
                               norm_weight: torch.Tensor, eps: float, offset: float = 0.0, *,
                               out: tuple[torch.Tensor, torch.Tensor] | None = None,
                               config: MoEFusedNormsConfig | None = None):
    """y [T·k, D] (pair order), weights [T, k] fp32, residual [T, D] -> (rmsnorm(h + residual), h + residual)
    with h = ``moe_combine(y, weights)``, in one launch. ``out``: a pair to write into, as the result."""
    assert _combine_supported(y, weights, residual, norm_weight), \
        f"moe_combine_rmsnorm: y {y.dtype} {tuple(y.shape)}, weights {weights.dtype} {tuple(weights.shape)}, " \
        f"residual {residual.dtype} {tuple(residual.shape)}: needs 1-{MAX_TOKENS} rows of width <= {MAX_D}"
    T, k = weights.shape
    D = y.shape[1]
    config = config or DEFAULT_CONFIG
    x, summed = out if out is not None else (torch.empty_like(residual), torch.empty_like(residual))
    for name, t in (("out[0]", x), ("out[1]", summed)):
        _check_rows(name, t, tuple(residual.shape), residual.dtype)
    _moe_combine_rmsnorm_kernel[(T,)](
        y, weights, residual, norm_weight, x, summed,
        D, y.stride(0), residual.stride(0), x.stride(0), summed.stride(0), float(eps), float(offset),
        TOP_K=k, BLOCK_K=triton.next_power_of_2(k), BLOCK_D=triton.next_power_of_2(D),
        num_warps=config.exit_warps, **pdl.launch_args(y),
    )
    return x, summed


def moe_combine_rmsnorm_ref(y: torch.Tensor, weights: torch.Tensor, residual: torch.Tensor,
                            norm_weight: torch.Tensor, eps: float, offset: float = 0.0):
    """``moe_combine`` then ``add_rmsnorm``."""
    return add_rmsnorm_ref(moe_combine_ref(y, weights), residual, norm_weight, eps, offset)


def _norm_route_supported(h, residual, norm_weight, eps, router, top_k, renormalize, block_size, *args,
                          **kwargs) -> bool:
    if not all(isinstance(t, torch.Tensor) for t in (h, residual, norm_weight, router)):
        return False
    if h.dim() != 2 or router.dim() != 2 or h.dtype not in _FLOAT_DTYPES:
        return False
    T, D = h.shape
    E = router.shape[0]
    return (1 <= T <= MAX_TOKENS and 1 <= D <= MAX_D and residual.shape == h.shape and norm_weight.shape == (D,)
            and router.shape[1] == D and router.dtype == h.dtype and residual.dtype == h.dtype
            and all(t.stride(-1) == 1 for t in (h, residual, router)) and norm_weight.is_contiguous()
            and 1 <= top_k <= E and block_size >= 1 and within_default_tile(T, E, top_k, block_size))


def _combine_supported(y, weights, residual, norm_weight, *args, **kwargs) -> bool:
    if not all(isinstance(t, torch.Tensor) for t in (y, weights, residual, norm_weight)):
        return False
    if weights.dim() != 2 or y.dim() != 2 or residual.dim() != 2:
        return False
    T, k = weights.shape
    D = y.shape[1]
    return (1 <= T <= MAX_TOKENS and 1 <= D <= MAX_D and y.shape[0] == T * k and residual.shape == (T, D)
            and weights.dtype == torch.float32 and weights.is_contiguous() and y.dtype == residual.dtype
            and y.dtype in _FLOAT_DTYPES and y.stride(-1) == 1 and residual.stride(-1) == 1
            and norm_weight.shape == (D,) and norm_weight.is_contiguous()
            and k * triton.next_power_of_2(D) <= MAX_EXIT_TILE)


register("moe_norm_route", "reference", moe_norm_route_ref)
register("moe_norm_route", "triton", moe_norm_route_triton, devices=("cuda",), supports=_norm_route_supported)
register("moe_combine_rmsnorm", "reference", moe_combine_rmsnorm_ref)
register("moe_combine_rmsnorm", "triton", moe_combine_rmsnorm_triton, devices=("cuda",),
         supports=_combine_supported)
moe_norm_route = dispatch("moe_norm_route")
moe_combine_rmsnorm = dispatch("moe_combine_rmsnorm")


# -- the MoE layer's decode path ----------------------------------------------------------------

@dataclass
class PendingCombine:
    """A MoE layer's output before its combine: the expert rows ``y`` [T·k, D] and their ``weights``
    [T, k]. The next residual add and RMSNorm (``combine_add_rmsnorm``) takes the combine in."""

    y: torch.Tensor
    weights: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.weights.shape[0], self.y.shape[1]))


def fused_ffn_applies(h: torch.Tensor, router: torch.Tensor, top_k: int) -> bool:
    """A decode-sized MoE layer takes the fused norms (switched on; a few tokens, rows that fit)."""
    T, D = h.shape
    # QML_MOE_DECODE=1 asks for moe_decode's path, which takes the router logits: the separate ops
    return (FUSED_MOE_NORM and not moe_decode.MOE_DECODE and 1 <= T <= MAX_TOKENS and D <= MAX_D
            and top_k * triton.next_power_of_2(D) <= MAX_EXIT_TILE
            and within_default_tile(T, router.shape[0], top_k, 16))


def combine_add_rmsnorm(h, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0):
    """``add_rmsnorm(h, residual, ...)`` where ``h`` may be a ``PendingCombine`` (then one fused launch)."""
    if isinstance(h, PendingCombine):
        return moe_combine_rmsnorm(h.y, h.weights, residual, weight, eps, offset)
    return add_rmsnorm(h, residual, weight, eps, offset)


# -- workbench ------------------------------------------------------------------------------

def _make_entry_inputs(case: Case, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> dict:
    d = case.dims
    T, D, E = d["T"], d["D"], d["E"]

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen, device=gen.device)).to(device=device, dtype=dtype)

    h, residual, norm_weight = randn(T, D), randn(T, D, scale=2.0), randn(D, scale=0.1) + 1.0
    # The router is built so that each token's logits are a permutation of values 4 / (E - 1) apart: the
    # kernel and the reference sum them in other orders and round the normed row at other points, and
    # logits closer than that rounding (a random router over 16 experts drew them in fp16, ~1 run in 25)
    # rank differently, which swaps two experts' ids. ``router @ x_t = targets[t]`` for every token.
    s = h.double() + residual.double()
    x = (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_weight.double()).cpu()  # [T, D]
    cpu = torch.Generator().manual_seed(int(torch.randint(2**31, (1,), generator=gen, device=gen.device)))
    spaced = torch.linspace(-2.0, 2.0, E, dtype=torch.float64)
    targets = torch.stack([spaced[torch.randperm(E, generator=cpu)] for _ in range(T)])  # [T, E]
    router = (targets.T @ torch.linalg.solve(x @ x.T, x)).to(device=device, dtype=dtype)  # [E, D]
    return {"h": h, "residual": residual, "norm_weight": norm_weight, "eps": 1e-6, "router": router,
            "top_k": d["k"], "renormalize": True, "block_size": 16}


def _make_exit_inputs(case: Case, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> dict:
    d = case.dims
    T, D, k = d["T"], d["D"], d["k"]
    weights = torch.rand(T, k, generator=gen, device=gen.device)
    weights = (weights / weights.sum(dim=1, keepdim=True)).to(device)
    y = torch.randn(T * k, D, generator=gen, device=gen.device).to(device=device, dtype=dtype)
    residual = (2.0 * torch.randn(T, D, generator=gen, device=gen.device)).to(device=device, dtype=dtype)
    norm_weight = (1.0 + 0.1 * torch.randn(D, generator=gen, device=gen.device)).to(device=device, dtype=dtype)
    return {"y": y, "weights": weights, "residual": residual, "norm_weight": norm_weight, "eps": 1e-6}


ENTRY_CASES = (
    Case("one-token", {"T": 1, "D": 256, "E": 32, "k": 4}, edge="decode: 4 programs, the last one routes"),
    Case("odd-width", {"T": 3, "D": 200, "E": 61, "k": 3}, edge="D and E not powers of 2: masked tails"),
    Case("four-tokens", {"T": 4, "D": 128, "E": 16, "k": 8}, edge="the most tokens taken; k = E / 2"),
)
EXIT_CASES = (
    Case("one-token", {"T": 1, "D": 256, "k": 8}, edge="decode: one program holds 8 expert rows"),
    Case("odd-width", {"T": 3, "D": 321, "k": 3}, edge="odd D, k not a power of 2: masked slots and columns"),
)

MOE_NORM_ROUTE_SPEC = register_spec(OpSpec(
    op="moe_norm_route",
    reference=moe_norm_route_ref,
    make_inputs=_make_entry_inputs,
    cases=ENTRY_CASES,
    model_cases=(Case("qwen3-30b-a3b-decode", {"T": 1, "D": 2048, "E": 128, "k": 8},
                      edge="Qwen3-30B-A3B: 64 programs of 2 router rows"),),
    bytes_moved=lambda i: (i["router"].numel() + 4 * i["h"].numel()) * i["h"].element_size(),
    notes="returns (x, h + residual, weights fp32, ids, sorted_pairs, expert_offsets, inverse)",
))

MOE_COMBINE_RMSNORM_SPEC = register_spec(OpSpec(
    op="moe_combine_rmsnorm",
    reference=moe_combine_rmsnorm_ref,
    make_inputs=_make_exit_inputs,
    cases=EXIT_CASES,
    model_cases=(Case("qwen3-30b-a3b-decode", {"T": 1, "D": 2048, "k": 8}, edge="Qwen3-30B-A3B, one token"),),
    bytes_moved=lambda i: (i["y"].numel() + 4 * i["residual"].numel()) * i["y"].element_size(),
    notes="returns (rmsnorm(h + residual), h + residual), h the weighted combine of y",
))
