"""Logits processing and log-probabilities, batched over a step's rows in plain PyTorch.

The sampler (qml_kernels.sampling) applies temperature, top-k, top-p and min-p, and for
plain requests it runs inside the CUDA graphs with the logits head. What it cannot do
is here, run outside the graphs on the step's ``[B, V]`` logits when some row needs it
(qml_runtime.runner decides):

- ``logit_bias``: a bias added to given token ids;
- ``min_tokens``: EOS and the request's stop token ids masked until that many tokens are out;
- ``repetition_penalty`` (HF/vLLM): tokens of the prompt or the output have positive logits
  divided by it and negative ones multiplied by it;
- ``presence_penalty`` / ``frequency_penalty`` (OpenAI): ``presence * [count > 0] +
  frequency * count`` subtracted, counting the output's tokens only;
- a grammar (``response_format``, forced tool calls: qml_runtime.constrained): the tokens the
  sequence's matcher refuses get -inf, after everything above, so no bias can bring them back.

Penalties need each sequence's token counts: a row of a device table per penalized
sequence (counts of output tokens, and a mask of prompt tokens), filled once when the
sequence first samples and then bumped by one scatter per step with the sampled tokens,
never recounted over the history.

Log-probabilities follow vLLM's default ("raw" logprobs): the log-softmax of the model's
logits, before bias, penalties, temperature and the filters. They say what the model
thinks of a token, whatever the request did to its sampling; a token forced by
``logit_bias`` can therefore show a low logprob.
"""

from __future__ import annotations

import torch

from qml_runtime.constrained import TokenMasks
from qml_runtime.sampling_params import TokenLogprob


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, in_prompt: torch.Tensor, presence: torch.Tensor,
                    frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """logits fp32 [B, V]; counts int [B, V] (output tokens); in_prompt bool [B, V]; presence, frequency,
    repetition fp32 [B] -> penalized logits [B, V] (new tensor). Neutral rows (0, 0, 1) come out unchanged."""
    generated = counts > 0  # [B, V]
    rep = repetition[:, None]
    seen = in_prompt | generated
    x = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return x - frequency[:, None] * counts.to(x.dtype) - presence[:, None] * generated.to(x.dtype)


def logprobs_of(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [B, V] (raw), tokens int64 [B], k >= 0 -> (the tokens' logprobs [B], the k best logprobs [B, k]
    in descending order, their token ids [B, k])."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [B, V]
    chosen = logp.gather(1, tokens[:, None])[:, 0]
    top, ids = logp.topk(k, dim=-1) if k else (logp[:, :0], tokens[:, None][:, :0])
    return chosen, top, ids


class LogitsProcessor:
    """The device state of penalized sequences, and the processing of a step's logits.

    ``stop_ids`` are the tokenizer's EOS ids (masked under ``min_tokens`` unless the request
    ignores EOS). Each penalized sequence holds a row (``seq.logits_slot``) of the count
    tables until ``release``; the tables grow by doubling, so plain requests allocate nothing.
    """

    def __init__(self, device: torch.device, stop_ids: frozenset[int] = frozenset()):
        self.device = device
        self.stop_ids = tuple(sorted(stop_ids))
        self.counts: torch.Tensor | None = None  # [R, V] int32: output tokens of the sequence in each row
        self.in_prompt: torch.Tensor | None = None  # [R, V] bool: tokens of its prompt
        self._free: list[int] = []
        self.masks = TokenMasks()

    def release(self, seq) -> None:
        if seq.logits_slot is not None:
            self._free.append(seq.logits_slot)
            seq.logits_slot = None

    def _slot(self, seq, V: int) -> int:
        if seq.logits_slot is not None:
            return seq.logits_slot
        if not self._free:
            rows = 0 if self.counts is None else self.counts.shape[0]
            grown = max(4, 2 * rows)
            counts = torch.zeros(grown, V, dtype=torch.int32, device=self.device)
            in_prompt = torch.zeros(grown, V, dtype=torch.bool, device=self.device)
            if rows:
                counts[:rows] = self.counts
                in_prompt[:rows] = self.in_prompt
            self.counts, self.in_prompt = counts, in_prompt
            self._free = list(range(grown - 1, rows - 1, -1))
        slot = self._free.pop()
        # once per sequence: its history so far (the prompt, and any output of a sequence
        # whose first sample came after a preemption)
        ids = torch.tensor(list(seq.token_ids), dtype=torch.int64, device=self.device)
        P = seq.num_prompt_tokens
        self.in_prompt[slot].zero_().index_fill_(0, ids[:P], True)
        self.counts[slot] = torch.bincount(ids[P:], minlength=V).to(torch.int32)
        seq.logits_slot = slot
        return slot

    def process(self, logits: torch.Tensor, seqs: list) -> torch.Tensor:
        """logits [B, V] of ``seqs`` (row i: seqs[i]) -> processed fp32 logits [B, V] (a new tensor)."""
        B, V = logits.shape
        out = logits.float().clone()
        rows, ids, values = [], [], []  # logit_bias entries, then min_tokens bans at -inf
        for r, seq in enumerate(seqs):
            p = seq.params
            for token, bias in p.logit_bias:
                rows.append(r)
                ids.append(token)
                values.append(bias)
        n_bias = len(rows)
        for r, seq in enumerate(seqs):
            p = seq.params
            if seq.num_output_tokens < p.min_tokens:
                banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.stop_ids))
                banned = [t for t in banned if 0 <= t < V]
                rows += [r] * len(banned)
                ids += banned
        if rows:
            index = torch.tensor([rows, ids], dtype=torch.int64).to(self.device, non_blocking=True)
            if n_bias:
                bias = torch.tensor(values, dtype=torch.float32).to(self.device, non_blocking=True)
                out.index_put_((index[0, :n_bias], index[1, :n_bias]), bias, accumulate=True)
            if len(rows) > n_bias:
                out[index[0, n_bias:], index[1, n_bias:]] = float("-inf")
        penalized = [r for r, seq in enumerate(seqs) if seq.params.penalized]
        if penalized:
            slots = [self._slot(seqs[r], V) for r in penalized]
            params = [seqs[r].params for r in penalized]
            host = torch.tensor([[p.presence_penalty for p in params], [p.frequency_penalty for p in params],
                                 [p.repetition_penalty for p in params]], dtype=torch.float32)
            index = torch.tensor([penalized, slots], dtype=torch.int64).to(self.device, non_blocking=True)
            f = host.to(self.device, non_blocking=True)
            rows_t, slots_t = index[0], index[1]
            x = apply_penalties(out.index_select(0, rows_t), self.counts.index_select(0, slots_t),
                                self.in_prompt.index_select(0, slots_t), f[0], f[1], f[2])
            out.index_copy_(0, rows_t, x)
        constrained = [r for r, seq in enumerate(seqs) if seq.grammar is not None]
        if constrained:
            self.masks.apply(out, constrained, [seqs[r].grammar for r in constrained])
        return out

    def observe(self, seqs: list, tokens: torch.Tensor) -> None:
        """Count the step's sampled ``tokens`` [B] (device; row i: seqs[i]) for the penalized sequences."""
        rows = [r for r, seq in enumerate(seqs) if seq.logits_slot is not None]
        if not rows:
            return
        index = torch.tensor([rows, [seqs[r].logits_slot for r in rows]], dtype=torch.int64).to(self.device,
                                                                                                 non_blocking=True)
        picked = tokens.index_select(0, index[0])
        self.counts.index_put_((index[1], picked), torch.ones_like(picked, dtype=torch.int32), accumulate=True)


def gather_logprobs(logits: torch.Tensor, tokens: torch.Tensor, seqs: list) -> list[TokenLogprob | None]:
    """Per row of ``seqs``: the sampled token's logprob and the top ``params.logprobs`` alternatives, or None
    for rows that did not ask. ``logits`` [B, V] are the raw model logits, ``tokens`` [B] the sampled ids.
    One pass on the device over the asking rows, one copy back."""
    asking = [r for r, seq in enumerate(seqs) if seq.params.logprobs is not None]
    result: list[TokenLogprob | None] = [None] * len(seqs)
    if not asking:
        return result
    k = max(seqs[r].params.logprobs for r in asking)
    rows = torch.tensor(asking, dtype=torch.int64).to(logits.device, non_blocking=True)
    picked = tokens.index_select(0, rows)
    chosen, top, ids = logprobs_of(logits.index_select(0, rows), picked, k)
    values = torch.cat([chosen[:, None], top], dim=1).tolist()  # [B', 1 + k]
    names = torch.cat([picked[:, None], ids], dim=1).tolist()
    for j, r in enumerate(asking):
        want = seqs[r].params.logprobs
        result[r] = TokenLogprob(names[j][0], values[j][0], tuple(zip(names[j][1:1 + want], values[j][1:1 + want])))
    return result
