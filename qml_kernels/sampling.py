"""Sampling the next token from a batch of logits, with per-row parameters.

Order of the filters (as vLLM and llama.cpp apply them): temperature, then top-k,
top-p (nucleus) and min-p on the tempered distribution, then a draw. A row with
temperature 0 is greedy (argmax of the raw logits). Each row draws from its own
``torch.Generator`` so a seeded request is reproducible whatever else is batched
with it.
"""

from __future__ import annotations

import torch


def filter_logits_ref(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                      top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """logits: [B, V]; per-row temperature (>0), top_k (0 = off), top_p, min_p: [B] -> log-probs [B, V].

    Tokens removed by a filter get -inf.
    """
    x = logits.float() / temperature.float()[:, None]  # [B, V]
    V = x.shape[-1]
    sorted_x, order = x.sort(dim=-1, descending=True)  # [B, V]
    rank = torch.arange(V, device=x.device)[None, :]  # [1, V]
    k = torch.where(top_k > 0, top_k, V).clamp(max=V)[:, None]  # [B, 1]
    drop = rank >= k
    probs = torch.softmax(sorted_x.masked_fill(drop, float("-inf")), dim=-1)  # [B, V]
    # keep the smallest prefix whose mass reaches top_p: a token goes if the mass before it already does
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p.float()[:, None]
    drop |= probs < min_p.float()[:, None] * probs[:, :1]
    drop[:, 0] = False  # the most likely token always survives
    filtered = sorted_x.masked_fill(drop, float("-inf"))
    out = torch.empty_like(filtered).scatter_(1, order, filtered)
    return torch.log_softmax(out, dim=-1)


def sample_ref(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
               min_p: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """logits: [B, V] -> token ids [B] (int64). Rows with temperature 0 are greedy."""
    greedy = temperature <= 0
    tokens = logits.argmax(dim=-1)  # [B]
    rows = (~greedy).nonzero().flatten().tolist()
    if rows:
        logp = filter_logits_ref(logits[rows], temperature[rows], top_k[rows], top_p[rows], min_p[rows])
        for j, row in enumerate(rows):
            # Gumbel-max through exponential races: argmax p_i / E_i with E_i ~ Exp(1) draws
            # token i with probability p_i, and needs one draw per token from the row's generator
            race = torch.empty_like(logp[j]).exponential_(generator=generators[row])
            tokens[row] = (logp[j] - race.log()).argmax()
    return tokens


def sample(logits, temperature, top_k, top_p, min_p, generators):
    return sample_ref(logits, temperature, top_k, top_p, min_p, generators)
