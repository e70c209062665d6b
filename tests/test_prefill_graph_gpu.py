"""On a GPU: turns over a cached history replayed from the captured prefill graphs give what the same engine
without graphs gives. Their inputs (ids, positions, slots, lengths, the block table, the sampling row) are
views of one device buffer filled by one copy per step (``PrefillGraphs.stage``); the CPU tests run that
staging eagerly, this one through real captures and replays, turn after turn of different lengths. A narrow
model with Llama-3.1-8B's heads and random weights, two layers."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from qml_runtime.config import CacheConfig, SchedulerConfig
from qml_runtime.cuda_graphs import PrefillGraphs
from qml_runtime.engine import Engine
from qml_runtime.presets import PRESETS, ByteTokenizer, Preset, random_model
from qml_runtime.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
VOCAB, CONTEXT = 512, 8192
NEW = (150, 37, 219, 9)  # each turn's new tokens: buckets 160, 48, 256, 16


def _turns(graphs: bool, monkeypatch) -> tuple[list[list[int]], list[dict[int, float]], list]:
    """(each turn's greedy tokens, each turn's first-token top logprobs, the graph keys replayed)."""
    cfg = dataclasses.replace(PRESETS["llama-3.1-8b"].config, hidden_size=512, intermediate_size=1024, num_layers=2,
                              vocab_size=VOCAB, context_length=CONTEXT)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    net = random_model(Preset(cfg, "LlamaForCausalLM", "Llama-3.1-8B heads, narrow"), dev, torch.bfloat16)
    eng = Engine(net, ByteTokenizer(VOCAB), cfg, model_id="narrow", device=dev, dtype=torch.bfloat16,
                 cache=CacheConfig(block_size=16, num_blocks=2048),
                 scheduler=SchedulerConfig(max_batched_tokens=CONTEXT, max_num_seqs=2), context_length=CONTEXT,
                 fingerprint=b"prefill-graph-gpu-test", cuda_graphs=graphs, warmup=False)
    replays: list = []
    real = PrefillGraphs._replay
    monkeypatch.setattr(PrefillGraphs, "_replay", lambda self, key: replays.append(key) or real(self, key))
    try:
        eng.start()  # (the graphs are captured here)
        rng = random.Random(1)
        ids = [rng.randrange(VOCAB) for _ in range(3000)]
        greedy = SamplingParams(max_tokens=4, temperature=0, logprobs=5)
        out = eng.generate_sync(ids, greedy)
        tokens, tops = [], []
        for new in NEW:
            ids = ids + out.token_ids + [rng.randrange(VOCAB) for _ in range(new)]
            out = eng.generate_sync(ids, greedy)
            assert out.cached_tokens >= len(ids) - new - 4 - 16, "the turn did not find its history cached"
            tokens.append(out.token_ids)
            tops.append(dict(out.logprobs[0].top))
        return tokens, tops, replays
    finally:
        monkeypatch.setattr(PrefillGraphs, "_replay", real)
        eng.shutdown()


def test_replayed_turns_match_the_engine_without_graphs(monkeypatch):
    with_graphs, tops, replays = _turns(True, monkeypatch)
    assert sum(long for _, long in replays) >= len(NEW), f"the turns did not replay long-context graphs: {replays}"
    without, tops_eager, _ = _turns(False, monkeypatch)
    for turn, (a, b) in enumerate(zip(tops, tops_eager)):
        best = max(b, key=b.get)
        assert best in a, f"turn {turn}: the eager top token {best} is not among the replayed turn's top 5"
        worst = max(abs(a[t] - b[t]) for t in set(a) & set(b))
        assert worst < 0.05, f"turn {turn}: logprobs differ by up to {worst:.3f}"
    # the greedy continuations agree where the first tokens do (ties aside, the same model)
    agree = sum(a == b for a, b in zip(with_graphs, without))
    assert agree >= len(NEW) - 1, f"greedy tokens: {with_graphs} against {without}"
