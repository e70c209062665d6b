"""cudnn-frontend's SDPA graphs over our paged KV pool, as ``attention_turn`` and ``attention_chunk`` build and run
them: the module (None where it is not installed), a graph on its own handle whose K/V are the pool's pages, its
plans and workspace, and its launch on torch's current stream."""

from __future__ import annotations

import functools

import torch


@functools.cache
def module():
    """cudnn-frontend's module, or None where it is not installed (CPU machines, CI)."""
    try:
        import cudnn

        return cudnn
    except Exception:  # noqa: BLE001 - missing, or its backend library cannot load: not available
        return None


def paged_graph(cudnn, dtype: torch.dtype, pool_shape, pool_strides, ints: dict[str, torch.Tensor]):
    """A new graph on its own handle with the pool's K and V declared (tensors "k", "v") and the integer operands
    ``ints`` (int32 or int64, by name). Returns (handle, graph, io data type, {name: graph tensor})."""
    dt = cudnn.data_type
    io = dt.BFLOAT16 if dtype == torch.bfloat16 else dt.HALF
    handle = cudnn.create_handle()
    g = cudnn.pygraph(io_data_type=io, intermediate_data_type=dt.FLOAT, compute_data_type=dt.FLOAT, handle=handle)
    t = {name: g.tensor(name=name, dim=list(buf.shape), stride=list(buf.stride()),
                        data_type=dt.INT64 if buf.dtype == torch.int64 else dt.INT32) for name, buf in ints.items()}
    # our pool [P, S, Hkv, D] as cuDNN's container [P, Hkv, S, D]: the same bytes, by strides
    P, S, Hkv, D = pool_shape
    dims = [P, Hkv, S, D]
    strides = [pool_strides[0], pool_strides[2], pool_strides[1], pool_strides[3]]
    t["k"] = g.tensor(name="k", dim=dims, stride=strides, data_type=io)
    t["v"] = g.tensor(name="v", dim=dims, stride=strides, data_type=io)
    return handle, g, io, t


def build(cudnn, g, device) -> torch.Tensor:
    """Check and plan the declared graph (cuDNN raises where it declines it); returns its workspace."""
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    return torch.empty(max(g.get_workspace_size(), 1), dtype=torch.uint8, device=device)


def execute(cudnn, handle, g, feeds: dict, workspace: torch.Tensor) -> None:
    """Launch on torch's current stream (cuDNN launches on its handle's: a CUDA graph captures on a side one)."""
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    g.execute(feeds, workspace, handle=handle)
