"""On a GPU with cuDNN: the next turn of a conversation over a long history, replayed from the prefill CUDA
graph, runs the turn path (cuDNN over the history, ``qml_kernels.attention_turn``) and gives the first token's
distribution the split-KV kernel gives. A narrow model with Llama-3.1-8B's heads (32 / 8, head dim 128) and
random weights, two layers. Two engine start-ups with their graph captures: minutes on the H200."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from qml_kernels import attention_turn
from qml_runtime.config import CacheConfig, SchedulerConfig
from qml_runtime.cuda_graphs import PrefillGraphs
from qml_runtime.engine import Engine
from qml_runtime.presets import PRESETS, ByteTokenizer, Preset, random_model
from qml_runtime.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or attention_turn._cudnn() is None,
                                reason="cuDNN on a GPU")
VOCAB, CONTEXT = 512, 8192


def _first_logprobs(turn_path: bool, monkeypatch, calls: list) -> tuple[dict[int, float], bool]:
    """(The turn's first token's top logprobs, whether the turn replayed a graph), from an engine whose graphs
    were captured with the turn path on or off; ``calls`` counts the turn path's launches (at capture: the
    warm-up and the capture itself)."""
    monkeypatch.setattr(attention_turn, "ENABLED", turn_path)
    cfg = dataclasses.replace(PRESETS["llama-3.1-8b"].config, hidden_size=512, intermediate_size=1024, num_layers=2,
                              vocab_size=VOCAB, context_length=CONTEXT)
    dev = torch.device("cuda")
    net = random_model(Preset(cfg, "LlamaForCausalLM", "Llama-3.1-8B heads, narrow"), dev, torch.bfloat16)
    eng = Engine(net, ByteTokenizer(VOCAB), cfg, model_id="narrow", device=dev, dtype=torch.bfloat16,
                 cache=CacheConfig(block_size=16, num_blocks=2048),
                 scheduler=SchedulerConfig(max_batched_tokens=CONTEXT, max_num_seqs=2), context_length=CONTEXT,
                 fingerprint=b"turn-engine-test", cuda_graphs=True, warmup=False)
    try:
        eng.start()  # (the graphs are captured here)
        rng = random.Random(0)
        history = [rng.randrange(VOCAB) for _ in range(5000)]
        first = eng.generate_sync(history, SamplingParams(max_tokens=1, temperature=0))
        turn = history + first.token_ids + [rng.randrange(VOCAB) for _ in range(150)]
        replays = []
        real = PrefillGraphs._replay
        monkeypatch.setattr(PrefillGraphs, "_replay", lambda self, key: replays.append(key) or real(self, key))
        out = eng.generate_sync(turn, SamplingParams(max_tokens=1, temperature=0, logprobs=5))
        monkeypatch.setattr(PrefillGraphs, "_replay", real)
        assert out.cached_tokens >= 4096, "the turn did not find its history cached"
        return dict(out.logprobs[0].top), any(long for _, long in replays)
    finally:
        eng.shutdown()


def test_graph_replayed_turn_matches_split_kv(monkeypatch):
    calls: list = []
    real = attention_turn.turn_attention

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(attention_turn, "turn_attention", counting)
    with_path, replayed = _first_logprobs(True, monkeypatch, calls)
    assert calls, "no prefill graph captured the turn path"
    assert replayed, "the turn ran eagerly, not from its graph"
    captured = len(calls)
    without, _ = _first_logprobs(False, monkeypatch, calls)
    assert len(calls) == captured  # (off: never called)
    top = max(without, key=without.get)
    assert top in with_path, f"the split-KV kernel's top token {top} is not among the turn path's top 5"
    shared = set(with_path) & set(without)
    worst = max(abs(with_path[t] - without[t]) for t in shared)
    assert worst < 0.05, f"logprobs differ by up to {worst:.3f} between the two attention paths"
