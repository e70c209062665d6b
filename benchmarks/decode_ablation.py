"""Where a batch-1 decode step's time goes under PDL: each op left out in turn, its share of the step.

Under programmatic dependent launch a kernel's profiled time includes its wait for the one before it, so
per-kernel times no longer add up to the step (engine-h200-qwen3-30b-a3b-pdl-graphprofile-2026-12-03.json:
5.25 ms of kernels in a 3.26 ms step). This measures what each op adds to the step instead: the step (the
model's forward over one token and the logits head, as the engine's decode graph runs it) is captured in a
CUDA graph, then captured again with one op left out at every call site, and both are timed. A left-out call
launches nothing and returns what that call returned in a real step (recorded first), so the ops after it
read real-shaped data.

The ops, by the names the models call them by: the attention's ``linear`` projections (fused QKV, output),
``rope_kv_write``, ``paged_attention``, the norms (``add_rmsnorm``, ``combine_add_rmsnorm``), the MoE
router's ``linear``, ``moe_route``, each of the two ``moe_gemm``, ``moe_combine``; a dense model's FFN
``linear``; the logits head.

    python benchmarks/decode_ablation.py --out DIR [--preset qwen3-30b-a3b] [--context 256]
    python benchmarks/decode_ablation.py --out DIR --device cpu --preset tiny-qwen3-moe   # a smoke run

On CPU the step runs eagerly (no graph): the script's own check, not a measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import statistics
import time
from pathlib import Path

import torch
from graph_timing import graph_ms  # beside this script

from qml_kernels.attention import AttentionMetadata
from qml_runtime.loader import load_engine


class _Recorder:
    """Wraps a module-level function: records each call's output in a real step (``record``), then
    returns those outputs without calling it where ``skip(args)`` says so (``replay``)."""

    def __init__(self, module, name: str, skip=lambda *a, **k: True):
        self.module, self.name, self.fn, self.skip = module, name, getattr(module, name), skip
        self.outputs: list = []
        self.mode, self.i = "off", 0

    def __call__(self, *args, **kwargs):
        if self.mode == "record":
            out = self.fn(*args, **kwargs)
            # a copy: the ops after it may work in place on what it returned (RoPE rotates the QKV output)
            self.outputs.append(_copy(out))
            return out
        if self.mode == "replay" and self.skip(*args, **kwargs):
            out = self.outputs[self.i % len(self.outputs)]
            self.i += 1
            return out
        self.i += 1
        return self.fn(*args, **kwargs)


def _copy(out):
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, tuple):
        return tuple(_copy(o) for o in out)
    return out


def _ops(model, cfg) -> dict[str, tuple]:
    """name -> (module, function name, which calls to leave out)."""
    from qml_kernels import moe_gemm as moe_gemm_module
    from qml_runtime.models import llama, qwen3

    layer = model.layers[0]
    shape = {"qkv": layer.wqkv.shape, "o": layer.wo.shape}
    head = (model.embed if model.lm_head is None else model.lm_head).shape
    ops = {
        "linear qkv": (llama, "linear", lambda x, w: w.shape == shape["qkv"]),
        "linear o": (llama, "linear", lambda x, w: w.shape == shape["o"]),
        "logits head": (llama, "linear", lambda x, w: w.shape == head),
        "rope_kv_write": (llama, "rope_kv_write", lambda *a, **k: True),
        "paged_attention": (llama, "paged_attention", lambda *a, **k: True),
        "combine_add_rmsnorm (before attention)": (llama, "combine_add_rmsnorm", lambda *a, **k: True),
    }
    if cfg.num_experts:
        ops.update({
            "add_rmsnorm (before the FFN)": (llama, "add_rmsnorm", lambda *a, **k: True),
            "linear router": (qwen3, "linear", lambda *a, **k: True),
            "moe_route": (moe_gemm_module, "moe_route", lambda *a, **k: True),
            "moe_gemm gate-up": (moe_gemm_module, "moe_gemm", lambda *a, **k: k.get("swiglu", False)),
            "moe_gemm down": (moe_gemm_module, "moe_gemm", lambda *a, **k: not k.get("swiglu", False)),
            "moe_combine": (moe_gemm_module, "moe_combine", lambda *a, **k: True),
        })
    else:
        ops["add_rmsnorm (before the FFN)"] = (llama, "add_rmsnorm", lambda *a, **k: True)
        ops["swiglu"] = (llama, "swiglu", lambda *a, **k: True)
    return ops


def decode_step(preset: str, context: int, device: str):
    """(step, model, config): ``step()`` runs the preset's forward over one token after ``context`` cached
    keys and its logits head, as the engine's decode graph does (without the sampler)."""
    dev = torch.device(device)
    engine = load_engine(f"preset:{preset}", random_weights=True, device=device, kv_cache_gib=4,
                         max_num_seqs=1, progress=False, cuda_graphs=False)
    model, kv, cfg = engine.runner.model, engine.kv, engine.model_config
    S, L = kv.block_size, context
    pages = -(-(L + 1) // S)
    meta = AttentionMetadata.build([L], [list(range(pages))], [0, 1], [L + 1], dev)  # the token's slot: position L
    # a history of unit-scale keys and values (the pool starts at zero; any values time the same, but a
    # softmax over real-looking scores keeps the routing downstream away from ties)
    kv.data[:, :, :pages].normal_(generator=torch.Generator(dev).manual_seed(0))
    ids = torch.tensor([300], device=dev)
    pos = torch.tensor([L], device=dev)

    def step():
        return model.logits(model(ids, pos, kv, meta))

    return step, model, cfg


def timed(fn, cuda: bool, reps: int) -> float:
    """Median ms of ``fn()``: a CUDA graph's replay on a GPU, an eager call on CPU."""
    if cuda:
        return graph_ms(fn, reps)
    times = []
    for _ in range(max(3, reps // 10)):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


@contextlib.contextmanager
def left_out(module, fn_name: str, skip, step):
    """Within: ``module.fn_name`` is a ``_Recorder`` that has recorded one real ``step()`` and returns those
    outputs at the calls ``skip`` names, launching nothing there. Yields the recorder."""
    rec = _Recorder(module, fn_name, skip)
    setattr(module, fn_name, rec)
    try:
        rec.mode = "record"
        step()
        rec.mode, rec.i = "replay", 0
        yield rec
    finally:
        setattr(module, fn_name, rec.fn)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--context", type=int, default=256, help="keys cached before the token (the bench decodes 130-386)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--reps", type=int, default=50)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    dev = torch.device(args.device)
    step, model, cfg = decode_step(args.preset, args.context, args.device)
    L = args.context
    cuda = dev.type == "cuda"

    import triton

    meta_out = {"gpu": torch.cuda.get_device_name() if cuda else "cpu", "date": datetime.date.today().isoformat(),
                "torch": torch.__version__, "triton": triton.__version__, "preset": args.preset, "context": L,
                "command": f"python benchmarks/decode_ablation.py --out DIR --preset {args.preset} --context {L}"}
    rows = []
    result = {"meta": meta_out, "rows": rows}
    path = args.out / f"decode-ablation-{args.preset}.json"
    with torch.inference_mode():
        full = result["step_ms"] = round(timed(step, cuda, args.reps), 4)
        print(f"{args.preset}, batch 1, {L} cached keys: {full:.3f} ms a step", flush=True)
        for name, (module, fn_name, skip) in _ops(model, cfg).items():
            with left_out(module, fn_name, skip, step) as rec:
                calls = len(rec.outputs)
                without = timed(lambda: (setattr(rec, "i", 0), step())[1], cuda, args.reps)
            row = {"op": name, "step_ms_without": round(without, 4), "share_us": round((full - without) * 1e3, 1),
                   "calls_recorded": calls}
            rows.append(row)
            print(f"  without {name:42s} {without:8.3f} ms  ({(full - without) * 1e3:+8.1f} us)", flush=True)
            path.write_text(json.dumps(result, indent=1))  # after every row: a run cut short keeps what it timed
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
