"""The disk tier's page encoding (format version 2, ``qml_runtime.kv.disk_store``) on CPU: how many
fewer bytes a page takes, and how fast one core encodes and decodes it.

    python benchmarks/disk_codec_cpu.py [--smollm2] [--out FILE.json]

Pages of 2 MiB: Gaussian values in bf16 and fp16 at a few scales (what the H200 benchmarks' random
weights give), fp32, and with ``--smollm2`` the KV of the embedded SmolLM2-135M after a 1,200-token
prompt (real weights; bf16 KV, the engine run on CPU). Encode is ``_encode`` (split, compress),
decode ``_decode_into`` (decompress, join), each timed over 20 pages on one thread, then on two.
"""

from __future__ import annotations

import argparse
import json
import platform
import threading
import time

import torch

from qml_runtime.kv.block_file import _decode_into, _encode
from qml_runtime.kv.disk_store import _byte_view

PAGE = 2 << 20


def gaussian(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = PAGE // torch.empty(0, dtype=dtype).element_size()
    return (torch.randn(n, generator=g) * torch.rand(n, generator=g) * 3).to(dtype)


def smollm2_pages() -> dict[str, torch.Tensor]:
    from qml_runtime.loader import load_engine
    from qml_runtime.sampling_params import SamplingParams

    eng = load_engine(None, device="cpu", progress=False, dtype="bfloat16")
    eng.start()
    try:
        text = open(__file__.replace("benchmarks/disk_codec_cpu.py", "README.md")).read()
        ids = eng.tokenizer.encode(text * 4)[:1200]
        eng.generate_sync(ids, SamplingParams(max_tokens=1, temperature=0))
        kv = eng.kv.data  # [L, 2, pages, S, Hkv, Dh]
        used = kv[:, :, 1:1 + 1200 // kv.shape[3]]
        return {"smollm2 K (bf16)": used[:, 0].contiguous().reshape(-1), "smollm2 V (bf16)": used[:, 1].contiguous().reshape(-1)}
    finally:
        eng.shutdown()


def timed(fn, reps: int, threads: int) -> float:
    if threads == 1:
        t0 = time.perf_counter()
        fn(reps)
        return time.perf_counter() - t0
    th = [threading.Thread(target=fn, args=(reps,)) for _ in range(threads)]
    t0 = time.perf_counter()
    for t in th:
        t.start()
    for t in th:
        t.join()
    return time.perf_counter() - t0


def measure(name: str, page: torch.Tensor, reps: int = 20) -> dict:
    data = _byte_view(page.contiguous())
    parts = _encode(data, page.element_size())
    if parts is None:
        return {"page": name, "ratio": 1.0, "note": "not smaller: written raw"}
    payload = memoryview(b"".join(bytes(memoryview(p).cast("B")) for p in parts))
    check = memoryview(bytearray(data.nbytes))
    _decode_into(payload, check)
    assert bytes(check) == bytes(data), name

    def enc(n):
        for _ in range(n):
            _encode(data, page.element_size())

    def dec(n):
        out = memoryview(bytearray(data.nbytes))
        for _ in range(n):
            _decode_into(payload, out)

    row = {"page": name, "kv_bytes": data.nbytes, "stored_bytes": payload.nbytes,
           "ratio": round(data.nbytes / payload.nbytes, 3)}
    for threads in (1, 2):
        row[f"encode_GBps_{threads}t"] = round(threads * reps * data.nbytes / timed(enc, reps, threads) / 1e9, 2)
        row[f"decode_GBps_{threads}t"] = round(threads * reps * data.nbytes / timed(dec, reps, threads) / 1e9, 2)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smollm2", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()
    pages = {"gaussian bf16": gaussian(torch.bfloat16), "gaussian bf16 x0.05": gaussian(torch.bfloat16) * 0.05,
             "gaussian fp16": gaussian(torch.float16), "gaussian fp32": gaussian(torch.float32)}
    if args.smollm2:
        pages |= smollm2_pages()
    rows = [measure(name, page) for name, page in pages.items()]
    for r in rows:
        print(r, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "cpu": platform.processor() or platform.machine(),
                       "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
