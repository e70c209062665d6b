"""Loading a Hugging Face folder (config.json + safetensors + tokenizer.json).

The folder is made by transformers from the same GGUF, so its weights are the
GGUF's, but in HF layout: q/k un-permuted for rotate-half RoPE. The engine built
from it must agree with the engine built from the GGUF.
"""

from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch

from qml_runtime.loader import load_engine
from qml_runtime.sampling_params import SamplingParams

from .test_llama_vs_transformers import full_logits

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_folder(smollm_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("smollm2-hf")
    tok = transformers.AutoTokenizer.from_pretrained(smollm_path.parent, gguf_file=smollm_path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm_path.parent, gguf_file=smollm_path.name,
                                                              dtype=torch.float32)
    # transformers refuses to save a GGUF-loaded model, so write the folder as a checkpoint would be
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    safetensors.torch.save_file(state, folder / "model.safetensors")
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = ["LlamaForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    tok.save_pretrained(folder)
    return folder


def test_hf_folder_engine_matches_gguf_engine(engine, hf_folder):
    hf_engine = load_engine(str(hf_folder), device="cpu", kv_cache_gib=0.05, progress=False)
    cfg = hf_engine.model_config
    assert not cfg.rope_interleaved and cfg.tie_word_embeddings
    assert hf_engine.info()["parameters"] == engine.info()["parameters"]
    ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    assert hf_engine.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]) == ids
    a, b = full_logits(engine, ids), full_logits(hf_engine, ids)
    assert (a - b).abs().max() / b.abs().max() < 1e-4
    hf_engine.start()
    try:
        params = SamplingParams(max_tokens=16, temperature=0)
        assert hf_engine.generate_sync(ids, params).token_ids == engine.generate_sync(ids, params).token_ids
    finally:
        hf_engine.shutdown()
