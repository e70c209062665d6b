"""Prefill attention through cuDNN at bucketed lengths (qml_kernels.attention_cudnn).

cuDNN itself needs a GPU; here its call (``_sdpa``) is swapped for torch's math backend, which
computes the same causal attention, so what is tested is ours: each sequence's K/V gathered from
shuffled pages into a run padded to the bucket, q's padded rows read in place from the storage after
a sequence (or copied when the storage ends), real rows cut out of the padded result. Against
paged_attention_ref; with non-finite values wherever a padded row or key could pick them up, so a
padded key that reached a real row shows; and the shapes cuDNN is asked for (one per bucket).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import qml_kernels.attention_cudnn as attention_cudnn
from qml_kernels.attention import AttentionMetadata, paged_attention_ref
from qml_kernels.attention_cudnn import padded_length, paged_prefill_attention_cudnn, query_slack_rows

H, HKV, DH, S = 4, 2, 32, 16
BUCKET = 32


@pytest.fixture
def calls(monkeypatch):
    """cuDNN's call replaced by the math backend; the [H, L, Dh] shapes it was asked for, in order."""
    shapes = []

    def math_sdpa(q, k, v, scale):
        shapes.append(tuple(q.shape[1:]))
        assert q.shape[2] == k.shape[2] == v.shape[2], "q and K/V padded to the same length"
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)

    monkeypatch.setattr(attention_cudnn, "_sdpa", math_sdpa)
    monkeypatch.setattr(attention_cudnn, "CUDNN_BUCKET", BUCKET)
    return shapes


def _batch(lengths: list[int], gen: torch.Generator, poison: bool = True):
    """Caches of shuffled pages holding fresh prompts of ``lengths``, their metadata and q [T, H, Dh]."""
    pages = [-(-L // S) for L in lengths]
    num_pages = sum(pages) + 3
    fill = float("nan") if poison else 0.0
    k_cache = torch.full((num_pages, S, HKV, DH), fill)
    v_cache = torch.full((num_pages, S, HKV, DH), fill)
    order = torch.randperm(num_pages, generator=gen).tolist()
    tables, slots, cu = [], [], [0]
    for L, n in zip(lengths, pages):
        table, order = order[:n], order[n:]
        tables.append(table)
        for i in range(L):
            slots.append(table[i // S] * S + i % S)
        cu.append(cu[-1] + L)
    width = max(pages)
    tables = [t + [0] * (width - len(t)) for t in tables]
    flat_k, flat_v = k_cache.view(-1, HKV, DH), v_cache.view(-1, HKV, DH)
    idx = torch.tensor(slots)
    flat_k[idx] = torch.randn(len(slots), HKV, DH, generator=gen)
    flat_v[idx] = torch.randn(len(slots), HKV, DH, generator=gen)
    meta = AttentionMetadata.build(slots, tables, cu, lengths, torch.device("cpu"))
    return k_cache, v_cache, meta, cu[-1]


def _q_with_slack(T: int, slack: int, gen: torch.Generator, fill: float = float("nan")) -> torch.Tensor:
    """q [T, H, Dh] whose storage holds ``slack`` more rows of ``fill`` after it."""
    buf = torch.full((T + slack, H, DH), fill)
    buf[:T] = torch.randn(T, H, DH, generator=gen)
    return buf[:T]


def test_padded_length_rounds_up_to_the_bucket():
    assert [padded_length(L, 128) for L in (1, 127, 128, 129, 8890, 26900)] == [128, 128, 128, 256, 8960, 27008]
    assert padded_length(8891, 1) == 8891


def test_query_slack_only_for_steps_this_path_takes():
    def meta(cu, lens):
        return SimpleNamespace(cu_seqlens_q_host=cu, context_lens_host=lens)

    N = attention_cudnn.CUDNN_MIN_TOKENS
    assert query_slack_rows(meta([0, N - 1], [N - 1])) == 0  # too short
    assert query_slack_rows(meta([0, N], [N])) == attention_cudnn.CUDNN_BUCKET - 1
    assert query_slack_rows(meta([0, 600, 600 + N], [600, N])) == attention_cudnn.CUDNN_BUCKET - 1
    # a chunk over cached context keeps q in the projection's buffer (attention_chunk's graphs by its stride)
    assert query_slack_rows(meta([0, N], [N + 8192])) == 0
    assert query_slack_rows(meta([0, 600, 600 + N], [600 + 100, N])) == 0


@pytest.mark.parametrize("lengths", [[37], [64], [5, 70, 33], [2, 3]])
@pytest.mark.parametrize("slack", [0, BUCKET - 1], ids=["no-slack", "slack"])
def test_bucketed_lengths_match_the_reference(calls, lengths, slack):
    gen = torch.Generator().manual_seed(sum(lengths) + slack)
    k_cache, v_cache, meta, T = _batch(lengths, gen)
    q = _q_with_slack(T, slack, gen)
    out = paged_prefill_attention_cudnn(q, k_cache, v_cache, meta, DH**-0.5)
    ref = paged_attention_ref(q, torch.nan_to_num(k_cache), torch.nan_to_num(v_cache), meta, DH**-0.5)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert calls == [(H, padded_length(L, BUCKET), DH) for L in lengths]


def test_lengths_in_one_bucket_share_a_shape(calls):
    gen = torch.Generator().manual_seed(0)
    for L in (33, 40, 64):
        k_cache, v_cache, meta, T = _batch([L], gen)
        paged_prefill_attention_cudnn(_q_with_slack(T, BUCKET, gen), k_cache, v_cache, meta, DH**-0.5)
    assert calls == [(H, 64, DH)] * 3


def test_padded_query_rows_are_read_in_place_when_the_storage_holds_them():
    gen = torch.Generator().manual_seed(1)
    q = _q_with_slack(40, 30, gen)
    view = attention_cudnn._padded_rows(q, 10, 60, 30)  # rows 10..69 of a storage of 70 rows
    assert view.data_ptr() == q[10].data_ptr() and view.shape == (60, H, DH)
    copy = attention_cudnn._padded_rows(q, 10, 64, 30)  # 74 rows: past the storage
    assert copy.data_ptr() != q.data_ptr()
    torch.testing.assert_close(copy[:30], q[10:40], rtol=0, atol=0)
    assert (copy[30:] == 0).all()


def test_exact_lengths_when_the_bucket_is_one(calls, monkeypatch):
    monkeypatch.setattr(attention_cudnn, "CUDNN_BUCKET", 1)
    gen = torch.Generator().manual_seed(2)
    k_cache, v_cache, meta, T = _batch([37, 5], gen)
    q = torch.randn(T, H, DH, generator=gen)
    out = paged_prefill_attention_cudnn(q, k_cache, v_cache, meta, DH**-0.5)
    ref = paged_attention_ref(q, torch.nan_to_num(k_cache), torch.nan_to_num(v_cache), meta, DH**-0.5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert calls == [(H, 37, DH), (H, 5, DH)]
