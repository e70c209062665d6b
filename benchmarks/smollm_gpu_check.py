"""The embedded SmolLM2 GGUF on the GPU gives the CPU's greedy text.

    python benchmarks/smollm_gpu_check.py --out DIR [--gguf PATH]

Runs the same chat prompts greedily through the engine on the CPU (fp32, reference ops) and
on the GPU (our kernels, CUDA graphs) in fp32 and in bf16, and records where the token
streams first differ. fp32 on both sides must agree token for token; bf16 rounds every
activation, so it is reported, not required.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qml_runtime.loader import find_default_model, load_engine
from qml_runtime.sampling_params import SamplingParams

PROMPTS = ["What is the capital of France?", "Write a Python function that adds two numbers.",
           "Tell me a short story about a dragon.", "Describe the water cycle in detail."]


def run(path: Path, device: str, dtype: str, tokens: int) -> tuple[list[list[int]], list[str]]:
    engine = load_engine(str(path), device=device, dtype=dtype, progress=False, kv_host_gib=0)
    engine.start()
    try:
        params = SamplingParams(max_tokens=tokens, temperature=0.0)
        chats = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
        outs = [engine.generate_sync(ids, params) for ids in chats]
        return [o.token_ids for o in outs], [o.text for o in outs]
    finally:
        engine.shutdown()


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--gguf", type=Path)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    path = args.gguf or find_default_model()
    cpu_ids, cpu_text = run(path, "cpu", "float32", args.tokens)
    result = {"model": path.name, "prompts": PROMPTS, "cpu_text": cpu_text, "runs": {}}
    ok = True
    for dtype in ("float32", "bfloat16"):
        ids, text = run(path, "cuda", dtype, args.tokens)
        diffs = [first_difference(a, b) for a, b in zip(cpu_ids, ids)]
        result["runs"][dtype] = {"text": text, "first_difference": diffs,
                                 "identical": all(d is None for d in diffs)}
        print(dtype, "first differing token per prompt:", diffs, flush=True)
        if dtype == "float32":
            ok &= all(d is None for d in diffs)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "smollm-gpu-check.json").write_text(json.dumps(result, indent=1))
    print("CPU:", cpu_text[0][:120], flush=True)
    print("GPU fp32 identical to CPU:", result["runs"]["float32"]["identical"], flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
