"""Page copy: whole KV pages from rows of a (pinned) host table into the paged GPU pool, in one launch.

A restore from host RAM moves a conversation's history back into GPU pages: for Llama-3.1-8B a
27k-token history is ~1,700 pages of 2 MiB (32 layers x K and V x 16 slots x 8 heads x 128 dims,
bf16), 3.5 GB. The host tier keeps a page as one row, laid out ``[C, W]`` (C = layers x 2 chunks
of W elements: the page's slots of one layer's K or V), while the pool is ``[C, P, W]``. So each
(page, chunk) is a contiguous W-element run on both sides, 32 KiB here, but a page's 64 chunks
land 2 MiB... 4 GiB apart in the pool.

The copy engine cannot do that in one call: the runtime's earlier path copied host rows into a
GPU staging buffer (one copy per run of consecutive slots) and scattered the staging into the
pages with a second kernel, all on one stream (20-37 GB/s measured end to end on the H200 against
the 55 GB/s of one large pinned copy). Here a kernel reads the pinned host rows directly (the
device addresses pinned memory through unified virtual addressing: "zero copy") and stores each
chunk into its page: no staging, no scatter, and a launch can take any range of chunks, so a
restore can be split by layer and layer ``l``'s copy can run beside the prefill of layers below it.

Grid: ``num_programs`` persistent programs; program ``p`` takes items ``p, p + num_programs, ...``
of the ``n_pages x n_chunks`` (page-major: consecutive items read consecutive host bytes), each a
W-element run moved in BLOCK-element steps. A few dozen programs keep enough reads in flight to
fill the bus (latency ~1-2 us x 55 GB/s ~ 100 KB in flight) while leaving the other SMs to the
prefill running beside it.

Traffic: reads ``n_pages x n_chunks x W`` elements over the host link and writes as many to HBM;
no arithmetic. The same kernel copies device-to-device when the table is on the GPU.

``page_save`` runs the same kernel the other way (``TO_ROWS``): pool pages into host rows, stored in
place. The runtime copies a finished request's pages down to host RAM so (``KVTiers.pump``): no device
staging buffer, and any number of pages per launch, so the copy can run beside a long prefill.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from qml_kernels.registry import dispatch, register
from qml_kernels.workbench.spec import Case, OpSpec, register_spec


@dataclass(frozen=True)
class PageCopyConfig:
    """Launch tunables: persistent programs (the copy's share of the SMs), warps per program and
    the largest step, in elements (a power of 2; the step used divides W)."""

    num_programs: int = 32
    num_warps: int = 4
    max_block: int = 2048

    def __post_init__(self):
        if self.num_programs < 1 or self.num_warps < 1 or self.max_block < 1 or self.max_block & (self.max_block - 1):
            raise ValueError("PageCopyConfig: num_programs, num_warps >= 1 and max_block a power of 2, got "
                             f"{self}")

    def block(self, width: int) -> int:
        """The largest power of 2 <= max_block that divides ``width``: steps never run past a chunk."""
        return min(self.max_block, width & -width)


def _check(dst: torch.Tensor, pages: torch.Tensor, src: torch.Tensor, slots: torch.Tensor, chunk_lo: int,
           chunk_hi: int) -> None:
    assert dst.dim() == 3 and src.dim() == 3, "dst [C, P, W], src [N, C, W]"
    assert dst.shape[0] == src.shape[1] and dst.shape[2] == src.shape[2], (tuple(dst.shape), tuple(src.shape))
    assert dst.dtype == src.dtype, (dst.dtype, src.dtype)
    assert dst.stride(2) == 1 and src.stride(2) == 1, "chunks must be contiguous"
    assert pages.dim() == 1 and slots.shape == pages.shape, (tuple(pages.shape), tuple(slots.shape))
    assert 0 <= chunk_lo <= chunk_hi <= dst.shape[0], (chunk_lo, chunk_hi, dst.shape[0])


def page_copy_ref(dst: torch.Tensor, pages: torch.Tensor, src: torch.Tensor, slots: torch.Tensor,
                  chunk_lo: int = 0, chunk_hi: int | None = None,
                  config: PageCopyConfig | None = None) -> torch.Tensor:
    """``dst[c, pages[i]] = src[slots[i], c]`` for every i and ``chunk_lo <= c < chunk_hi``; returns dst."""
    chunk_hi = dst.shape[0] if chunk_hi is None else chunk_hi
    _check(dst, pages, src, slots, chunk_lo, chunk_hi)
    if pages.numel() == 0 or chunk_lo == chunk_hi:
        return dst
    rows = src[slots.to(src.device).long(), chunk_lo:chunk_hi]  # [n, c, W]
    dst[chunk_lo:chunk_hi, pages.to(dst.device).long()] = rows.transpose(0, 1).to(dst.device)
    return dst


# the counts, the chunk range and the grid change with every restore: specialising on them
# (divisibility by 16, == 1, constexpr) would compile a variant for a request to wait on
@triton.jit(do_not_specialize=["n_items", "chunk_lo", "n_chunks", "num_programs"])
def _page_copy_kernel(pool_ptr, rows_ptr, pages_ptr, slots_ptr, n_items, chunk_lo, n_chunks, num_programs,
                      stride_pool_chunk, stride_pool_page, stride_row, stride_row_chunk,
                      W: tl.constexpr, BLOCK: tl.constexpr, TO_ROWS: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    for item in range(tl.program_id(0), n_items, num_programs):
        i = item // n_chunks
        c = (chunk_lo + item % n_chunks).to(tl.int64)
        # int64: a pool of several GB passes 2^31 elements
        page = tl.load(pages_ptr + i).to(tl.int64)
        slot = tl.load(slots_ptr + i).to(tl.int64)
        p = pool_ptr + c * stride_pool_chunk + page * stride_pool_page
        r = rows_ptr + slot * stride_row + c * stride_row_chunk
        for w in range(0, W, BLOCK):
            if TO_ROWS:  # page_save: pool -> rows (stores into pinned host memory are posted writes)
                tl.store(r + w + offs, tl.load(p + w + offs))
            else:  # page_copy: rows -> pool
                tl.store(p + w + offs, tl.load(r + w + offs))


def _launch(pool: torch.Tensor, pages: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, chunk_lo: int,
            chunk_hi: int, config: PageCopyConfig, to_rows: bool) -> None:
    n_chunks = chunk_hi - chunk_lo
    n_items = pages.numel() * n_chunks
    if n_items == 0:
        return
    W = pool.shape[2]
    programs = min(config.num_programs, n_items)
    _page_copy_kernel[(programs,)](
        pool, rows, pages, slots, n_items, chunk_lo, n_chunks, programs,
        pool.stride(0), pool.stride(1), rows.stride(0), rows.stride(1),
        W=W, BLOCK=config.block(W), TO_ROWS=to_rows, num_warps=config.num_warps)


def page_copy_triton(dst: torch.Tensor, pages: torch.Tensor, src: torch.Tensor, slots: torch.Tensor,
                     chunk_lo: int = 0, chunk_hi: int | None = None,
                     config: PageCopyConfig | None = None) -> torch.Tensor:
    """``page_copy_ref``'s copy in one launch; ``src`` may be pinned host memory (read in place)
    while ``dst``, ``pages`` and ``slots`` are on the device."""
    config = config or PageCopyConfig()
    chunk_hi = dst.shape[0] if chunk_hi is None else chunk_hi
    _check(dst, pages, src, slots, chunk_lo, chunk_hi)
    assert pages.device == dst.device == slots.device, "pages and slots live beside dst"
    _launch(dst, pages, src, slots, chunk_lo, chunk_hi, config, to_rows=False)
    return dst


def _page_copy_supports(dst, pages, src, slots, *args, **kwargs) -> bool:
    # the kernel reads the table in place: on the device, or pinned (mapped into the device's
    # address space); pageable host memory is not
    return src.is_cuda or src.is_pinned()


register("page_copy", "reference", page_copy_ref)
register("page_copy", "triton", page_copy_triton, supports=_page_copy_supports)
page_copy = dispatch("page_copy")


def _make_inputs(case: Case, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> dict:
    d = case.dims
    C, P, W, N, n = d["C"], d["P"], d["W"], d["N"], d["n"]
    dst = torch.randn(C, P, W, generator=gen, device=gen.device).to(dtype).to(device)  # pages that must survive
    src = torch.randn(N, C, W, generator=gen, device=gen.device).to(dtype).cpu()
    if device.type == "cuda":
        src = src.pin_memory()  # the host tier's table, read in place by the kernel
    pages = torch.randperm(P, generator=gen, device=gen.device)[:n].to(device)
    slots = torch.randperm(N, generator=gen, device=gen.device)[:n].to(device)
    return {"dst": dst, "pages": pages, "src": src, "slots": slots, "chunk_lo": d.get("lo", 0),
            "chunk_hi": d.get("hi", C)}


def _bytes(inputs: dict) -> int:
    chunks = inputs["chunk_hi"] - inputs["chunk_lo"]
    return 2 * inputs["pages"].numel() * chunks * inputs["dst"].shape[2] * inputs["dst"].element_size()


SMALL_CASES = (
    Case("one-page", {"C": 4, "P": 8, "W": 96, "N": 5, "n": 1}, edge="one page, W not a power of 2 (steps of 32)"),
    Case("chunk-range", {"C": 6, "P": 16, "W": 64, "N": 12, "n": 9, "lo": 2, "hi": 5},
         edge="scattered pages and slots, a range of chunks (one restore's layers)"),
    Case("empty", {"C": 3, "P": 4, "W": 32, "N": 3, "n": 0}, edge="no pages: nothing written"),
)

MODEL_CASES = (
    Case("llama3.1-8b-1708-pages", {"C": 64, "P": 2048, "W": 16384, "N": 1800, "n": 1708},
         edge="a 27k-token Llama-3.1-8B history: 3.5 GB from pinned host rows into scattered pages"),
    Case("llama3.1-8b-one-layer", {"C": 64, "P": 2048, "W": 16384, "N": 1800, "n": 1708, "lo": 10, "hi": 12},
         edge="one layer's K and V of that history (a per-layer restore)"),
)

PAGE_COPY_SPEC = register_spec(OpSpec(
    op="page_copy",
    reference=page_copy_ref,
    make_inputs=_make_inputs,
    cases=SMALL_CASES,
    model_cases=MODEL_CASES,
    bytes_moved=_bytes,
    exact=True,
    out_arg=None,
    launch_config=PageCopyConfig,
    notes="returns dst, written in place and compared whole: pages not named must keep their values.",
))


# --- page_save: the other direction, pool pages into (pinned) host rows ----------------------------

def page_save_ref(rows: torch.Tensor, slots: torch.Tensor, pool: torch.Tensor, pages: torch.Tensor,
                  chunk_lo: int = 0, chunk_hi: int | None = None,
                  config: PageCopyConfig | None = None) -> torch.Tensor:
    """``rows[slots[i], c] = pool[c, pages[i]]`` for every i and ``chunk_lo <= c < chunk_hi``; returns rows."""
    chunk_hi = pool.shape[0] if chunk_hi is None else chunk_hi
    _check(pool, pages, rows, slots, chunk_lo, chunk_hi)
    if pages.numel() == 0 or chunk_lo == chunk_hi:
        return rows
    got = pool[chunk_lo:chunk_hi, pages.to(pool.device).long()]  # [c, n, W]
    rows[slots.to(rows.device).long(), chunk_lo:chunk_hi] = got.transpose(0, 1).to(rows.device)
    return rows


def page_save_triton(rows: torch.Tensor, slots: torch.Tensor, pool: torch.Tensor, pages: torch.Tensor,
                     chunk_lo: int = 0, chunk_hi: int | None = None,
                     config: PageCopyConfig | None = None) -> torch.Tensor:
    """``page_save_ref``'s copy in one launch; ``rows`` may be pinned host memory, written in place
    (the runtime copies kept pages down to host RAM so, with no device staging buffer: the copy
    can then run beside a prefill without holding GBs of device memory)."""
    config = config or PageCopyConfig()
    chunk_hi = pool.shape[0] if chunk_hi is None else chunk_hi
    _check(pool, pages, rows, slots, chunk_lo, chunk_hi)
    assert pages.device == pool.device == slots.device, "pages and slots live beside the pool"
    _launch(pool, pages, rows, slots, chunk_lo, chunk_hi, config, to_rows=True)
    return rows


def _page_save_supports(rows, slots, pool, pages, *args, **kwargs) -> bool:
    return rows.is_cuda or rows.is_pinned()


register("page_save", "reference", page_save_ref)
register("page_save", "triton", page_save_triton, supports=_page_save_supports)
page_save = dispatch("page_save")


def _make_save_inputs(case: Case, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> dict:
    copy = _make_inputs(case, dtype, device, gen)  # the same shapes, the other way round
    return {"rows": copy["src"], "slots": copy["slots"], "pool": copy["dst"], "pages": copy["pages"],
            "chunk_lo": copy["chunk_lo"], "chunk_hi": copy["chunk_hi"]}


def _save_bytes(inputs: dict) -> int:
    chunks = inputs["chunk_hi"] - inputs["chunk_lo"]
    return 2 * inputs["pages"].numel() * chunks * inputs["pool"].shape[2] * inputs["pool"].element_size()


PAGE_SAVE_SPEC = register_spec(OpSpec(
    op="page_save",
    reference=page_save_ref,
    make_inputs=_make_save_inputs,
    cases=SMALL_CASES,
    model_cases=MODEL_CASES,
    bytes_moved=_save_bytes,
    exact=True,
    out_arg=None,
    launch_config=PageCopyConfig,
    notes="returns rows, written in place and compared whole: slots not named must keep their values.",
))
