"""Sampling reference: greedy exactly, seeded draws reproducibly per (seed, step), the filtered distribution
statistically."""

from __future__ import annotations

import pytest
import torch

from qml_kernels.sampling import filter_logits_ref, sample_ref, stream_seed

# chi-square critical values at p = 1e-4 (a correct sampler fails about once in 10,000 runs)
CHI2_CRIT = {1: 15.14, 2: 18.42, 3: 21.11, 7: 29.88}


def rows(n: int, **kw):
    """Per-row parameter tensors for n rows (defaults: plain sampling at temperature 1)."""
    p = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0} | kw
    return (torch.full((n,), float(p["temperature"])), torch.full((n,), int(p["top_k"])),
            torch.full((n,), float(p["top_p"])), torch.full((n,), float(p["min_p"])))


def draw(probs: list[float], n: int, **kw) -> torch.Tensor:
    """n samples from one distribution: one request (a fresh random seed) over n successive steps."""
    logits = torch.tensor(probs).log().expand(n, -1).contiguous()
    seed = torch.randint(0, 2**62, ()).item()
    return sample_ref(logits, *rows(n, **kw), torch.full((n,), seed), torch.arange(n))


def chi2(samples: torch.Tensor, expected: list[float]) -> tuple[float, int]:
    n = samples.numel()
    counts = torch.bincount(samples, minlength=len(expected)).double()
    exp = torch.tensor(expected, dtype=torch.float64) * n
    support = exp > 0
    assert (counts[~support] == 0).all(), f"a filtered-out token was drawn: {counts.tolist()}"
    stat = ((counts[support] - exp[support]) ** 2 / exp[support]).sum().item()
    return stat, int(support.sum()) - 1


def test_greedy_rows_are_exact_argmax_and_others_untouched():
    logits = torch.randn(6, 1000)
    logits[1, 10:20] = logits[1].max() + 1  # a tie: argmax is the lowest index
    temp = torch.tensor([0.0, 0.0, 1.0, 0.7, 0.0, 1.3])
    out = sample_ref(logits, temp, torch.zeros(6, dtype=torch.long), torch.ones(6), torch.zeros(6),
                     torch.arange(6), torch.zeros(6, dtype=torch.long))
    greedy = temp == 0
    assert torch.equal(out[greedy], logits[greedy].argmax(-1)) and out[1].item() == 10


def test_seeded_rows_reproduce_whatever_the_batch():
    logits = torch.randn(4, 500)
    params = rows(4, temperature=0.9, top_p=0.95)
    seeds, steps = torch.tensor([1, 2, 3, 4]), torch.tensor([0, 5, 7, 7])
    first = [sample_ref(logits, *params, seeds, steps) for _ in range(2)]
    assert torch.equal(first[0], first[1])
    # the same row alone, or among other rows in another order, draws the same token
    alone = sample_ref(logits[2:3], *rows(1, temperature=0.9, top_p=0.95), seeds[2:3], steps[2:3])
    assert alone.item() == first[0][2].item()
    others = torch.cat([torch.randn(3, 500), logits[2:3]])
    mixed = sample_ref(others, *rows(4, temperature=0.9, top_p=0.95), torch.tensor([9, 8, 7, 3]),
                       torch.tensor([1, 1, 1, 7]))
    assert mixed[3].item() == first[0][2].item()


def test_steps_and_seeds_give_distinct_streams():
    assert len({stream_seed(s, t) for s in range(50) for t in range(50)}) == 2500
    flat = torch.zeros(64, 1000)  # uniform: 64 draws from one stream would rarely repeat a token twice
    tokens = sample_ref(flat, *rows(64), torch.full((64,), 11), torch.arange(64))
    assert tokens.unique().numel() > 50


@pytest.mark.parametrize("kw, expected", [
    ({}, [0.4, 0.2, 0.15, 0.1, 0.05, 0.05, 0.03, 0.02]),  # plain: the distribution itself
    ({"top_k": 2}, [0.4 / 0.6, 0.2 / 0.6, 0, 0, 0, 0, 0, 0]),
    ({"top_p": 0.7}, [0.4 / 0.75, 0.2 / 0.75, 0.15 / 0.75, 0, 0, 0, 0, 0]),  # mass before 3rd token is 0.6 < 0.7
    ({"min_p": 0.3}, [0.4 / 0.75, 0.2 / 0.75, 0.15 / 0.75, 0, 0, 0, 0, 0]),  # keep p >= 0.12
    ({"temperature": 0.5}, None),  # squared probabilities, renormalised
])
def test_sampled_distribution(kw, expected):
    probs = [0.4, 0.2, 0.15, 0.1, 0.05, 0.05, 0.03, 0.02]
    if expected is None:
        sq = [p**2 for p in probs]
        expected = [s / sum(sq) for s in sq]
    samples = draw(probs, 20000, **kw)
    stat, df = chi2(samples, expected)
    assert stat < CHI2_CRIT[df], f"chi2 {stat:.1f} with {df} degrees of freedom"


def test_filters_keep_the_top_token_and_give_valid_log_probs():
    logits = torch.randn(3, 50) * 5
    logp = filter_logits_ref(logits, torch.ones(3), torch.tensor([1, 0, 0]), torch.tensor([1.0, 1e-9, 1.0]),
                             torch.tensor([0.0, 0.0, 1.0]))
    # each of these settings leaves exactly the argmax
    assert torch.equal(logp.argmax(-1), logits.argmax(-1))
    assert torch.isfinite(logp).sum(-1).tolist() == [1, 1, 1]
    assert torch.allclose(logp.exp().sum(-1), torch.ones(3))


def test_top_p_of_one_keeps_the_whole_tail():
    # the fp32 cumsum reaches 1.0 before the last tokens of a long peaked row; top_p = 1 must still keep them
    logits = torch.cat([torch.tensor([[20.0]]), torch.randn(1, 5000)], dim=1)
    logp = filter_logits_ref(logits, torch.ones(1), torch.zeros(1, dtype=torch.long), torch.ones(1), torch.zeros(1))
    assert torch.isfinite(logp).all()
