"""The engine with every Triton kernel selected (the interpreter on CPU) gives the reference's greedy output."""

from __future__ import annotations

from qml_kernels import registry
from qml_runtime.sampling_params import SamplingParams

# dequantization is not among them: the weights are already loaded (and the loader decodes on CPU
# with the reference); its kernels are checked bit-exact on their own
TRITON_OPS = ("rmsnorm", "add_rmsnorm", "rope", "rope_kv_write", "swiglu", "paged_attention", "sample")


def test_greedy_output_unchanged_with_triton_kernels(engine):
    ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    params = SamplingParams(max_tokens=8, temperature=0)
    engine.scheduler.prefix_caching = False  # both runs compute every token
    try:
        reference = engine.generate_sync(ids, params)
        with registry.using(**dict.fromkeys(TRITON_OPS, "triton")):
            assert all(registry.forced_impl(op) == "triton" for op in TRITON_OPS)
            triton = engine.generate_sync(ids, params)
    finally:
        engine.scheduler.prefix_caching = True
    assert triton.token_ids == reference.token_ids
    assert "Paris" in triton.text
