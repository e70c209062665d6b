"""``qml_kernels.page_copy``: host rows into pool pages, against the reference in the interpreter on
CPU (bit for bit), its launch configs, its dispatch, and its compilation for Hopper."""

from __future__ import annotations

import pytest
import torch

from qml_kernels import registry
from qml_kernels.page_copy import PageCopyConfig, _page_copy_kernel, page_copy_ref, page_copy_triton
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
def test_page_copy_matches_reference(config):
    report = check("page_copy", "triton", dtypes=DTYPES, device=DEVICE, config=config)
    report.raise_if_failed()


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
        page_copy_ref(dst, pages, src.half(), slots)  # dtypes differ
    with pytest.raises(AssertionError):
        page_copy_ref(dst, pages, torch.zeros(3, 5, 32), slots)  # chunk counts differ
    with pytest.raises(AssertionError):
        page_copy_ref(dst, pages, src, slots[:1])  # a slot per page
    with pytest.raises(AssertionError):
        page_copy_ref(dst, pages, src, slots, 3, 5)  # past the last chunk


def test_dispatch_takes_the_kernel_only_for_a_table_the_device_can_read():
    impl = registry.get_impl("page_copy", "triton")
    dst, src = torch.zeros(2, 3, 16), torch.zeros(2, 2, 16)
    idx = torch.tensor([0])
    assert not impl.supports(dst, idx, src, idx)  # pageable host memory: not readable in place
    if DEVICE.type == "cuda":
        assert impl.supports(dst.cuda(), idx.cuda(), src.pin_memory(), idx.cuda())


# -- compilation for the H200 (sm_90a) -------------------------------------------------------

def _variant(width: int, config: PageCopyConfig, dtype: str = "*bf16") -> dict:
    signature = {"dst_ptr": dtype, "src_ptr": dtype, "pages_ptr": "*i64", "slots_ptr": "*i64", "n_items": "i32",
                 "chunk_lo": "i32", "n_chunks": "i32", "num_programs": "i32", "stride_dst_chunk": "i64",
                 "stride_dst_page": "i32", "stride_src_row": "i32", "stride_src_chunk": "i32",
                 "W": "constexpr", "BLOCK": "constexpr"}
    constexprs = {"W": width, "BLOCK": config.block(width)}
    return {"kernel": _page_copy_kernel, "signature": signature, "constexprs": constexprs,
            "num_warps": config.num_warps, "num_stages": 1,
            "divisible": ("stride_dst_chunk", "stride_dst_page", "stride_src_row", "stride_src_chunk")}


COMPILE_VARIANTS = {
    "llama-pages-default": _variant(16384, PageCopyConfig()),
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
