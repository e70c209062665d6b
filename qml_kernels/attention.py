"""Attention over a paged KV cache, and the write of new K/V into its pages.

Cache layout, per layer: ``k_cache, v_cache: [P, S, Hkv, Dh]`` (P pages of S tokens).
A sequence's tokens live in the pages listed by its row of ``block_tables``; token
``t`` of sequence ``b`` is at slot ``block_tables[b, t // S] * S + t % S``.

A step's queries are ragged: sequence ``b`` owns query rows
``cu_seqlens_q[b]:cu_seqlens_q[b+1]``, which are its *last* tokens, so the query
at row ``i`` of a sequence with ``L = context_lens[b]`` tokens sits at position
``L - n_q + i`` and sees keys at positions ``<= L - n_q + i`` (causal). This one
form covers prefill, chunked prefill, prefill after a prefix-cache hit, and decode.
Options: GQA (H a multiple of Hkv), a sliding window W (keys with
``pos - W < key_pos``), per-head attention sinks (a logit with no value, joined to
the softmax), and tanh logit soft-capping.
"""

from __future__ import annotations

import importlib
from array import array
from dataclasses import dataclass, field

import torch

from qml_kernels.registry import dispatch, register


@dataclass
class AttentionMetadata:
    """Where a step's tokens go in the paged cache and what each query sees.

    Built once per batch by the runner and read by every layer (plan once, run per
    layer). Device tensors feed the kernels; host copies let reference code and
    launchers size grids without synchronizing with the device.
    """

    slot_mapping: torch.Tensor  # [T] int64: cache slot written by each token (negative: none)
    block_tables: torch.Tensor  # [B, pages per seq] int32
    cu_seqlens_q: torch.Tensor  # [B+1] int32: query row offsets
    context_lens: torch.Tensor  # [B] int32: tokens in cache after this step
    cu_seqlens_q_host: list[int]
    context_lens_host: list[int]
    # how many sequences, from the first, may have cached keys before their queries (None: all). A prefill
    # graph's last sequence is its padding rows over only their own keys: attention_turn launches cuDNN over
    # the others' histories only (3 runs of entries for the turn, not 6 with the padding's empty ones)
    history_seqs: int | None = None
    # what a kernel derives from this metadata once and reuses at every layer (attention_turn's runs)
    plans: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def build(cls, slot_mapping: list[int] | torch.Tensor, block_tables: list[list[int]], cu_seqlens_q: list[int],
              context_lens: list[int], device) -> AttentionMetadata:
        return cls(
            slot_mapping=host_to_device(torch.as_tensor(slot_mapping, dtype=torch.int64), device),
            block_tables=host_to_device(block_tables_tensor(block_tables), device),
            cu_seqlens_q=host_to_device(torch.tensor(cu_seqlens_q, dtype=torch.int32), device),
            context_lens=host_to_device(torch.tensor(context_lens, dtype=torch.int32), device),
            cu_seqlens_q_host=list(cu_seqlens_q),
            context_lens_host=list(context_lens),
        )

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens_host)

    @property
    def max_q_len(self) -> int:
        cu = self.cu_seqlens_q_host
        return max(b - a for a, b in zip(cu, cu[1:]))

    @property
    def is_decode(self) -> bool:
        """Every sequence brings exactly one new token."""
        return self.max_q_len == 1


def host_to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A CPU tensor copied to ``device`` without the host waiting for the device. To a GPU it goes through
    pinned memory and is queued behind the stream's work: from pageable memory the copy may synchronise
    with the stream, holding the host until the device has run all that was queued before it (a step
    whose layers wait for KV restored from host RAM then launched its end only after the restore)."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def block_tables_tensor(block_tables: list[list[int]]) -> torch.Tensor:
    """The tables as one CPU int32 tensor [B, longest], rows padded with page 0.

    Built through one flat buffer of C ints, not nested lists: the tables grow with the context,
    and are built at every step (64 tables of ~1,700 pages, 27k-token contexts: 4.6 -> 1.3 ms;
    one: 0.06 -> 0.02 ms)."""
    B, width = len(block_tables), max(map(len, block_tables))
    if width == 0:
        return torch.zeros(B, 0, dtype=torch.int32)
    flat = array("i", bytes(4 * B * width))
    for i, table in enumerate(block_tables):
        flat[i * width:i * width + len(table)] = array("i", table)
    return torch.frombuffer(flat, dtype=torch.int32).view(B, width)  # (keeps ``flat`` alive)


assert array("i").itemsize == 4  # torch.int32


def kv_write_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Scatter k, v: [T, Hkv, Dh] into the caches at ``slot_mapping``: [T] (negative = skip)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]  # [T']
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k[keep].to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v[keep].to(v_cache.dtype))


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [T, H, Dh]; caches: [P, S, Hkv, Dh]; sinks: [H] or None -> out [T, H, Dh] in q.dtype.

    Loops over sequences in Python using the metadata's host lists: clear rather than fast.
    """
    T, H, Dh = q.shape
    page_size, Hkv = k_cache.shape[1], k_cache.shape[2]
    group = H // Hkv
    block_tables = meta.block_tables
    out = torch.empty_like(q) if out is None else out
    for b, L in enumerate(meta.context_lens_host):
        q0, q1 = meta.cu_seqlens_q_host[b], meta.cu_seqlens_q_host[b + 1]
        n_q = q1 - q0
        if n_q == 0:
            continue
        pages = block_tables[b, : -(-L // page_size)]  # [ceil(L/S)]
        k = k_cache[pages].reshape(-1, Hkv, Dh)[:L].float()  # [L, Hkv, Dh]
        v = v_cache[pages].reshape(-1, Hkv, Dh)[:L].float()
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, Dh]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        qb = q[q0:q1].float().transpose(0, 1)  # [H, n_q, Dh]
        logits = qb @ k.transpose(1, 2) * scale  # [H, n_q, L]
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        q_pos = torch.arange(L - n_q, L, device=q.device)[:, None]  # [n_q, 1]
        k_pos = torch.arange(L, device=q.device)[None, :]  # [1, L]
        visible = k_pos <= q_pos
        if sliding_window is not None:
            visible &= k_pos > q_pos - sliding_window
        logits = logits.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            sink_col = sinks.float().view(H, 1, 1).expand(H, n_q, 1)
            probs = torch.softmax(torch.cat((logits, sink_col), dim=-1), dim=-1)[..., :L]
        else:
            probs = torch.softmax(logits, dim=-1)
        out[q0:q1] = (probs @ v).transpose(0, 1).to(q.dtype)  # [n_q, H, Dh]
    return out


kv_write = kv_write_ref  # torch's index_copy_ is one scatter kernel on the GPU already


def _kernel_for(meta: AttentionMetadata, q: torch.Tensor):
    """The Triton kernel module for this batch: split-KV decode when every sequence brings one
    token, the varlen flash-attention kernel otherwise (imported here: both import this module)."""
    if meta.is_decode and q.shape[0] == meta.num_seqs:
        from qml_kernels import attention_decode as module
    else:
        from qml_kernels import attention_prefill as module
    return module


def _paged_attention_triton(q, k_cache, v_cache, meta, scale, sliding_window=None, sinks=None, softcap=None,
                            out=None):
    module = _kernel_for(meta, q)
    launch = getattr(module, "paged_decode_attention_triton", None) or module.paged_prefill_attention_triton
    return launch(q, k_cache, v_cache, meta, scale, sliding_window, sinks, softcap, out)


def _triton_supports(q, k_cache, v_cache, meta, *args, **kwargs) -> bool:
    return _kernel_for(meta, q)._supported(q, k_cache, v_cache, meta, *args, **kwargs)


def _imported(module: str, name: str, cuda_only: bool = False):
    """``qml_kernels.<module>.<name>``, looked up at each call (those modules import this one); ``cuda_only``:
    a support check, False for tensors off the GPU without importing the module."""

    def call(*args, **kwargs):
        if cuda_only and not args[0].is_cuda:
            return False
        return getattr(importlib.import_module(f"qml_kernels.{module}"), name)(*args, **kwargs)

    return call


register("kv_write", "reference", kv_write_ref)
register("paged_attention", "reference", paged_attention_ref)
# first choice for fresh prompts (faster where it applies), then Triton for everything
register("paged_attention", "cudnn", _imported("attention_cudnn", "paged_prefill_attention_cudnn"), devices=("cuda",),
         supports=_imported("attention_cudnn", "supported", cuda_only=True))
# a turn of a few hundred queries over a long cached history: cuDNN over the history, Triton over the rest
register("paged_attention", "cudnn_turn", _imported("attention_turn", "turn_attention"), devices=("cuda",),
         supports=_imported("attention_turn", "supported", cuda_only=True))
# long chunks over a cached history (each sequence >= 512 queries), eager steps only
register("paged_attention", "cudnn_chunk", _imported("attention_chunk", "chunk_attention"), devices=("cuda",),
         supports=_imported("attention_chunk", "supported", cuda_only=True))
register("paged_attention", "triton", _paged_attention_triton, devices=("cuda",), supports=_triton_supports)
paged_attention = dispatch("paged_attention")
