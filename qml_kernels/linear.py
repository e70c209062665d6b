"""Linear layers: ``y = x @ w.T`` with weights stored ``[N, K]`` (output rows, as checkpoints do).

x ``[T, K]`` and weight ``[N, K]`` have K contiguous; y is ``[T, N]`` in x's dtype, accumulated in
fp32. Work and traffic of one call: ``2·T·N·K`` FLOPs over ``(T·K + N·K + T·N)`` elements. At
decode (T of 1 to a few dozen) the weight dominates the bytes and the op is a weight stream
(H200: ~4.2 TB/s, about 9.6 µs for a 4096x4096 bf16 weight); from a few hundred tokens on it is
bound by the tensor cores (~700 TFLOP/s measured for cuBLAS at Llama-3.1-8B shapes).

Implementations, behind one dispatch:
- ``cublas``: torch's matmul (cuBLAS on CUDA, oneDNN/MKL on CPU).
- ``gemv``: ``qml_kernels.gemv``, a weight stream for 1 to 4 tokens (decode), no tensor cores.
- ``triton``: ``_linear_kernel``, a persistent GEMM. Each program walks output tiles in groups
  of ``group_m`` row-tiles (so the weight tiles it reuses are still in L2) and loads x and w
  through TMA tensor descriptors into shared memory, where wgmma (Hopper's asynchronous
  warpgroup MMA) reads them; w is read as the transposed B operand straight from its
  ``[N, K]`` layout, no copy. Decode shapes take a 16-row tile (mma.sync instead of wgmma,
  whose minimum is 64 rows: the FLOPs are free there) and narrow N tiles so that all SMs
  stream the weight.
- ``narrow``: ``qml_kernels.linear_narrow``, the product transposed (features as the MMA's rows,
  tokens as its columns) for a turn's 17 to 256 tokens, which the other two pad to 64- or 128-row tiles.
- ``reference``: ``linear_ref``, fp32 matmul; what every check compares against.

Which of cublas/triton/gemv/narrow runs on a GPU is measured, not guessed: ``qml_kernels/tuning/linear_<gpu>.json``
names the faster verified one per (dtype, N, K, token bucket); unlisted shapes run cuBLAS.
``QML_LINEAR_TABLE=path`` puts another table in its place for a whole process (an A/B of a sweep's table).
On CPU the public ``linear`` runs torch's matmul unless an implementation is forced.

Sources: the CUDA C++ programming guide (tensor memory access) and the PTX ISA (wgmma); the
grouped tile order of Triton's matmul tutorials; persistent GEMM scheduling as in CUTLASS's
Hopper kernels (one CTA per SM walking output tiles).
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from qml_kernels import registry
from qml_kernels.gemv import GemvConfig, gemv_capable, gemv_triton
from qml_kernels.linear_narrow import NarrowConfig, linear_narrow, narrow_capable
from qml_kernels.registry import dispatch, register
from qml_kernels.tuning import TuningEntry, TuningTable, find_table, load_table, token_bucket
from qml_kernels.workbench.spec import Case, OpSpec, register_spec

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
H200_SMS = 132
_INTERPRETER_PROGRAMS = 4  # no SMs on CPU: a few programs, so the persistent loop takes several tiles each
_SMEM_BUDGET = 220 * 1024  # of the 227 KiB a Hopper block may use; the rest for barriers and conversions
_TMA_BOX_MAX = 256  # elements per dimension of one TMA copy


@dataclass(frozen=True)
class LinearConfig:
    """Launch tunables. The default is the large-T tile; ``default_config`` picks one per shape."""

    block_m: int = 128  # token rows per tile
    block_n: int = 256  # output features per tile
    block_k: int = 64  # reduction step (64 bf16 = one 128-byte swizzled row per TMA copy)
    group_m: int = 8  # row-tiles per group in the tile order (L2 reuse of weight tiles)
    num_warps: int = 8
    num_stages: int = 3
    persistent: bool = True  # one program per SM walking tiles; False: one program per tile
    num_sms: int | None = None  # programs of the persistent grid; None: the device's SM count

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value > _TMA_BOX_MAX or value & (value - 1):
                raise ValueError(f"LinearConfig.{name} must be a power of 2 in [16, 256], got {value}")
        if self.group_m < 1 or self.num_warps < 1 or self.num_stages < 1:
            raise ValueError("LinearConfig.group_m, num_warps and num_stages must be >= 1")
        if self.num_sms is not None and self.num_sms < 1:
            raise ValueError(f"LinearConfig.num_sms must be >= 1, got {self.num_sms}")


def _wave_fill(tiles: int, num_sms: int) -> float:
    """Fraction of SM-slots busy when ``tiles`` equal tiles run in waves of ``num_sms``."""
    return tiles / (triton.cdiv(tiles, num_sms) * num_sms)


def _first_filling(shapes, tiles_of, num_sms: int):
    # the largest tile (most reuse per byte loaded) that still keeps >= 80% of the SMs busy
    for shape in shapes:
        if _wave_fill(tiles_of(shape), num_sms) >= 0.8:
            return shape
    return max(shapes, key=lambda s: _wave_fill(tiles_of(s), num_sms))


def default_config(T: int, N: int, K: int, dtype: torch.dtype, num_sms: int = H200_SMS) -> LinearConfig:
    """The heuristic launch config for a [T, K] x [N, K]^T product (the tuning table overrides it)."""
    elem = dtype.itemsize
    if T <= 64:
        # weight stream: one row-tile covers every token, so parallelism comes from N alone; narrow
        # N tiles give every SM a share of the weight, long K steps keep many bytes in flight
        block_m = max(16, triton.next_power_of_2(T))
        block_k = min(_TMA_BOX_MAX, 512 // elem)
        block_n = _first_filling((64, 32, 16), lambda bn: triton.cdiv(N, bn), num_sms)
        group_m, num_warps, max_stages = 1, 4, 6
    else:
        block_k = 128 // elem
        block_m, block_n = _first_filling(((128, 256), (128, 128), (64, 128), (64, 64)),
                                          lambda s: triton.cdiv(T, s[0]) * triton.cdiv(N, s[1]), num_sms)
        # 128x256 fp32 accumulators are 128 registers a thread over 8 warps; 4 warps would spill
        group_m, num_warps, max_stages = 8, 8 if block_m * block_n >= 128 * 128 else 4, 4
    stage_bytes = (block_m + block_n) * block_k * elem
    epilogue_bytes = block_m * block_n * elem  # the output tile staged in shared memory for the TMA store
    num_stages = max(2, min(max_stages, (_SMEM_BUDGET - epilogue_bytes) // stage_bytes))
    return LinearConfig(block_m, block_n, block_k, group_m, num_warps, num_stages)


@triton.jit
def _linear_kernel(
    x_desc, w_desc, out_desc,  # TMA descriptors: x [T, K], w [N, K], out [T, N]
    T, N, K, num_programs,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr,
):
    tiles_m = tl.cdiv(T, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    k_steps = tl.cdiv(K, BLOCK_K)
    tiles_per_group = GROUP_M * tiles_n
    # flatten: the compiler pipelines the tile loop and the K loop as one, so the loads of the
    # next tile are in flight while this tile's epilogue runs
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, num_programs, flatten=True):
        # consecutive tiles run down a group of GROUP_M row-tiles before moving right, so the
        # programs working at one time share a few weight column-tiles through L2
        first_m = (tile // tiles_per_group) * GROUP_M
        group_rows = min(tiles_m - first_m, GROUP_M)
        off_m = (first_m + (tile % tiles_per_group) % group_rows) * BLOCK_M
        off_n = ((tile % tiles_per_group) // group_rows) * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(k_steps):
            # TMA fills the parts of a box past T, N or K with zeros: no masks, and the padded
            # K columns add nothing to the sum
            a = x_desc.load([off_m, k * BLOCK_K])  # [BLOCK_M, BLOCK_K]
            b = w_desc.load([off_n, k * BLOCK_K])  # [BLOCK_N, BLOCK_K]
            acc = tl.dot(a, b.T, acc, input_precision=PRECISION)
        # TMA clips the store at the tensor's edges
        out_desc.store([off_m, off_n], acc.to(out_desc.dtype))  # [BLOCK_M, BLOCK_N]


def _tma_ready(t: torch.Tensor) -> bool:
    """TMA reads rows from a 16-byte aligned base with 16-byte aligned row strides."""
    return (t.dim() == 2 and t.stride(1) == 1 and t.data_ptr() % 16 == 0
            and (t.stride(0) * t.element_size()) % 16 == 0)


def _check_operands(x: torch.Tensor, weight: torch.Tensor) -> None:
    assert x.dim() == 2, f"x must be [T, K], got shape {tuple(x.shape)}"
    assert weight.dim() == 2 and weight.shape[1] == x.shape[1], \
        f"weight must be [N, {x.shape[1]}], got {tuple(weight.shape)}"
    assert x.dtype in _FLOAT_DTYPES, f"x: unsupported dtype {x.dtype}"
    assert weight.dtype == x.dtype, f"weight dtype {weight.dtype} differs from x dtype {x.dtype}"
    assert weight.device == x.device, f"weight on {weight.device}, x on {x.device}"
    assert x.shape[1] > 0, "K must be positive"
    for name, t in (("x", x), ("weight", weight)):
        assert _tma_ready(t), (f"{name}: TMA needs a contiguous last dimension, a 16-byte aligned base and "
                               f"16-byte aligned row strides (shape {tuple(t.shape)}, strides {t.stride()})")


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _num_sms(device: torch.device) -> int:
    return _sm_count(device.index or 0) if device.type == "cuda" else _INTERPRETER_PROGRAMS


def linear_triton(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None,
                  config: LinearConfig | None = None) -> torch.Tensor:
    """x: [T, K], weight: [N, K] -> [T, N] in x.dtype (fp32 accumulation) with the Triton GEMM.

    ``config=None`` takes the tuning table's config for this shape, else ``default_config``.
    """
    _check_operands(x, weight)
    T, K = x.shape
    N = weight.shape[0]
    if out is None:
        out = torch.empty((T, N), device=x.device, dtype=x.dtype)
    assert out.shape == (T, N), f"out: shape {tuple(out.shape)}, expected {(T, N)}"
    assert out.dtype == x.dtype and out.device == x.device, f"out: {out.dtype} on {out.device}, expected x's"
    assert _tma_ready(out), f"out: TMA needs 16-byte aligned rows (strides {out.stride()})"
    if T == 0 or N == 0:
        return out  # a TMA box cannot describe an empty tensor
    config = config or linear_config(x, weight)
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    tiles = triton.cdiv(T, bm) * triton.cdiv(N, bn)
    programs = min(tiles, config.num_sms or _num_sms(x.device)) if config.persistent else tiles
    _linear_kernel[(programs,)](
        TensorDescriptor.from_tensor(x, [bm, bk]),
        TensorDescriptor.from_tensor(weight, [bn, bk]),
        TensorDescriptor.from_tensor(out, [bm, bn]),
        T, N, K, programs,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=config.group_m,
        # fp32 in full precision, as torch's default fp32 matmul (TF32 off)
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


def linear_cublas(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, K], weight: [N, K] -> [T, N] through torch: cuBLAS on CUDA, oneDNN/MKL on CPU."""
    return F.linear(x, weight) if out is None else torch.mm(x, weight.T, out=out)


def linear_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x: [T, K], weight: [N, K] -> [T, N] in x.dtype, accumulated in fp32."""
    return (x.float() @ weight.float().T).to(x.dtype)


# -- choosing between cuBLAS and Triton per shape (tuning table) ----------------------------------

_IMPLS = ("triton", "cublas", "gemv", "narrow")
_KEY_FIELDS = ("dtype", "N", "K", "T")
_TABLE_OVERRIDE: list[TuningTable] = []  # innermost use_tuning_table() last


def _make_config(**fields) -> LinearConfig | GemvConfig | NarrowConfig:
    """An entry's config: the GEMM's (it has ``block_m``), the token-narrow GEMM's (``block_f``) or the
    decode GEMV's."""
    if "block_m" in fields:
        return LinearConfig(**fields)
    return NarrowConfig(**fields) if "block_f" in fields else GemvConfig(**fields)


def load_linear_table(path) -> TuningTable:
    return load_table(path, "linear", _KEY_FIELDS, _IMPLS, make_config=_make_config)


@functools.cache
def _committed_table(device_name: str) -> TuningTable | None:
    return find_table("linear", device_name, key_fields=_KEY_FIELDS, impls=_IMPLS, make_config=_make_config)


@functools.cache
def _env_table() -> TuningTable | None:
    """``QML_LINEAR_TABLE=path``: a table that replaces the committed one on every device, in a whole
    process (a server or an engine benchmark trying a sweep's table before it is committed)."""
    path = os.environ.get("QML_LINEAR_TABLE")
    return load_linear_table(path) if path else None


@functools.lru_cache(maxsize=4096)
def _tuned(device: torch.device, dtype: torch.dtype, bucket: int, N: int, K: int) -> TuningEntry | None:
    # runs once per (device, dtype, bucket, N, K): the per-call cost is this cache's lookup
    if _TABLE_OVERRIDE:
        table = _TABLE_OVERRIDE[-1]
    elif _env_table() is not None:
        table = _env_table()
    elif device.type == "cuda":
        table = _committed_table(torch.cuda.get_device_name(device))
    else:
        table = None
    return None if table is None else table.lookup(str(dtype).removeprefix("torch."), N, K, bucket)


def tuned_entry(x: torch.Tensor, weight: torch.Tensor) -> TuningEntry | None:
    """The tuning table's entry for this call's shape on x's device (None: not measured there)."""
    return _tuned(x.device, x.dtype, token_bucket(x.shape[0]), weight.shape[0], weight.shape[1])


@contextlib.contextmanager
def use_tuning_table(path):
    """Choose by the table at ``path`` on every device (tests; trying a sweep before committing it)."""
    _TABLE_OVERRIDE.append(load_linear_table(path))
    _tuned.cache_clear()
    try:
        yield _TABLE_OVERRIDE[-1]
    finally:
        _TABLE_OVERRIDE.pop()
        _tuned.cache_clear()


def linear_config(x: torch.Tensor, weight: torch.Tensor) -> LinearConfig:
    """The config ``linear_triton`` uses when given none: the tuning table's, else the heuristic's
    (in the interpreter: few large steps, since there each step costs Python time, not FLOPs)."""
    entry = tuned_entry(x, weight)
    if entry is not None and entry.impl == "triton" and entry.config is not None:
        return entry.config
    T, K = x.shape
    if x.device.type == "cpu":
        return LinearConfig(block_m=16 if T <= 16 else 64, block_n=256, block_k=64, group_m=1, num_warps=4,
                            num_stages=2)
    return default_config(T, weight.shape[0], K, x.dtype, _num_sms(x.device))


def _triton_capable(x, weight, out=None, config=None) -> bool:
    return (isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor) and x.dim() == 2
            and weight.dim() == 2 and x.shape[1] == weight.shape[1] and x.shape[1] > 0
            and x.dtype in _FLOAT_DTYPES and weight.dtype == x.dtype and _tma_ready(x) and _tma_ready(weight)
            and (_tma_ready(out) if isinstance(out, torch.Tensor) else (weight.shape[0] * x.element_size()) % 16 == 0))


def _tuned_to(impl: str, x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the tuning table names ``impl`` for this call's shape."""
    entry = tuned_entry(x, weight)
    return entry is not None and entry.impl == impl


def _routed_to(impl: str, x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``impl`` takes a call it can run: forced, or named by the tuning table. registry.select takes
    the first registered implementation that supports the call, so each of ours (registered before cublas)
    claims only the shapes the table gives it; forced, it takes everything it can run."""
    return registry.forced_impl("linear") == impl or _tuned_to(impl, x, weight)


def _tuned_config(x: torch.Tensor, weight: torch.Tensor, kind: type):
    """The tuning table's launch config for this shape if it is a ``kind``, else None (the kernel's default)."""
    entry = tuned_entry(x, weight)
    return entry.config if entry is not None and isinstance(entry.config, kind) else None


def preferred_impl(x: torch.Tensor, weight: torch.Tensor) -> str:
    """What runs these arguments on a GPU when nothing is forced: "triton", "gemv" or "narrow" where the
    tuning table measured it faster and it can take them, else "cublas"."""
    if _gemv_supports(x, weight):
        return "gemv"
    if _narrow_supports(x, weight):
        return "narrow"
    return "triton" if _triton_capable(x, weight) and _tuned_to("triton", x, weight) else "cublas"


def linear_gemv(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None,
                config: GemvConfig | None = None) -> torch.Tensor:
    """``qml_kernels.gemv``, with the tuning table's config for this shape when given none."""
    return gemv_triton(x, weight, out, config or _tuned_config(x, weight, GemvConfig))


def linear_narrow_tuned(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None,
                        config: NarrowConfig | None = None) -> torch.Tensor:
    """``qml_kernels.linear_narrow``, with the tuning table's config for this shape when given none."""
    return linear_narrow(x, weight, out, config or _tuned_config(x, weight, NarrowConfig))


def _gemv_supports(x, weight, out=None, config=None) -> bool:
    return gemv_capable(x, weight, out) and _routed_to("gemv", x, weight)


def _narrow_supports(x, weight, out=None, config=None) -> bool:
    return narrow_capable(x, weight, out) and _routed_to("narrow", x, weight)


def _triton_supports(x, weight, out=None, config=None) -> bool:
    return _triton_capable(x, weight, out) and _routed_to("triton", x, weight)


register("linear", "reference", linear_ref)
register("linear", "gemv", linear_gemv, devices=("cuda",), supports=_gemv_supports)
register("linear", "narrow", linear_narrow_tuned, devices=("cuda",), supports=_narrow_supports)
register("linear", "triton", linear_triton, devices=("cuda",), supports=_triton_supports)
register("linear", "cublas", linear_cublas, devices=("cuda", "cpu"))

_linear = dispatch("linear")


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """y = x @ weight.T. x: [T, K], weight: [N, K] -> [T, N] in x.dtype.

    On CUDA the registry picks per shape (tuning table: Triton or cuBLAS). On CPU, unless an
    implementation is forced, torch's matmul runs: the registry's CPU default is the reference,
    which would copy every weight to fp32 on each call, while oneDNN/MKL already accumulates in fp32.
    """
    if x.device.type == "cpu" and registry.forced_impl("linear") is None:
        return linear_cublas(x, weight)
    return _linear(x, weight)


# -- workbench ------------------------------------------------------------------------------

def _make_inputs(case: Case, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> dict:
    T, N, K = case.dims["T"], case.dims["N"], case.dims["K"]

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen, device=gen.device)).to(device=device, dtype=dtype)

    # weights scaled like a trained layer's (outputs of order 1, whatever K)
    return {"x": randn(T, K), "weight": randn(N, K, scale=K**-0.5)}


def _bytes(inputs: dict) -> int:
    x, w = inputs["x"], inputs["weight"]
    T, K = x.shape
    N = w.shape[0]
    return (T * K + N * K + T * N) * x.element_size()  # read x and w once, write y once


def _flops(inputs: dict) -> int:
    (T, K), N = inputs["x"].shape, inputs["weight"].shape[0]
    return 2 * T * N * K


SMALL_CASES = (
    Case("one-token", {"T": 1, "N": 40, "K": 72}, edge="1 token (decode): 15 padded rows; N, K below one block"),
    Case("odd-tokens", {"T": 7, "N": 200, "K": 152}, edge="T=7, N and K not multiples of any block size"),
    Case("full-tiles", {"T": 64, "N": 256, "K": 256}, edge="every dimension a multiple of the blocks"),
    Case("row-tail", {"T": 65, "N": 136, "K": 264}, edge="T=65: a second row-tile holding one row; K tail of 8"),
    Case("short-k", {"T": 33, "N": 24, "K": 16}, edge="K=16: one K step, mostly zero-filled by TMA"),
    Case("many-tiles", {"T": 96, "N": 112, "K": 40}, edge="more tiles than programs: persistent walk, groups"),
)

_MODEL_LINEARS = (
    ("llama3.1-8b-qkv", 6144, 4096), ("llama3.1-8b-o", 4096, 4096),
    ("llama3.1-8b-gate-up", 28672, 4096), ("llama3.1-8b-down", 4096, 14336),
    ("qwen3-30b-a3b-qkv", 5120, 2048), ("qwen3-30b-a3b-o", 2048, 4096),
)
MODEL_CASES = tuple(
    Case(f"{name}-T{T}", {"T": T, "N": N, "K": K}, edge=f"{K} -> {N} at {T} tokens")
    for T in (1, 32, 128, 2048, 8192) for name, N, K in _MODEL_LINEARS
)

LINEAR_SPEC = register_spec(OpSpec(
    op="linear",
    reference=linear_ref,
    make_inputs=_make_inputs,
    cases=SMALL_CASES,
    model_cases=MODEL_CASES,
    bytes_moved=_bytes,
    flops=_flops,
    out_arg="out",
    launch_config=LinearConfig,
    notes="compare triton and cublas per case; the winners go into qml_kernels/tuning/linear_h200.json",
))
