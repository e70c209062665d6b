"""Where the served time to first token goes outside the engine, by prompt length, on CPU.

On the H200 the served TTFT (`qml bench serve`, token-id prompts on /v1/completions) exceeded the
engine's in-process TTFT by ~3.5 ms at 130 tokens and ~12 ms at 26,900 (issue 6). This script
serves the real app (`qml_server.create_app`, under uvicorn as `qml serve` runs it) over a
stand-in engine that answers at once, so all that is left is the HTTP path, and sends what the
bench sends (`bench_common.IdPrompts` and `Client.stream`: stream=True, max_tokens=1, a fresh
cache_salt). The server runs in a subprocess and stamps each phase with perf_counter (the same
clock in both processes on Linux): client send -> app called -> body read -> JSON parsed ->
request parsed -> prompt ids checked (thread pool) -> engine.generate called -> first SSE write ->
first chunk read by the client. A least-squares line over the sizes splits each phase into a
fixed part and a part per 1,000 prompt tokens.

On 2 CPU cores (medians of 50 runs, 26,900 ids): TTFT 5.07 -> 3.11 ms once the prompt ids were
checked in bulk (parse 1.78 -> 0.37 ms, ids 0.77 -> 0.34 ms); what grows with the prompt went from
0.141 to 0.091 ms per 1,000 tokens, of which JSON parsing (json.loads) is now 0.038.

    python benchmarks/server_overhead_cpu.py                      # sizes 130,2340,8890,26900, 30 runs each
    python benchmarks/server_overhead_cpu.py --repeats 50 --profile 26900   # + cProfile of the server side
"""
from __future__ import annotations

import argparse
from array import array
import cProfile
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import time
import uuid

VOCAB = 151936  # Qwen3's: ids of 4-6 digits on the wire, as the bench sends them
TURN_BYTES, REPLY_BYTES = 133, 64  # --chat: the sessions bench's new turn and reply (the byte tokenizer: 1 token a byte)
PHASES = ("send->app", "body", "json", "parse", "ids", "->engine", "engine->write", "write->client")
STAMPS = ("app", "body", "json", "parse", "ids", "engine", "write")


def serve(port: int, chat: bool = False) -> None:
    """The app over a stand-in engine, each phase of the request being handled stamped."""
    from starlette.responses import JSONResponse

    import qml_server.routes_chat as chat_route
    import qml_server.routes_completions as route
    from qml_runtime.engine_requests import _packed_ids
    from qml_runtime.presets import ByteTokenizer

    try:
        from qml_runtime.sequence import TokenIds
    except ImportError:
        TokenIds = None
    from qml_runtime.sampling_params import RequestOutput
    from qml_server.app import create_app
    from qml_server.lifecycle import serve as run_app

    stamps: dict[str, float] = {}
    held: list[list[int]] = []  # the stand-in's "sequences": their id lists, until their response is sent
    profile = cProfile.Profile()
    profiling = [False]

    class Tokenizer:
        vocab_size = VOCAB

        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return list(text.encode())

        def decode(self, ids: list[int], **_) -> str:
            return "x" * len(ids)

    class StandIn:  # the engine's contract (see create_app), answering the first token at once
        # (--chat: the presets' byte tokenizer, which renders a chat template, and a reply of REPLY_BYTES
        # ids that decode to its text, so the server keeps it and the next turn's history reuses its ids)
        model_id, context_length = "stand-in", 131072
        tokenizer = ByteTokenizer(VOCAB) if chat else Tokenizer()

        def start(self) -> None: ...
        def shutdown(self) -> None: ...
        def info(self) -> dict: return {"device": "cpu", "context_length": self.context_length}
        def stats(self) -> dict: return {"num_requests_running": 0, "num_requests_waiting": 0}

        async def generate(self, prompt_ids, params, request_id, **_):
            # what Engine.submit does on the caller's thread with the ids: check and pack them, and make the
            # list the sequence keeps (freed once the request has ended: by the outer app, after the response)
            if TokenIds is not None:  # (a uint32 array stays one: Sequence.token_ids)
                held.append(TokenIds(prompt_ids if isinstance(prompt_ids, array) else list(prompt_ids)))
            else:  # (a tree from before TokenIds: the sequence's list of ints)
                held.append(prompt_ids.tolist() if isinstance(prompt_ids, array) else list(prompt_ids))
            if _packed_ids(prompt_ids, VOCAB) is None:
                raise ValueError("bad ids")
            stamps["engine"] = time.perf_counter()
            if chat:  # the first token alone (the reply is kept after the last one, off the TTFT's path)
                yield RequestOutput(request_id, "x", [ord("x")], None, len(prompt_ids), 1)
                yield RequestOutput(request_id, "x" * (REPLY_BYTES - 1), [ord("x")] * (REPLY_BYTES - 1), "length",
                                    len(prompt_ids), REPLY_BYTES)
            else:
                yield RequestOutput(request_id, "x", [7], "length", len(prompt_ids), 1)

    def stamped(name, fn, is_async):
        async def a(*args):
            out = await fn(*args)
            stamps[name] = time.perf_counter()
            return out

        def s(*args):
            out = fn(*args)
            stamps[name] = time.perf_counter()
            return out
        return a if is_async else s

    route.read_json_object = stamped("json", route.read_json_object, True)
    route.parse_completion_request = stamped("parse", route.parse_completion_request, False)
    route.completion_prompt_ids = stamped("ids", route.completion_prompt_ids, False)
    chat_route.read_json_object = stamped("json", chat_route.read_json_object, True)
    chat_route.parse_chat_request = stamped("parse", chat_route.parse_chat_request, False)
    chat_route._render_prompt = stamped("ids", chat_route._render_prompt, False)  # template, kept reply, encode
    app = create_app(StandIn())

    async def outer(scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/bench/"):
            if scope["path"] == "/bench/profile":
                profiling[0] = json.loads(scope["query_string"] or b"false")
                out = io.StringIO()
                if profile.getstats():
                    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(18)
                return await JSONResponse(out.getvalue())(scope, receive, send)
            return await JSONResponse(dict(stamps))(scope, receive, send)
        if scope["type"] != "http":
            return await app(scope, receive, send)
        stamps.clear()
        stamps["app"] = time.perf_counter()

        async def receive_stamped():
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body"):
                stamps["body"] = time.perf_counter()
            return message

        async def send_stamped(message):
            if message["type"] == "http.response.body" and message.get("body") and "write" not in stamps:
                stamps["write"] = time.perf_counter()
                profile.disable()
            await send(message)

        if profiling[0]:
            profile.enable()
        try:
            await app(scope, receive_stamped, send_stamped)
        finally:
            profile.disable()
            held.clear()

    run_app(outer, app.state.lifecycle, host="127.0.0.1", port=port, log_level="warning", shutdown_timeout_s=1)


class Conversation:
    """A chat that grows turn by turn as the sessions bench's do: a history of ~``n`` bytes (user and assistant
    messages), then each turn the server's reply and a new user message of TURN_BYTES; one cache_salt."""

    def __init__(self, n: int, turns: int = 20):
        # as the sessions bench's conversations at their 20th turn: a long first message, then turns
        self.salt = uuid.uuid4().hex
        filler = "the history of a long conversation, word after word. "

        def text(size: int) -> str:
            return (filler * (size // len(filler) + 1))[:size]

        first = max(TURN_BYTES, n - (turns - 1) * (TURN_BYTES + REPLY_BYTES))
        self.messages = [{"role": "user", "content": text(first)}]
        for _ in range(turns - 1):
            self.messages += [{"role": "assistant", "content": text(REPLY_BYTES)},
                              {"role": "user", "content": text(TURN_BYTES)}]

    def turn(self, client):
        run = client.stream(self.messages, max_tokens=REPLY_BYTES, cache_salt=self.salt)
        self.messages += [{"role": "assistant", "content": run.text},
                          {"role": "user", "content": f"{uuid.uuid4().hex} " + "n" * (TURN_BYTES - 33)}]
        return run


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares ys = a + b * xs: (a, b)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def measure(args: argparse.Namespace) -> None:
    from qml_server.bench_common import Client, IdPrompts

    port = args.port
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(port)] + (["--chat"] if args.chat else []),
                            env={**os.environ})
    base = f"http://127.0.0.1:{port}"
    client = Client(base + "/v1", None, timeout=30.0)
    try:
        for _ in range(200):
            try:
                if client.http.get(base + "/health").status_code == 200:
                    break
            except Exception:  # noqa: BLE001  (not listening yet)
                pass
            time.sleep(0.1)
        client.pick_model(None)
        prompts = IdPrompts(VOCAB)
        sizes = [int(s) for s in args.sizes.split(",")]
        rows = {}
        for n in sizes:
            runs = []
            conversation = Conversation(n) if args.chat else None
            for i in range(args.warmup + args.repeats):
                if conversation is not None:
                    run = conversation.turn(client)
                else:
                    run = client.stream(prompts.make(n), max_tokens=1)
                s = client.http.get(base + "/bench/stamps").json()
                if i < args.warmup:
                    continue
                points = [run.sent_at] + [s[k] for k in STAMPS] + [run.first_token_at]
                runs.append([(b - a) * 1e3 for a, b in zip(points, points[1:])] + [run.ttft_s * 1e3])
            rows[n] = [statistics.median(col) for col in zip(*runs)]
        head = ["tokens"] + list(PHASES) + ["TTFT"]
        what = (f"chat turns over histories of ~n bytes (byte tokenizer: n tokens), replies kept, {TURN_BYTES}-byte "
                f"new turns" if args.chat else f"ids from [{prompts.lo}, {prompts.hi})")
        print(f"median ms over {args.repeats} runs (stand-in engine: 0 ms); {what}")
        print(" ".join(f"{h:>13}" for h in head))
        for n in sizes:
            print(" ".join(f"{v:>13}" for v in [n] + [f"{x:.3f}" for x in rows[n]]))
        if len(set(sizes)) > 1:  # (one size: no line to fit)
            fixed, per_k = zip(*(fit(sizes, [rows[n][j] for n in sizes]) for j in range(len(head) - 1)))
            print(" ".join(f"{v:>13}" for v in ["fixed"] + [f"{a:.3f}" for a in fixed]))
            print(" ".join(f"{v:>13}" for v in ["per 1k tok"] + [f"{b * 1e3:.3f}" for b in per_k]))
        if args.profile:
            client.http.get(base + "/bench/profile?true")
            conversation = Conversation(args.profile) if args.chat else None
            for _ in range(args.repeats):
                if conversation is not None:
                    conversation.turn(client)
                else:
                    client.stream(prompts.make(args.profile), max_tokens=1)
            print(f"\ncProfile of the event loop's thread, {args.repeats} requests of {args.profile} tokens:")
            print(client.http.get(base + "/bench/profile?false").json())
    finally:
        client.close()
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="130,2340,8890,26900")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--port", type=int, default=18431)
    parser.add_argument("--profile", type=int, default=0, help="prompt tokens of the cProfile'd requests (0: none)")
    parser.add_argument("--chat", action="store_true",
                        help="chat turns of a growing conversation (the sessions bench's requests), not token ids")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # the server subprocess, on this port
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.chat)
    else:
        measure(args)


if __name__ == "__main__":
    main()
