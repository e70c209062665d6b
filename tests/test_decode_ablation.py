"""benchmarks/decode_ablation.py: an op left out of the decode step returns, at each call site, what that call
returned in a real step. So a step with any side-effect-free op left out gives the real step's logits exactly
(checked for every op of a Qwen3-MoE and a Llama preset on CPU); RoPE, which rotates q in place, does not."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import decode_ablation  # noqa: E402


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-llama"])
def test_left_out_ops_replay_their_real_outputs(preset):
    step, model, cfg = decode_ablation.decode_step(preset, 40, "cpu")
    with torch.inference_mode():
        want = step()
        ops = decode_ablation._ops(model, cfg)
        assert ("moe_route" in ops) == bool(cfg.num_experts)
        for name, (module, fn_name, skip) in ops.items():
            real = getattr(module, fn_name)
            with decode_ablation.left_out(module, fn_name, skip, step) as rec:
                if not rec.outputs:  # the fused routing runs on a GPU only (moe_router + moe_align here)
                    assert name == "moe_route", f"{name}: no call recorded"
                    continue
                got = step()
                skipped = rec.i  # every call counted, skipped or not
            assert getattr(module, fn_name) is real, f"{name}: the real function is back"
            assert skipped == len(rec.outputs), f"{name}: {skipped} calls replayed, {len(rec.outputs)} recorded"
            if name == "rope_kv_write":  # its work is in place (q rotated): leaving it out changes the logits
                assert not torch.equal(got, want)
            else:
                assert torch.equal(got, want), f"{name}: the step without it must give the same logits"


def test_the_script_writes_a_row_per_op(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["decode_ablation.py", "--out", str(tmp_path), "--device", "cpu",
                                      "--preset", "tiny-qwen3-moe", "--context", "20", "--reps", "3"])
    assert decode_ablation.main() == 0
    import json

    result = json.loads((tmp_path / "decode-ablation-tiny-qwen3-moe.json").read_text())
    assert result["step_ms"] > 0 and {r["op"] for r in result["rows"]} >= {"moe_route", "linear qkv", "logits head"}
