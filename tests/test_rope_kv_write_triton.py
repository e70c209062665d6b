"""RoPE fused with the paged KV write: the Triton kernel against the composed reference (interpreter on
CPU), the cache slots it must leave alone, q rotated in place, and its compilation for Hopper."""

from __future__ import annotations

import os
import re

import pytest
import torch

from qml_kernels import registry
from qml_kernels.attention import kv_write
from qml_kernels.rope import rope
from qml_kernels.rope_kv_write import (
    ROPE_KV_WRITE_SPEC,
    RopeKVWriteConfig,
    _constexprs,
    _rope_kv_write_kernel,
    rope_kv_write,
    rope_kv_write_ref,
    rope_kv_write_triton,
)
from qml_kernels.workbench.compile import assert_compiled_for_hopper
from qml_kernels.workbench.spec import Case

# max |out - ref| / max |ref|, ref computed in fp32; fp16 allows one output rounding (2^-11)
TOLERANCES = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# the interpreter computes bf16 wrongly without an error: bf16 is checked on the GPU only
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
CONFIGS = {
    "default": RopeKVWriteConfig(),
    # every head its own program: no masked head rows, and the most kv programs per token
    "one-head": RopeKVWriteConfig(block_h=1, block_hkv=1, num_warps=1),
}
CASES = {case.name: case for case in ROPE_KV_WRITE_SPEC.cases}


def _inputs(case: Case, dtype: torch.dtype) -> tuple[int, dict]:
    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator(DEVICE).manual_seed(seed)
    return seed, ROPE_KV_WRITE_SPEC.make_inputs(case, dtype, DEVICE, gen)


def _expected(inputs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference on fp32 copies: (q rotated, k cache, v cache)."""
    copies = {name: value.float().clone() if isinstance(value, torch.Tensor) and value.is_floating_point() else value
              for name, value in inputs.items()}
    return rope_kv_write_ref(**copies)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite values in the output (an unwritten NaN-poisoned element?)"
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def _targeted(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[P * S] bool: the slots this step writes."""
    hit = torch.zeros(cache.shape[0] * cache.shape[1], dtype=torch.bool, device=cache.device)
    hit[slots[slots >= 0]] = True
    return hit


def _rows(cache: torch.Tensor) -> torch.Tensor:
    return cache.reshape(-1, *cache.shape[2:])  # [P * S, Hkv, Dh]


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_kernel_matches_reference_on_poisoned_outputs(case, dtype, config):
    """q_out and both caches start as NaN: every targeted element must be written, no other slot."""
    seed, inputs = _inputs(case, dtype)
    q, k, v, slots = inputs["q"], inputs["k"], inputs["v"], inputs["slot_mapping"]
    before = {name: inputs[name].clone() for name in ("q", "k", "v")}
    inputs["k_cache"] = torch.full_like(inputs["k_cache"], float("nan"))
    inputs["v_cache"] = torch.full_like(inputs["v_cache"], float("nan"))
    expected = _expected(inputs)
    out = torch.full_like(q, float("nan"))
    got = rope_kv_write_triton(**inputs, out=out, config=config)
    assert got[0] is out and got[1] is inputs["k_cache"] and got[2] is inputs["v_cache"]

    tol, R = TOLERANCES[dtype], 2 * inputs["cos"].shape[-1]
    err = _rel_err(out, expected[0])
    assert err <= tol, f"{case.name} {dtype} q: error {err:.2e} > {tol:.0e} (seed {seed})"
    norm = "q_norm" in inputs  # normalised heads: pass-through dims are scaled too (checked against expected)
    assert norm or torch.equal(out[..., R:], q[..., R:]), f"q pass-through dims changed (seed {seed})"
    hit = _targeted(got[1], slots)
    for name, cache, ref in (("k_cache", got[1], expected[1]), ("v_cache", got[2], expected[2])):
        written, kept = _rows(cache)[hit], _rows(cache)[~hit]
        err = _rel_err(written, _rows(ref)[hit])
        assert err <= tol, f"{case.name} {dtype} {name}: error {err:.2e} > {tol:.0e} (seed {seed})"
        assert kept.isnan().all(), f"{name}: a slot that no token targets was written (seed {seed})"
    valid = slots >= 0
    # v is copied, and k's pass-through dims too: bit for bit
    assert torch.equal(_rows(got[2])[slots[valid]], v[valid]), f"v was not copied exactly (seed {seed})"
    assert norm or torch.equal(_rows(got[1])[slots[valid]][..., R:], k[valid][..., R:]), \
        f"k pass-through (seed {seed})"
    for name, old in before.items():
        assert torch.equal(inputs[name], old), f"the input {name} was modified (seed {seed})"


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_q_in_place_and_other_slots_keep_their_values(case):
    """The engine's call, out=q on the fused QKV views: q rotates where it lies, k and v (still in
    the QKV buffer) are left alone, and the pool's other slots keep their values bit for bit."""
    seed, inputs = _inputs(case, torch.float16)
    q, k, v, slots = inputs["q"], inputs["k"], inputs["v"], inputs["slot_mapping"]
    k_before, v_before = k.clone(), v.clone()
    caches_before = inputs["k_cache"].clone(), inputs["v_cache"].clone()
    expected = _expected(inputs)
    got = rope_kv_write_triton(**inputs, out=q)
    assert got[0] is q
    err = _rel_err(q, expected[0])
    assert err <= TOLERANCES[torch.float16], f"{case.name} in place q: error {err:.2e} (seed {seed})"
    assert torch.equal(k, k_before) and torch.equal(v, v_before), f"k or v was written back (seed {seed})"
    hit = _targeted(got[1], slots)
    for name, cache, old, ref in (("k_cache", got[1], caches_before[0], expected[1]),
                                  ("v_cache", got[2], caches_before[1], expected[2])):
        assert torch.equal(_rows(cache)[~hit], _rows(old)[~hit]), f"{name}: an untargeted slot changed (seed {seed})"
        err = _rel_err(cache, ref)
        assert err <= TOLERANCES[torch.float16], f"{case.name} {name}: error {err:.2e} (seed {seed})"


def test_cache_in_another_dtype():
    """An fp32 pool under fp16 activations: k and v are converted on the way in, as kv_write does."""
    seed, inputs = _inputs(CASES["page-boundary"], torch.float16)
    inputs["k_cache"], inputs["v_cache"] = inputs["k_cache"].float(), inputs["v_cache"].float()
    expected = _expected(inputs)
    got = rope_kv_write_triton(**inputs)
    assert got[1].dtype == got[2].dtype == torch.float32
    for o, ref in zip(got, expected):
        assert _rel_err(o, ref) <= TOLERANCES[torch.float16], f"seed {seed}"


def test_public_op_runs_the_kernel_under_using_triton():
    seed, inputs = _inputs(CASES["negative-slots"], torch.float16)
    expected = _expected(inputs)
    args = [inputs[name] for name in ("q", "k", "v", "cos", "sin", "k_cache", "v_cache", "slot_mapping",
                                      "interleaved")]
    with registry.using("triton"):
        assert registry.select("rope_kv_write", *args).name == "triton"
        q_out, k_cache, v_cache = rope_kv_write(*args, out=inputs["q"])  # the engine's in-place call
    assert q_out is inputs["q"]
    for o, ref in ((q_out, expected[0]), (k_cache, expected[1]), (v_cache, expected[2])):
        assert _rel_err(o, ref) <= TOLERANCES[torch.float16], f"seed {seed}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_reference_in_place_equals_the_rope_then_kv_write_pair(dtype):
    """The CPU engine's path does not change: the fused op's reference, in place, gives bit for bit
    what the model computed before with rope(out=(q, k)) and kv_write."""
    seed, inputs = _inputs(CASES["partial-interleaved"], dtype)
    pair = {name: value.clone() if isinstance(value, torch.Tensor) else value for name, value in inputs.items()}
    q, k, v = pair["q"], pair["k"], pair["v"]
    with registry.using("reference"):
        rope(q, k, pair["cos"], pair["sin"], pair["interleaved"], out=(q, k))
        kv_write(k, v, pair["k_cache"], pair["v_cache"], pair["slot_mapping"])
        rope_kv_write(**inputs, out=inputs["q"])
    for name in ("q", "k_cache", "v_cache"):
        assert torch.equal(inputs[name], pair[name]), f"{name} differs (seed {seed})"


def test_no_tokens():
    q, k = torch.empty(0, 4, 16, device=DEVICE), torch.empty(0, 2, 16, device=DEVICE)
    cache = torch.zeros(2, 4, 2, 16, device=DEVICE)
    cos = torch.empty(0, 8, device=DEVICE)
    q_out, k_cache, _ = rope_kv_write_triton(q, k, k, cos, cos, cache, cache.clone(),
                                             torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert q_out.shape == q.shape and torch.equal(k_cache, torch.zeros_like(cache))


def _bad(what: str) -> tuple:
    T, H, Hkv, Dh = 2, 4, 2, 16
    q, k, v = torch.randn(T, H, Dh), torch.randn(T, Hkv, Dh), torch.randn(T, Hkv, Dh)
    cos = torch.randn(T, Dh // 2)
    cache = torch.zeros(2, 4, Hkv, Dh)
    slots = torch.tensor([0, 5])
    args = {"q": q, "k": k, "v": v, "cos": cos, "sin": cos, "k_cache": cache, "v_cache": cache.clone(),
            "slot_mapping": slots}
    args.update({
        "v_heads": {"v": torch.randn(T, 1, Dh)},
        "dtype": {"k": k.half()},
        "strided_last_dim": {"q": torch.randn(T, Dh, H).transpose(1, 2)},
        "rotary_too_wide": {"cos": torch.randn(T, 9), "sin": torch.randn(T, 9)},
        "table_dtype": {"cos": cos.half(), "sin": cos.half()},
        "cache_head_dim": {"k_cache": torch.zeros(2, 4, Hkv, 8), "v_cache": torch.zeros(2, 4, Hkv, 8)},
        "cache_dtypes_differ": {"v_cache": cache.half()},
        "slot_dtype": {"slot_mapping": slots.float()},
        "slot_count": {"slot_mapping": slots[:1]},
        "out_dtype": {"out": q.half()},
    }[what])
    return args


@pytest.mark.parametrize("what", ["v_heads", "dtype", "strided_last_dim", "rotary_too_wide", "table_dtype",
                                  "cache_head_dim", "cache_dtypes_differ", "slot_dtype", "slot_count", "out_dtype"])
def test_rejects_bad_arguments(what):
    with pytest.raises(AssertionError):
        rope_kv_write_triton(**_bad(what))


def test_config_rejects_non_powers_of_two():
    with pytest.raises(ValueError):
        RopeKVWriteConfig(block_hkv=3)


# -- compilation for the H200 (sm_90a) -------------------------------------------------------

_STRIDES = ("stride_q_t", "stride_q_h", "stride_k_t", "stride_k_h", "stride_v_t", "stride_v_h", "stride_qo_t",
            "stride_qo_h", "stride_cos_t", "stride_sin_t", "stride_kc_p", "stride_kc_s", "stride_kc_h",
            "stride_vc_p", "stride_vc_s", "stride_vc_h")
_SIGNATURE = {
    **{name: "*bf16" for name in ("q_ptr", "k_ptr", "v_ptr", "q_out_ptr")},
    "cos_ptr": "*fp32", "sin_ptr": "*fp32", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "slot_ptr": "*i64",
    "qn_ptr": "*bf16", "kn_ptr": "*bf16", "eps": "fp32",
    "H": "i32", "HKV": "i32", "PAGE_SIZE": "i32",
    **{name: "i32" for name in _STRIDES},
    **{name: "constexpr" for name in ("HEAD_DIM", "HALF", "BLOCK_H", "BLOCK_HKV", "BLOCK_HALF", "BLOCK_PASS",
                                      "BLOCK_D", "INTERLEAVED", "Q_COPY_PASS", "HAS_PASS", "HAS_NORM")},
}


def _variant(Dh: int, R: int, interleaved: bool, Hkv: int = 8, in_place: bool = True, norm: bool = False) -> dict:
    """The bf16 kernel for 32 q heads exactly as the launcher specialises it (default config); at these
    sizes every stride is a multiple of 16 elements, which a real launch tells the compiler."""
    constexprs, num_warps = _constexprs(32, Hkv, Dh, R // 2, interleaved, in_place, RopeKVWriteConfig(), norm)
    return {"kernel": _rope_kv_write_kernel, "signature": _SIGNATURE, "constexprs": constexprs,
            "num_warps": num_warps, "num_stages": 1, "divisible": _STRIDES}


COMPILE_VARIANTS = {
    **{f"dh{Dh}-{layout}": _variant(Dh, Dh, layout == "interleaved")
       for Dh in (64, 128, 256) for layout in ("rotate-half", "interleaved")},
    "qwen3-hkv4": _variant(128, 128, interleaved=False, Hkv=4),
    "partial-rotate-half-copy": _variant(128, 64, interleaved=False, in_place=False),
    "partial-interleaved": _variant(128, 64, interleaved=True),
    # Qwen3's per-head q/k RMSNorm folded in (in place in the fused QKV buffer, as the model calls it)
    "qwen3-hkv4-norm": _variant(128, 128, interleaved=False, Hkv=4, norm=True),
    "partial-rotate-half-norm": _variant(128, 64, interleaved=False, norm=True),
}


@pytest.mark.parametrize("name", COMPILE_VARIANTS)
def test_compiles_for_hopper(compile_reports, name):
    # an elementwise kernel: spilling would add local-memory traffic to a memory-bound op
    report = assert_compiled_for_hopper(compile_reports[name], name)
    norm = COMPILE_VARIANTS[name]["constexprs"]["HAS_NORM"]
    # the norm's row sums cross warps: a little shared memory for the reduction, more registers
    assert report.registers is None or report.registers <= (96 if norm else 64), \
        f"{name}: {report.registers} registers"
    assert report.shared_bytes <= (1024 if norm else 0), f"{name}: {report.shared_bytes} B shared"
    # every access to q, k, v, the caches and cos/sin is a 128-bit vector; the one scalar is the slot
    accesses = set(re.findall(r"\b(?:ld|st)\.global[\w.:]*", report.ptx))
    assert {"ld.global.v4.b32", "st.global.v4.b32"} <= accesses, f"{name}: no 128-bit accesses"
    # (with the norm, the weights' loads may be narrower: Dh elements per program, from L1)
    allowed = {"ld.global.v4.b32", "st.global.v4.b32", "ld.global.b64"}
    allowed |= {"ld.global.b16", "ld.global.b32"} if norm else set()
    assert accesses <= allowed, f"{name}: {sorted(accesses)}"
