"""The Llama model against Hugging Face transformers' own, both loading the same GGUF in fp32.

Tolerance: both dequantize the same blocks to identical fp32 weights, so the only
differences are summation order and the RoPE layout (transformers un-permutes the
GGUF q/k weights to rotate-half; we rotate interleaved pairs). Logits are compared
by max |diff| relative to the logits' max |value|, bound 1e-4.
"""

from __future__ import annotations

import pytest
import torch

from qml_kernels.attention import AttentionMetadata
from qml_runtime.kv.cache import KVCache
from qml_runtime.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")

REL_TOL = 1e-4

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one word."},
     {"role": "user", "content": "Name a colour of the sky."}],
    [{"role": "user", "content": "Write a Python function that adds two numbers."}],
    [{"role": "user", "content": "Count from one to ten in German."}],
]


@pytest.fixture(scope="module")
def hf(smollm_path):
    tok = transformers.AutoTokenizer.from_pretrained(smollm_path.parent, gguf_file=smollm_path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm_path.parent, gguf_file=smollm_path.name,
                                                              dtype=torch.float32)
    return tok, model.eval()


def full_logits(engine, token_ids: list[int]) -> torch.Tensor:
    """Logits at every position of one sequence, through a private KV cache: [T, V]."""
    model, cfg = engine.model, engine.model_config
    S = 16
    pages = -(-len(token_ids) // S)
    kv = KVCache(cfg, pages, S, engine.device, engine.dtype)
    T = len(token_ids)
    meta = AttentionMetadata.build(list(range(T)), [list(range(pages))], [0, T], [T], engine.device)
    with torch.inference_mode():
        hidden = model(torch.tensor(token_ids), torch.arange(T), kv, meta)
        return model.logits(hidden)


@pytest.mark.parametrize("messages", PROMPTS, ids=["capital", "system", "code", "german"])
def test_logits_match_transformers(engine, hf, messages):
    hf_tok, hf_model = hf
    ids = engine.tokenizer.apply_chat_template(messages)
    ours = full_logits(engine, ids)  # [T, V]
    with torch.inference_mode():
        theirs = hf_model(torch.tensor([ids])).logits[0].float()  # [T, V]
    assert ours.shape == theirs.shape
    assert torch.isfinite(ours).all()
    rel = (ours - theirs).abs().max() / theirs.abs().max()
    assert rel < REL_TOL, f"max relative logit difference {rel:.2e}"
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


LONG_ANSWERS = [  # prompts whose greedy answer runs past 32 tokens, so the whole window is compared
    [{"role": "user", "content": "Write a Python function that adds two numbers."}],
    [{"role": "user", "content": "Tell me a short story about a dragon."}],
    [{"role": "user", "content": "Describe the water cycle in detail."}],
]


@pytest.mark.parametrize("messages", LONG_ANSWERS, ids=["code", "story", "water"])
def test_greedy_continuation_matches_transformers(engine, hf, messages):
    hf_tok, hf_model = hf
    ids = engine.tokenizer.apply_chat_template(messages)
    n = 32
    ours = engine.generate_sync(ids, SamplingParams(max_tokens=n, temperature=0.0))
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    theirs = out[0, len(ids):].tolist()
    assert ours.token_ids == theirs
    assert ours.completion_tokens == n and ours.finish_reason == "length"


def test_paged_batch_equals_one_sequence(engine):
    """Decoding several requests together gives what each gives alone (greedy)."""
    prompts = [engine.tokenizer.apply_chat_template(m) for m in PROMPTS]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    alone = [engine.generate_sync(p, params).token_ids for p in prompts]
    import concurrent.futures as cf

    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda p: engine.generate_sync(p, params).token_ids, prompts))
    assert together == alone
