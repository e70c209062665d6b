"""The `qml` command line.

Every `serve` flag has an environment twin, QML_<FLAG> (``--max-model-len`` ->
``QML_MAX_MODEL_LEN``), for containers and systemd units; a flag given on the
command line wins over its twin. ``QML_API_KEY`` may hold several comma-separated
keys. Keys are never printed or logged.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from qml_server.admission import DEFAULT_MAX_QUEUED_REQUESTS
from qml_server.auth import keys_from_env
from qml_server.lifecycle import DEFAULT_SHUTDOWN_TIMEOUT_S
from qml_server.limits import DEFAULT_MAX_BODY_BYTES

log = logging.getLogger("qml.server")

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_size(text: str) -> int:
    """Bytes from '33554432', '32M', '32MiB' or '512k' (binary units)."""
    match = re.fullmatch(r"\s*(\d+)\s*([kmg]?)(?:i?b)?\s*", text.lower())
    if not match or int(match.group(1)) < 1:
        raise argparse.ArgumentTypeError(f"not a positive size in bytes: {text!r} (e.g. 33554432, 32MiB)")
    return int(match.group(1)) * _SIZE_UNITS[match.group(2)]


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"not a positive integer: {text!r}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"not a positive number: {text!r}")
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"not a number >= 0: {text!r}")
    return value


def port_number(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}")
    return value


def device_name(text: str) -> str:
    if text in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", text):
        return text
    raise argparse.ArgumentTypeError(f"unknown device {text!r}: use auto, cpu, cuda or cuda:N")


def log_level(text: str) -> str:
    if text.lower() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"unknown log level {text!r}: use one of {', '.join(LOG_LEVELS)}")
    return text.lower()


def env_bool(text: str) -> bool:
    if text.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if text.strip().lower() in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {text!r} (use 1/0, true/false, yes/no, on/off)")


def env_name(flag: str) -> str:
    return "QML_" + flag.lstrip("-").upper().replace("-", "_")


def build_parser(env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The `qml` parser; QML_<FLAG> variables in ``env`` become the flags' defaults."""
    env = os.environ if env is None else env
    parser = argparse.ArgumentParser(prog="qml", description="qml: GPU kernels and an LLM inference server.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    serve = commands.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API.",
    )
    flag = _flag_adder(serve, env)
    flag("--model", help="a .gguf file, a Hugging Face model folder, or preset:NAME with --random-weights "
                         "(default: the embedded model)")
    flag("--random-weights", action="store_true",
         help="serve a preset (preset:llama-3.1-8b, preset:tiny-llama) at its real shapes with random weights, "
              "for speed measurements; its output is noise")
    flag("--host", default="127.0.0.1", help="address to listen on")
    flag("--port", type=port_number, default=8000, help="port to listen on")
    flag(
        "--api-key",
        action="append",
        help="require this bearer key on /v1/* (repeatable, for rotation; the env twin takes comma-separated keys)",
    )
    flag("--served-model-name", help="the model name clients send and /v1/models shows")
    flag("--device", type=device_name, default="auto", help="auto, cpu, cuda or cuda:N")
    flag("--max-model-len", type=positive_int, help="cap on prompt + completion tokens")
    flag("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
         help="weights, activations and KV cache (auto: float32 on CPU, bfloat16 on GPU)")
    flag("--kv-cache-gib", type=positive_float,
         help="KV cache size in GiB (default: 1 on CPU, 85%% of free memory on GPU)")
    flag("--no-prefix-caching", action="store_true",
         help="compute every prompt in full: no reuse of KV pages across requests, and no KV tiers")
    flag("--retokenize-replies", action="store_true",
         help="encode a conversation's earlier replies from their text, as sent back (by default a reply the "
              "server generated keeps its generated token ids, so its KV is reused in the next turn)")
    flag("--kv-host-gib", type=non_negative_float,
         help="host-RAM tier for KV pages pushed off the GPU (default: a quarter of RAM up to 64 on GPU, 0 on CPU)")
    flag("--kv-disk-dir", help="directory of the disk KV tier, which survives restarts (default: no disk tier)")
    flag("--kv-disk-gib", type=positive_float, help="disk tier budget (default: half the free space, up to 256)")
    flag("--max-num-seqs", type=positive_int, default=64, help="sequences decoded together at most")
    flag("--max-batched-tokens", type=positive_int, default=2048,
         help="tokens computed in one step; longer prompts are prefilled in chunks of this size")
    flag("--max-tokens-alone", type=positive_int, default=32768,
         help="the step budget when a single request is running or waiting: nobody's decode to protect, "
              "so its prompt is prefilled in chunks this large")
    flag("--no-cuda-graphs", action="store_true", help="run decode steps eagerly (for debugging and comparison)")
    flag("--no-overlap", action="store_true",
         help="wait for each decode step's tokens before launching the next (by default the next step is "
              "launched first, so the host's work hides behind the GPU's)")
    flag("--no-warmup", action="store_true",
         help="skip the start-up warm-up (GPU: compiles the eager prefill paths and measures the prefill "
              "time the restore planner uses; ~10 s for an 8B model)")
    flag(
        "--max-body-bytes",
        type=parse_size,
        default=DEFAULT_MAX_BODY_BYTES,
        help="largest request body accepted; bigger ones get 413 (accepts 32MiB etc.)",
    )
    flag("--max-queued-requests", type=positive_int, default=DEFAULT_MAX_QUEUED_REQUESTS,
         help="requests waiting in the engine at most; past it new ones get 503 with Retry-After")
    flag("--shutdown-timeout", type=non_negative_float, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
         help="on SIGTERM or Ctrl-C, seconds to let requests in flight finish (new ones get 503) "
              "before cancelling them and exiting")
    flag("--log-level", type=log_level, default="info", help="|".join(LOG_LEVELS))
    # QML_API_KEY is the twin of the repeatable --api-key; kept apart so flags replace it.
    serve.set_defaults(run=serve_command, env_api_keys=keys_from_env(env.get("QML_API_KEY")))

    # imported here: they take their flag types from this module
    from qml_server import bench as bench_module
    from qml_server import bench_sessions

    bench = commands.add_parser("bench", help="benchmark a model or a server", description="Benchmarks.")
    bench.set_defaults(run=lambda _: _usage(bench))
    bench_commands = bench.add_subparsers(dest="bench_command", metavar="BENCH")
    bench_serve = bench_commands.add_parser(
        "serve",
        help="TTFT per prompt size, decode ms/token and throughput under concurrency of a running server",
        description=(bench_module.__doc__ or "").split("\n\n")[0],
    )
    bench_module.add_arguments(bench_serve)
    bench_serve.set_defaults(run=bench_module.bench_serve_command)
    sessions = bench_commands.add_parser(
        "sessions",
        help="multi-turn conversations over the chat API: TTFT per turn, cached tokens, where the history came from",
        description=(bench_sessions.__doc__ or "").split("\n\n")[0],
    )
    bench_sessions.add_arguments(sessions)
    sessions.set_defaults(run=bench_sessions.bench_sessions_command)
    return parser


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def _flag_adder(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> Callable[..., None]:
    """add_argument, plus the flag's QML_<FLAG> twin as its default.

    Going through the default is what makes an explicit flag win over the variable.
    """

    def add(name: str, help: str, **kwargs: Any) -> None:
        twin = env_name(name)
        raw = env.get(twin)
        # Repeatable flags (--api-key) are merged by hand: an `append` default would be
        # extended by the flags instead of replaced by them.
        if raw and kwargs.get("action") != "append":
            convert = env_bool if kwargs.get("action") == "store_true" else kwargs.get("type", str)
            try:
                kwargs["default"] = convert(raw)
            except argparse.ArgumentTypeError as exc:
                parser.error(f"{twin}: {exc}")
        default = kwargs.get("default")
        shown = f" (default: {default})" if default is not None else ""
        parser.add_argument(name, help=f"{help}{shown} [env {twin}]", **kwargs)

    return add


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    parser = build_parser(env)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return args.run(args)


def serve_command(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    api_keys = tuple(args.api_key) if args.api_key else args.env_api_keys

    # Imported here so `qml --help` stays instant and works without torch.
    from qml_runtime.loader import ModelNotFound, load_engine

    try:
        engine = load_engine(
            args.model,
            device=args.device,
            max_model_len=args.max_model_len,
            served_model_name=args.served_model_name,
            dtype=args.dtype,
            kv_cache_gib=args.kv_cache_gib,
            max_num_seqs=args.max_num_seqs,
            max_batched_tokens=args.max_batched_tokens,
            max_tokens_alone=args.max_tokens_alone,
            cuda_graphs=not args.no_cuda_graphs,
            **({"random_weights": True} if args.random_weights else {}),
            **({"enable_prefix_caching": False} if args.no_prefix_caching else {}),
            **{k: v for k in ("kv_host_gib", "kv_disk_dir", "kv_disk_gib") if (v := getattr(args, k)) is not None},
        )
    except (ModelNotFound, ValueError, OSError) as exc:  # bad path, bad file, unsupported model: no traceback
        print(f"qml serve: {exc}", file=sys.stderr)
        return 1
    if args.no_warmup:
        engine.warmup = False
    if args.no_overlap:
        engine.overlap = False

    from qml_server.app import create_app
    from qml_server.lifecycle import serve

    # Started in the background: /health says "loading" while the engine warms up.
    app = create_app(engine, api_keys=api_keys, max_body_bytes=args.max_body_bytes,
                     max_queued_requests=args.max_queued_requests, start_in_background=True,
                     keep_replies=not args.retokenize_replies)
    host = f"[{args.host}]" if ":" in args.host else args.host
    log.info(
        "serving %s on http://%s:%d/v1 (API key %s, body limit %d bytes)",
        engine.model_id,
        host,
        args.port,
        "required" if api_keys else "not required",
        args.max_body_bytes,
    )
    return serve(app, app.state.lifecycle, host=args.host, port=args.port, log_level=args.log_level,
                 shutdown_timeout_s=args.shutdown_timeout)
