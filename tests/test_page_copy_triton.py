"""``qml_kernels.page_copy``: host rows into pool pages (``page_copy``) and pool pages into host rows
(``page_save``), against the references in the interpreter on CPU (bit for bit), their launch
configs, their dispatch, and their compilation for Hopper."""

from __future__ import annotations

import pytest
import torch

from qml_kernels import registry
from qml_kernels.page_copy import (
    PageCopyConfig,
    _page_copy_kernel,
    page_copy_ref,
    page_copy_triton,
    page_save_ref,
    page_save_triton,
)
from qml_kernels.workbench import check

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# copies move bits: every dtype the pool may hold, compared exactly (the interpreter only loads and
# stores here, so bf16 is safe on CPU too)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CONFIGS = {
    "default": None,
    "two-programs-small-steps": PageCopyConfig(num_programs=2, max_block=16, num_warps=1),  # many items each
    "more-programs-than-items": PageCopyConfig(num_programs=64, max_block=4096),
}


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("op", ["page_copy", "page_save"])
def test_matches_reference(op, config):
    report = check(op, "triton", dtypes=DTYPES, device=DEVICE, config=config)
    report.raise_if_failed()


def test_save_then_copy_round_trips_pages_through_other_slots():
    """What the host tier does with a page: saved to a slot, later copied back into another page."""
    gen = torch.Generator().manual_seed(5)
    pool = torch.randn(6, 9, 64, generator=gen).half().to(DEVICE)
    rows = torch.zeros(7, 6, 64, dtype=torch.half)
    if DEVICE.type == "cuda":
        rows = rows.pin_memory()
    pages, slots = torch.tensor([8, 0, 3], device=DEVICE), torch.tensor([6, 2, 4], device=DEVICE)
    page_save_triton(rows, slots, pool, pages)
    back = torch.tensor([1, 5, 7], device=DEVICE)
    before = pool.clone()
    page_copy_triton(pool, back, rows, slots)
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    for src, dst in zip(pages.tolist(), back.tolist()):
        assert torch.equal(pool[:, dst], before[:, src]), (src, dst)
    for slot in (0, 1, 3, 5):  # slots not named stay as they were
        assert not rows[slot].any()


def test_pages_outside_the_list_and_chunks_outside_the_range_keep_their_values():
    gen = torch.Generator().manual_seed(3)
    dst = torch.randn(5, 7, 48, generator=gen).to(DEVICE)
    src = torch.randn(4, 5, 48, generator=gen)
    if DEVICE.type == "cuda":
        src = src.pin_memory()
    before = dst.clone()
    pages, slots = torch.tensor([6, 1], device=DEVICE), torch.tensor([3, 0], device=DEVICE)
    page_copy_triton(dst, pages, src, slots, 1, 3)
    for c in range(5):
        for p in range(7):
            if 1 <= c < 3 and p in (6, 1):
                slot = 3 if p == 6 else 0
                assert torch.equal(dst[c, p].cpu(), src[slot, c]), (c, p)
            else:
                assert torch.equal(dst[c, p], before[c, p]), (c, p)


def test_the_step_divides_the_chunk():
    assert PageCopyConfig().block(16384) == 2048  # Llama-3.1-8B pages: 32 KiB runs, steps of 2,048
    assert PageCopyConfig().block(96) == 32  # W = 96: no step may run past the chunk
    assert PageCopyConfig(max_block=16).block(6144) == 16
    for bad in (dict(num_programs=0), dict(max_block=48), dict(num_warps=0)):
        with pytest.raises(ValueError):
            PageCopyConfig(**bad)


def test_bad_arguments_are_refused_before_a_launch():
    dst, src = torch.zeros(4, 6, 32), torch.zeros(3, 4, 32)
    pages, slots = torch.tensor([1, 2]), torch.tensor([0, 1])
    with pytest.raises(AssertionError):
        page_save_ref(src, slots, dst, pages, 0, 5)  # past the last chunk, the other way
    with pytest.raises(AssertionError):
        page_save_triton(src, slots[:1], dst, pages)  # a slot per page
    with pytest.raises(AssertionError):
        page_copy_ref(dst, pages, src.half(), slots)  # dtypes differ
    with pytest.raises(AssertionError):
        page_copy_ref(dst, pages, torch.zeros(3, 5, 32), slots)  # chunk counts differ
    with pytest.raises(AssertionError):
        page_copy_ref(dst, pages, src, slots[:1])  # a slot per page
    with pytest.raises(AssertionError):
        page_copy_ref(dst, pages, src, slots, 3, 5)  # past the last chunk


def test_dispatch_takes_the_kernel_only_for_a_table_the_device_can_read():
    impl, save = registry.get_impl("page_copy", "triton"), registry.get_impl("page_save", "triton")
    dst, src = torch.zeros(2, 3, 16), torch.zeros(2, 2, 16)
    idx = torch.tensor([0])
    assert not impl.supports(dst, idx, src, idx)  # pageable host memory: not readable in place
    assert not save.supports(src, idx, dst, idx)  # ...nor writable
    if DEVICE.type == "cuda":
        assert impl.supports(dst.cuda(), idx.cuda(), src.pin_memory(), idx.cuda())
        assert save.supports(src.pin_memory(), idx.cuda(), dst.cuda(), idx.cuda())


def test_an_op_with_host_rows_first_runs_where_its_device_tensors_are():
    # page_save takes the host rows first: the op still runs on the pool's device (the reference
    # would copy GBs through pageable memory on the engine thread; seen on the H200 as a 3 s stall)
    rows, idx = torch.zeros(2, 2, 16), torch.tensor([0])
    pool = torch.zeros(2, 3, 16, device="meta")
    assert registry._device_type((rows, idx, pool, idx.to("meta")), {}) == "meta"
    assert registry._device_type((rows, idx), {"pool": pool}) == "meta"
    assert registry._device_type((rows, idx, 3), {}) == "cpu"
    if DEVICE.type == "cuda":
        pinned = rows.pin_memory()
        assert registry.select("page_save", pinned, idx.cuda(), torch.zeros(2, 3, 16, device="cuda"),
                               idx.cuda()).name == "triton"


# -- compilation for the H200 (sm_90a) -------------------------------------------------------

def _variant(width: int, config: PageCopyConfig, dtype: str = "*bf16", to_rows: bool = False) -> dict:
    signature = {"pool_ptr": dtype, "rows_ptr": dtype, "pages_ptr": "*i64", "slots_ptr": "*i64", "n_items": "i32",
                 "chunk_lo": "i32", "n_chunks": "i32", "num_programs": "i32", "stride_pool_chunk": "i64",
                 "stride_pool_page": "i32", "stride_row": "i32", "stride_row_chunk": "i32",
                 "W": "constexpr", "BLOCK": "constexpr", "TO_ROWS": "constexpr"}
    constexprs = {"W": width, "BLOCK": config.block(width), "TO_ROWS": to_rows}
    return {"kernel": _page_copy_kernel, "signature": signature, "constexprs": constexprs,
            "num_warps": config.num_warps, "num_stages": 1,
            "divisible": ("stride_pool_chunk", "stride_pool_page", "stride_row", "stride_row_chunk")}


COMPILE_VARIANTS = {
    "llama-pages-default": _variant(16384, PageCopyConfig()),
    "llama-pages-save": _variant(16384, PageCopyConfig(num_programs=16), to_rows=True),
    "qwen3-moe-pages-wide": _variant(8192, PageCopyConfig(num_programs=64, max_block=4096, num_warps=8)),
    "small-fp32": _variant(96, PageCopyConfig(), "*fp32"),
}


@pytest.mark.parametrize("name", COMPILE_VARIANTS)
def test_compiles_for_hopper(compile_reports, name):
    report = compile_reports[name]
    assert report.ok, report.error
    if name == "small-fp32":
        return  # 32-element steps over 128 threads: one element each, nothing to vectorize
    # 16-byte vectors at the real page sizes: a copy that moves 2 or 4 bytes per instruction would
    # not fill the bus
    assert ".v4.b32" in report.ptx or ".v2.b64" in report.ptx, "no 16-byte loads or stores"
