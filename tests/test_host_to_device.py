"""An eager step's inputs reach the GPU through pinned memory (``qml_kernels.attention.host_to_device``).

A copy from pageable memory may synchronise with the compute stream: a turn restoring its history from host
RAM (its layers waiting for their pages on the device) then queued its logits and sampler only after the
restore had landed, and the work meant to run beside the step ran after it (H200,
benchmarks/results/sessions-h200-2026-12-03.md). No GPU here: the copy path is checked by recording it."""

from __future__ import annotations

import torch

import qml_kernels.attention as attention
import qml_runtime.runner as runner_module
from qml_kernels.attention import host_to_device
from qml_runtime.sampling_params import SamplingParams


def test_to_a_gpu_the_copy_goes_through_pinned_memory(monkeypatch):
    calls = []

    class Pinned(torch.Tensor):
        pass

    def pin_memory(self):
        calls.append("pin")
        return self.as_subclass(Pinned)

    def to(self, *args, **kwargs):
        calls.append(("to", type(self).__name__, str(args[0]), kwargs.get("non_blocking", False)))
        return self.as_subclass(torch.Tensor)

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "to", to)
    host_to_device(torch.arange(4), "cuda:0")
    assert calls == ["pin", ("to", "Pinned", "cuda:0", True)]  # pinned first, then queued without a wait
    calls.clear()
    host_to_device(torch.arange(4), "cpu")
    assert calls == [("to", "Tensor", "cpu", False)]  # on CPU nothing to pin


def test_an_eager_step_sends_every_input_through_it(engine, monkeypatch):
    sent = []

    def recording(t, device):
        sent.append((t.dtype, tuple(t.shape)))
        return host_to_device(t, device)

    monkeypatch.setattr(runner_module, "host_to_device", recording)
    monkeypatch.setattr(attention, "host_to_device", recording)
    ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Hello there"}])
    # the runner's eager path, as a turn restoring its history takes it
    out = engine.generate_sync(ids, SamplingParams(max_tokens=2, temperature=0))
    assert out.token_ids
    n = len(ids) - out.cached_tokens  # the tokens the prompt's step computed (earlier tests may have cached some)
    # token ids, positions, slots, the block table, cu_seqlens, context lengths, the rows to sample and the
    # sampler's two parameter tables: all of the prompt's step went through host_to_device
    assert (torch.int64, (n,)) in sent  # the ids (and the positions, and the slots)
    assert sum(1 for dtype, shape in sent if dtype == torch.int64 and shape == (n,)) >= 3
    assert (torch.int32, (2,)) in sent and (torch.int32, (1,)) in sent  # cu_seqlens_q, context_lens
    assert (torch.int64, (1,)) in sent  # the one row to sample
    assert (torch.float32, (3, 1)) in sent and (torch.int64, (3, 1)) in sent  # the sampling parameters
