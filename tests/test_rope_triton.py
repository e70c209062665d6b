"""RoPE: the Triton kernel against rope_ref (interpreter on CPU), its compilation for Hopper,
and the frequency rules (plain, llama3, linear, YaRN) against their definitions and transformers."""

from __future__ import annotations

import math
import os

import pytest
import torch

from qml_kernels import registry
from qml_kernels.rope import (
    ROPE_SPEC,
    RopeConfig,
    RopeScaling,
    _constexprs,
    _rope_kernel,
    rope,
    rope_cos_sin,
    rope_inv_freq,
    rope_ref,
    rope_triton,
)
from qml_kernels.workbench.compile import assert_compiled_for_hopper
from qml_kernels.workbench.spec import Case

# max |out - ref| / max |ref|, ref computed in fp32; fp16 allows one output rounding (2^-11)
TOLERANCES = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# the interpreter computes bf16 wrongly without an error: bf16 is checked on the GPU only
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
CONFIGS = {
    "default": RopeConfig(),
    # one head per program: every head its own program, no masked head rows
    "one-head": RopeConfig(block_h=1, num_warps=1),
}


def _inputs(case: Case, dtype: torch.dtype) -> tuple[int, dict]:
    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator(DEVICE).manual_seed(seed)
    return seed, ROPE_SPEC.make_inputs(case, dtype, DEVICE, gen)


def _expected(inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    return rope_ref(inputs["q"].float(), inputs["k"].float(), inputs["cos"], inputs["sin"], inputs["interleaved"])


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite values in the output (an unwritten NaN-poisoned element?)"
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def _rotary_dim(inputs: dict) -> int:
    return 2 * inputs["cos"].shape[-1]


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ROPE_SPEC.cases, ids=lambda c: c.name)
def test_kernel_matches_reference(case, dtype, config):
    seed, inputs = _inputs(case, dtype)
    q, k = inputs["q"], inputs["k"]
    q_before, k_before = q.clone(), k.clone()
    out = (torch.full_like(q_before, float("nan")), torch.full_like(k_before, float("nan")))
    got = rope_triton(**inputs, out=out, config=config)
    assert got[0] is out[0] and got[1] is out[1]
    tol, R = TOLERANCES[dtype], _rotary_dim(inputs)
    for name, o, ref, before in (("q", got[0], _expected(inputs)[0], q_before),
                                 ("k", got[1], _expected(inputs)[1], k_before)):
        err = _rel_err(o, ref)
        assert err <= tol, f"{case.name} {dtype} {name}: error {err:.2e} > {tol:.0e} (seed {seed})"
        # the pass-through dimensions are copied, not recomputed
        assert torch.equal(o[..., R:], before[..., R:]), f"{name}: pass-through dims changed (seed {seed})"
    assert torch.equal(q, q_before) and torch.equal(k, k_before), "the inputs were modified"


@pytest.mark.parametrize("interleaved", [False, True], ids=["rotate-half", "interleaved"])
@pytest.mark.parametrize("R", [32, 24], ids=["full", "partial"])
def test_in_place_on_fused_qkv_views(R, interleaved):
    """out=(q, k) rotates the q/k views of a fused QKV row where they lie, leaving v alone."""
    T, H, Hkv, Dh = 4, 5, 2, 32
    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator(DEVICE).manual_seed(seed)
    qkv = torch.randn(T, (H + 2 * Hkv) * Dh, generator=gen, device=DEVICE).half()  # [T, (H + 2Hkv) Dh]
    before = qkv.clone()
    q, k = qkv[:, : H * Dh].view(T, H, Dh), qkv[:, H * Dh: (H + Hkv) * Dh].view(T, Hkv, Dh)
    cos, sin = rope_cos_sin(torch.randint(0, 5000, (T,), generator=gen, device=DEVICE), rope_inv_freq(R, 1e4)[0])
    expected = rope_ref(q.float(), k.float(), cos, sin, interleaved)
    got = rope_triton(q, k, cos, sin, interleaved, out=(q, k))
    assert got[0] is q and got[1] is k
    for name, o, ref in (("q", q, expected[0]), ("k", k, expected[1])):
        err = _rel_err(o, ref)
        assert err <= TOLERANCES[torch.float16], f"in place {name}: error {err:.2e} (seed {seed})"
    assert torch.equal(qkv[:, (H + Hkv) * Dh:], before[:, (H + Hkv) * Dh:]), "v was written"
    assert torch.equal(q[..., R:], before[:, : H * Dh].view(T, H, Dh)[..., R:]), "pass-through dims changed"


def test_allocates_contiguous_outputs_by_default():
    case = next(c for c in ROPE_SPEC.cases if c.dims.get("fused"))
    seed, inputs = _inputs(case, torch.float32)
    q_out, k_out = rope_triton(**inputs)
    assert q_out.is_contiguous() and k_out.is_contiguous()
    assert q_out.data_ptr() != inputs["q"].data_ptr() and k_out.data_ptr() != inputs["k"].data_ptr()
    ref_q, ref_k = _expected(inputs)
    assert max(_rel_err(q_out, ref_q), _rel_err(k_out, ref_k)) <= TOLERANCES[torch.float32], f"seed {seed}"


def test_no_tokens():
    q, k = torch.empty(0, 4, 16, device=DEVICE), torch.empty(0, 2, 16, device=DEVICE)
    cos = torch.empty(0, 8, device=DEVICE)
    q_out, k_out = rope_triton(q, k, cos, cos)
    assert q_out.shape == q.shape and k_out.shape == k.shape


def test_layouts_agree_under_the_gguf_permutation():
    """Interleaved RoPE on llama.cpp's permuted head dims equals rotate-half RoPE on HF's order."""
    T, H, Hkv, Dh, R = 3, 4, 2, 32, 32
    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator(DEVICE).manual_seed(seed)
    q, k = torch.randn(T, H, Dh, generator=gen, device=DEVICE), torch.randn(T, Hkv, Dh, generator=gen, device=DEVICE)
    cos, sin = rope_cos_sin(torch.randint(0, 5000, (T,), generator=gen, device=DEVICE), rope_inv_freq(R, 1e4)[0])
    # GGUF position 2i holds HF dim i, 2i+1 holds HF dim i + R/2
    to_gguf = torch.stack((torch.arange(R // 2), torch.arange(R // 2) + R // 2), dim=-1).flatten()  # [R]
    hf_q, hf_k = rope_triton(q, k, cos, sin, interleaved=False)
    gg_q, gg_k = rope_triton(q[..., to_gguf], k[..., to_gguf], cos, sin, interleaved=True)
    torch.testing.assert_close(gg_q, hf_q[..., to_gguf], rtol=1e-6, atol=1e-6, msg=f"seed {seed}")
    torch.testing.assert_close(gg_k, hf_k[..., to_gguf], rtol=1e-6, atol=1e-6, msg=f"seed {seed}")


def test_public_rope_runs_the_kernel_under_using_triton():
    case = next(c for c in ROPE_SPEC.cases if c.dims.get("fused"))
    seed, inputs = _inputs(case, torch.float16)
    args = (inputs["q"], inputs["k"], inputs["cos"], inputs["sin"], inputs["interleaved"])
    expected = _expected(inputs)
    with registry.using("triton"):
        assert registry.select("rope", *args).name == "triton"
        got = rope(*args)
        for o, ref in zip(got, expected):
            assert _rel_err(o, ref) <= TOLERANCES[torch.float16], f"seed {seed}"
        rope(*args, out=(inputs["q"], inputs["k"]))  # the engine's in-place call
        for o, ref in zip((inputs["q"], inputs["k"]), expected):
            assert _rel_err(o, ref) <= TOLERANCES[torch.float16], f"in place, seed {seed}"


def test_reference_in_place_matches_its_copy():
    """The CPU engine's path: the reference honours out=(q, k) too."""
    seed, inputs = _inputs(ROPE_SPEC.cases[0], torch.float32)
    q, k, cos, sin = inputs["q"], inputs["k"], inputs["cos"], inputs["sin"]
    expected = rope_ref(q, k, cos, sin)
    with registry.using("reference"):
        rope(q, k, cos, sin, out=(q, k))
    assert torch.equal(q, expected[0]) and torch.equal(k, expected[1]), f"seed {seed}"


def _bad(what: str):
    q, k = torch.randn(2, 4, 16), torch.randn(2, 2, 16)
    cos = torch.randn(2, 8)
    return {
        "head_dim": (q, torch.randn(2, 2, 8), cos, cos),
        "dtype": (q, k.half(), cos, cos),
        "table_dtype": (q, k, cos.half(), cos.half()),
        "strided_last_dim": (torch.randn(2, 16, 4).transpose(1, 2), k, cos, cos),
        "rotary_too_wide": (q, k, torch.randn(2, 9), torch.randn(2, 9)),
        "table_tokens": (q, k, cos[:1], cos[:1]),
    }[what]


@pytest.mark.parametrize("what", ["head_dim", "dtype", "table_dtype", "strided_last_dim", "rotary_too_wide",
                                  "table_tokens"])
def test_rejects_bad_arguments(what):
    with pytest.raises(AssertionError):
        rope_triton(*_bad(what))


# -- compilation for the H200 (sm_90a) -------------------------------------------------------

_STRIDES = ("stride_q_t", "stride_q_h", "stride_k_t", "stride_k_h", "stride_qo_t", "stride_qo_h",
            "stride_ko_t", "stride_ko_h", "stride_cos_t", "stride_sin_t")
_SIGNATURE = {
    **{name: "*bf16" for name in ("q_ptr", "k_ptr", "q_out_ptr", "k_out_ptr")},
    "cos_ptr": "*fp32", "sin_ptr": "*fp32", "H": "i32", "HKV": "i32",
    **{name: "i32" for name in _STRIDES},
    **{name: "constexpr" for name in ("HEAD_DIM", "HALF", "BLOCK_H", "BLOCK_HALF", "BLOCK_PASS",
                                      "INTERLEAVED", "COPY_PASS")},
}


def _variant(H: int, Hkv: int, R: int, interleaved: bool, in_place: bool = False) -> dict:
    """The bf16 kernel for head_dim 128 exactly as the launcher would specialise it (default config);
    at these sizes every stride is a multiple of 16 elements, which a real launch tells the compiler."""
    config = RopeConfig()
    return {"kernel": _rope_kernel, "signature": _SIGNATURE, "num_warps": config.num_warps, "num_stages": 1,
            "constexprs": _constexprs(H, Hkv, 128, R // 2, interleaved, in_place, config), "divisible": _STRIDES}


COMPILE_VARIANTS = {
    "llama-rotate-half": _variant(32, 8, 128, interleaved=False),
    "llama-gguf-interleaved": _variant(32, 8, 128, interleaved=True),
    "llama-in-place": _variant(32, 8, 128, interleaved=False, in_place=True),
    "partial-rotate-half-copy": _variant(32, 4, 64, interleaved=False),
    "partial-interleaved-copy": _variant(32, 4, 64, interleaved=True),
}


@pytest.mark.parametrize("name", COMPILE_VARIANTS)
def test_compiles_for_hopper(compile_reports, name):
    # an elementwise kernel: spilling would add local-memory traffic to a memory-bound op
    report = assert_compiled_for_hopper(compile_reports[name], name)
    assert report.registers is None or report.registers <= 64, f"{name}: {report.registers} registers"
    # q/k move in 16-byte vectors, and the interleaved pair split stays in registers
    assert "ld.global.v4.b32" in report.ptx and "st.global.v4.b32" in report.ptx, f"{name}: no 128-bit accesses"
    assert report.shared_bytes == 0, f"{name}: {report.shared_bytes} B shared"


# -- frequencies ------------------------------------------------------------------------------

def test_plain_inv_freq_is_theta_to_the_minus_2i_over_r():
    inv_freq, scale = rope_inv_freq(96, 10000.0)
    expected = torch.tensor([10000.0 ** (-2 * i / 96) for i in range(48)], dtype=torch.float64)
    torch.testing.assert_close(inv_freq.double(), expected, rtol=1e-7, atol=0)
    assert scale == 1.0


def test_llama3_follows_the_per_frequency_rule():
    """Llama-3.1-8B: theta 500000, factor 8, low/high freq factors 1/4, original context 8192."""
    inv_freq, scale = rope_inv_freq(128, 500000.0, RopeScaling("llama3", 8.0, 8192, 1.0, 4.0))
    regimes = set()
    for i, got in enumerate(inv_freq.tolist()):
        f = 500000.0 ** (-2 * i / 128)
        wavelen = 2 * math.pi / f
        if wavelen < 8192 / 4:
            want, regime = f, "kept"
        elif wavelen > 8192 / 1:
            want, regime = f / 8, "divided"
        else:
            s = (8192 / wavelen - 1) / (4 - 1)
            want, regime = (1 - s) * f / 8 + s * f, "blended"
        regimes.add(regime)
        assert got == pytest.approx(want, rel=1e-6), f"pair {i} ({regime}): {got} != {want}"
    assert regimes == {"kept", "divided", "blended"}, "the test must cross all three regimes"
    assert scale == 1.0


def _hf_config(head_dim: int, theta: float, params: dict, model: str = "llama"):
    transformers = pytest.importorskip("transformers")
    factor = params.get("factor", 1.0)
    orig = params.get("original_max_position_embeddings", 4096)
    cls = transformers.GptOssConfig if model == "gpt_oss" else transformers.LlamaConfig
    # max_position_embeddings = factor * original keeps transformers' consistency warnings quiet
    return cls(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
               max_position_embeddings=int(factor * orig), rope_parameters={"rope_theta": theta, **params})


GPT_OSS_YARN = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}

# (head_dim, theta, transformers' rope_parameters, ours, model type)
HF_SCALINGS = {
    "llama3-llama3.1-8b": (128, 500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                           RopeScaling("llama3", 8.0, 8192, low_freq_factor=1.0, high_freq_factor=4.0), "llama"),
    "llama3-other-factors": (64, 10000.0, {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 0.5,
                                           "high_freq_factor": 8.0, "original_max_position_embeddings": 2048},
                             RopeScaling("llama3", 4.0, 2048, low_freq_factor=0.5, high_freq_factor=8.0), "llama"),
    "linear-gemma3": (256, 1e6, {"rope_type": "linear", "factor": 8.0}, RopeScaling("linear", 8.0), "llama"),
    "yarn-gpt-oss": (64, 150000.0, GPT_OSS_YARN,
                     RopeScaling("yarn", 32.0, 4096, beta_fast=32.0, beta_slow=1.0, truncate=False), "gpt_oss"),
    "yarn-qwen3-truncated": (128, 1e6, {"rope_type": "yarn", "factor": 4.0,
                                        "original_max_position_embeddings": 32768},
                             RopeScaling("yarn", 4.0, 32768), "llama"),
    "yarn-attention-factor": (128, 1e4, {"rope_type": "yarn", "factor": 16.0, "attention_factor": 0.8,
                                         "original_max_position_embeddings": 2048},
                              RopeScaling("yarn", 16.0, 2048, attention_factor=0.8), "llama"),
}


@pytest.mark.parametrize("name", HF_SCALINGS)
def test_scaling_matches_transformers(name):
    pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    head_dim, theta, params, ours, model = HF_SCALINGS[name]
    theirs, their_scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](_hf_config(head_dim, theta, params, model), "cpu")
    inv_freq, scale = rope_inv_freq(head_dim, theta, ours)
    # transformers computes theta ** (2i / R) in fp32, whose rounded exponent times ln(theta)
    # leaves relative errors of a few 1e-6; ours is computed in fp64 and rounded once
    torch.testing.assert_close(inv_freq, theirs.float(), rtol=1e-5, atol=0)
    assert scale == pytest.approx(their_scale, rel=1e-12)


def test_partial_rotary_yarn_matches_transformers():
    """partial_rotary_factor 0.5: the frequencies of the 64 rotated dims of a 128-wide head."""
    pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
              "partial_rotary_factor": 0.5}
    theirs, their_scale = ROPE_INIT_FUNCTIONS["yarn"](_hf_config(128, 10000.0, params), "cpu")
    inv_freq, scale = rope_inv_freq(64, 10000.0, RopeScaling("yarn", 4.0, 4096))
    torch.testing.assert_close(inv_freq, theirs.float(), rtol=1e-5, atol=0)
    assert scale == pytest.approx(their_scale, rel=1e-12)


def test_gpt_oss_yarn_needs_truncate_false():
    """The gpt-oss ramp bounds are fractional: rounding them (truncate=True) changes the frequencies."""
    truncated, _ = rope_inv_freq(64, 150000.0, RopeScaling("yarn", 32.0, 4096, truncate=True))
    exact, scale = rope_inv_freq(64, 150000.0, RopeScaling("yarn", 32.0, 4096, truncate=False))
    # per frequency: the ramp's end moves, so pairs near it change by tens of percent
    assert ((truncated - exact).abs() / exact).max() > 0.1
    assert scale == pytest.approx(0.1 * math.log(32.0) + 1.0)  # 1.3466


def test_attention_factor_scales_the_tables():
    inv_freq, scale = rope_inv_freq(64, 150000.0, RopeScaling("yarn", 32.0, 4096, truncate=False))
    cos, sin = rope_cos_sin(torch.arange(0, 131072, 4099), inv_freq, scale)  # [T, 32]
    torch.testing.assert_close(cos**2 + sin**2, torch.full_like(cos, scale**2), rtol=1e-5, atol=0)
