"""qml_runtime.logits on made-up logits: the penalty formulas, the per-sequence count rows kept
incrementally, logit bias and min_tokens masks, and the logprobs taken from the raw logits."""

from __future__ import annotations

import torch

from qml_runtime.logits import LogitsProcessor, apply_penalties, gather_logprobs
from qml_runtime.sampling_params import SamplingParams


class Seq:
    """What the processor reads of a qml_runtime.sequence.Sequence."""

    def __init__(self, prompt: list[int], params: SamplingParams, output: list[int] = ()):
        self.token_ids = list(prompt) + list(output)
        self.num_prompt_tokens = len(prompt)
        self.params = params
        self.logits_slot = None
        self.grammar = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


def test_penalty_formulas_and_neutral_rows():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]] * 2)
    counts = torch.tensor([[2, 1, 0, 0]] * 2)
    in_prompt = torch.tensor([[False, False, True, False]] * 2)
    out = apply_penalties(logits, counts, in_prompt, torch.tensor([0.5, 0.0]), torch.tensor([0.25, 0.0]),
                          torch.tensor([2.0, 1.0]))
    # row 0: seen tokens 0, 1 (output) and 2 (prompt): positive / 2, negative * 2; then
    # frequency * count + presence * [count > 0] subtracted (output tokens only)
    assert torch.allclose(out[0], torch.tensor([2.0 / 2 - 0.25 * 2 - 0.5, -1.0 * 2 - 0.25 - 0.5, 0.5 / 2, 3.0]))
    assert torch.equal(out[1], logits[1])  # (0, 0, 1): exactly unchanged


def test_counts_are_kept_incrementally_per_sequence():
    V = 6
    proc = LogitsProcessor(torch.device("cpu"), stop_ids=frozenset({5}))
    freq = SamplingParams(max_tokens=8, frequency_penalty=1.0)
    a, b = Seq([0, 1], freq, output=[3]), Seq([2], SamplingParams(max_tokens=8))
    zeros = torch.zeros(2, V)
    first = proc.process(zeros, [a, b])
    assert first[0].tolist() == [0, 0, 0, -1, 0, 0] and first[1].tolist() == [0] * V  # a's history so far
    assert b.logits_slot is None  # plain rows take no slot
    for token in (3, 4, 3):  # the sampled tokens are counted on the device, step by step
        proc.observe([a, b], torch.tensor([token, 0]))
        a.token_ids.append(token)
    assert proc.process(zeros, [a, b])[0].tolist() == [0, 0, 0, -3, -1, 0]
    # more penalized sequences than rows: the tables grow and keep what they held
    others = [Seq([1], freq, output=[i % V]) for i in range(6)]
    proc.process(torch.zeros(7, V), [a, *others])
    assert proc.counts.shape[0] >= 7
    assert proc.process(zeros[:1], [a])[0].tolist() == [0, 0, 0, -3, -1, 0]
    slot = a.logits_slot
    proc.release(a)
    c = Seq([4], freq)
    proc.process(zeros[:1], [c])
    assert c.logits_slot == slot and proc.counts[slot].sum().item() == 0  # a reused row starts clean


def test_bias_and_min_tokens_masks():
    V = 8
    proc = LogitsProcessor(torch.device("cpu"), stop_ids=frozenset({7}))
    rows = [
        Seq([1], SamplingParams(max_tokens=4, logit_bias=((2, 100.0), (3, -100.0)))),
        Seq([1], SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=(6,))),
        Seq([1], SamplingParams(max_tokens=4, min_tokens=2, ignore_eos=True, stop_token_ids=(6,))),
        Seq([1], SamplingParams(max_tokens=4, min_tokens=1), output=[0]),  # min_tokens reached
    ]
    out = proc.process(torch.zeros(4, V), rows)
    assert out[0].tolist() == [0, 0, 100, -100, 0, 0, 0, 0]
    assert out[1, 6] == out[1, 7] == float("-inf") and torch.isfinite(out[1, :6]).all()
    assert out[2, 6] == float("-inf") and out[2, 7] == 0  # EOS is not a stop token for this one
    assert torch.isfinite(out[3]).all()


def test_logprobs_come_from_the_raw_logits():
    logits = torch.randn(3, 50)
    tokens = torch.tensor([4, 7, logits[2].argmax().item()])
    seqs = [Seq([1], SamplingParams(logprobs=3)), Seq([1], SamplingParams()), Seq([1], SamplingParams(logprobs=0))]
    got = gather_logprobs(logits, tokens, seqs)
    logp = torch.log_softmax(logits, -1)
    assert got[1] is None and got[2].top == ()
    assert abs(got[0].logprob - logp[0, 4].item()) < 1e-6 and got[0].token_id == 4
    top = logp[0].topk(3)
    assert [t for t, _ in got[0].top] == top.indices.tolist()
    assert [v for _, v in got[0].top] == sorted((v for _, v in got[0].top), reverse=True)
    assert abs(got[2].logprob - logp[2].max().item()) < 1e-6
