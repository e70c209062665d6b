"""The Triton sampler (interpreter on CPU): greedy bit-exact, the kept set of every filter exactly the
reference's, draws distributed as the reference's filtered distribution (chi-square), reproducible per
(seed, step) and independent of the batch; and its compilation for Hopper.

Tokens are integers, so there is no tolerance: rows whose outcome is deterministic must match the
reference exactly, and sampled rows are compared in distribution. The interpreter runs a program per
row in Python (~20-50 ms each), so the statistical tests use a few hundred draws and small blocks.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from qml_kernels import registry
from qml_kernels.sampling import (
    LOG2E,
    SampleConfig,
    _sample_kernel,
    filter_logits_ref,
    sample,
    sample_ref,
    sample_triton,
)
from qml_kernels.workbench.compile import compile_checks
from qml_kernels.workbench.spec import spec_for

SPEC = spec_for("sample")
# tokens compare exactly whatever the logits dtype (the reference sees them upcast to fp32)
TOLERANCES = {torch.float32: 0, torch.float16: 0}

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# the interpreter computes bf16 wrongly without an error: bf16 is checked on the GPU only
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
SMALL = SampleConfig(block_v=16)  # several blocks even for tiny vocabularies: exercises the block race

# chi-square critical values at p = 1e-4 (a correct sampler fails about once in 10,000 runs)
CHI2_CRIT = {1: 15.14, 2: 18.42, 3: 21.11, 4: 23.51, 5: 25.74, 6: 27.86, 7: 29.88}


def _seeded() -> tuple[int, torch.Generator]:
    seed = int(os.environ.get("QML_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    return seed, torch.Generator(DEVICE).manual_seed(seed)


def _params(n: int, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> dict:
    def full(value, dtype):
        return torch.full((n,), value, dtype=dtype, device=DEVICE)

    return {"temperature": full(temperature, torch.float32), "top_k": full(top_k, torch.int64),
            "top_p": full(top_p, torch.float32), "min_p": full(min_p, torch.float32)}


def _kept_by_kernel(logits: torch.Tensor, temperature: torch.Tensor, cutoff: torch.Tensor) -> torch.Tensor:
    """The kernel's kept set from its cut, with its own fp32 arithmetic: d = (x - max) * log2(e) / T."""
    x = logits.float()
    scale = (torch.tensor(LOG2E, dtype=torch.float32, device=x.device) / temperature).clamp(max=1e30)
    return (x - x.amax(-1, keepdim=True)) * scale[:, None] >= cutoff[:, None]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", SPEC.cases, ids=lambda c: c.name)
def test_deterministic_rows_match_reference(case, dtype):
    """Greedy rows, and sampled rows whose filters leave one token (see the spec's make_inputs)."""
    seed, gen = _seeded()
    inputs = SPEC.make_inputs(case, dtype, DEVICE, gen)
    out = torch.full((case.dims["B"],), -1, dtype=torch.int64, device=DEVICE)
    assert sample_triton(**inputs, out=out) is out
    expected = sample_ref(**dict(inputs, logits=inputs["logits"].float()))
    assert torch.equal(out, expected), f"{case.name} ({case.edge}) {dtype} seed={seed}: {out} != {expected}"


@pytest.mark.parametrize("config", [SampleConfig(), SampleConfig(block_v=64)], ids=["one-block", "blocks-of-64"])
def test_greedy_is_bit_exact_argmax_with_ties(config):
    seed, gen = _seeded()
    logits = torch.randint(-3, 4, (6, 300), generator=gen, device=DEVICE).to(torch.float16)  # many ties
    logits[1, 64:] = 3  # the max first reached at a block boundary
    logits[2, :] = float("-inf")
    logits[2, 150] = -1  # one finite token among -inf
    logits[3, :] = -2  # all equal: token 0
    temperature = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.8, 0.0], device=DEVICE)
    params = dict(_params(6), temperature=temperature)
    got = sample_triton(logits, **params, seeds=torch.arange(6, device=DEVICE),
                        steps=torch.zeros(6, dtype=torch.int64, device=DEVICE), config=config)
    greedy = temperature == 0
    assert torch.equal(got[greedy], logits.float()[greedy].argmax(-1)), f"seed={seed}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("config", [SampleConfig(), SampleConfig(block_v=128)], ids=["one-block", "blocks-of-128"])
def test_kept_set_is_exactly_the_references(dtype, config):
    """Every filter and their combinations: the kernel's cut keeps exactly the reference's tokens."""
    seed, gen = _seeded()
    B, V = 24, 700
    # distinct values (ties at a cut are kept whole by the kernel, arbitrarily split by the reference)
    values = _distinct_values(V, dtype)
    logits = torch.stack([values[torch.randperm(V, generator=gen, device=DEVICE)] for _ in range(B)])

    def pick(options: list) -> torch.Tensor:
        return torch.tensor(options, device=DEVICE)[torch.randint(0, len(options), (B,), generator=gen, device=DEVICE)]

    temperature = 0.2 + 1.8 * torch.rand(B, generator=gen, device=DEVICE)
    top_k = pick([0, 0, 1, 2, 10, 100, 699, 700, 5000])
    top_p = pick([1.0, 1.0, 0.2, 0.5, 0.9, 0.99])
    min_p = pick([0.0, 0.0, 0.01, 0.2])
    cutoff = torch.full((B,), float("nan"), device=DEVICE)
    tokens = sample_triton(logits, temperature, top_k, top_p, min_p, torch.arange(B, device=DEVICE),
                           torch.zeros(B, dtype=torch.int64, device=DEVICE), cutoff=cutoff, config=config)
    kept = _kept_by_kernel(logits, temperature, cutoff)
    expected = torch.isfinite(filter_logits_ref(logits.float(), temperature, top_k, top_p, min_p))
    bad = (kept != expected).any(-1).nonzero().flatten().tolist()
    assert not bad, (f"{dtype} seed={seed}: rows {bad} keep {kept[bad].sum(-1).tolist()} tokens, the reference "
                     f"{expected[bad].sum(-1).tolist()} (top_k {top_k[bad].tolist()}, top_p {top_p[bad].tolist()}, "
                     f"min_p {min_p[bad].tolist()})")
    assert kept[torch.arange(B), tokens].all(), f"seed={seed}: a token outside the kept set was drawn"


def _distinct_values(V: int, dtype: torch.dtype) -> torch.Tensor:
    """V distinct values of ``dtype`` in [-8, 8]: an even grid, or, where the dtype rounds the grid's points
    together (bf16 keeps 8 significant bits: 700 points 0.023 apart meet in steps of 0.0625 near 8), an even
    pick from the distinct values it has there."""
    values = torch.linspace(-8, 8, V, device=DEVICE).to(dtype)
    if values.unique().numel() < V:
        have = torch.linspace(-8, 8, 64 * V, device=DEVICE).to(dtype).unique()  # sorted
        values = have[torch.linspace(0, have.numel() - 1, V, device=DEVICE).round().long()]
    assert values.unique().numel() == V, f"{dtype}: no {V} distinct values in [-8, 8]"
    return values


def test_distinct_values_are_distinct_in_every_dtype():
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert _distinct_values(700, dtype).unique().numel() == 700
    assert torch.linspace(-8, 8, 700).to(torch.bfloat16).unique().numel() < 700  # why bf16 needs the pick


def test_ties_at_the_top_k_cut_are_kept_whole():
    logits = torch.tensor([[5.0, 3.0, 4.0, 3.0, 1.0, 3.0, 0.0]], device=DEVICE)
    cutoff = torch.empty(1, device=DEVICE)
    sample_triton(logits, **_params(1, top_k=3), seeds=torch.zeros(1, dtype=torch.int64, device=DEVICE),
                  steps=torch.zeros(1, dtype=torch.int64, device=DEVICE), cutoff=cutoff)
    kept = _kept_by_kernel(logits, torch.ones(1, device=DEVICE), cutoff)
    assert kept[0].nonzero().flatten().tolist() == [0, 1, 2, 3, 5]


# 8 tokens spread over 4 blocks of 16; the other 56 are -inf (a masked vocabulary)
SPREAD = [3, 9, 20, 30, 37, 45, 50, 63]
PEAKED = [0.4, 0.2, 0.15, 0.1, 0.05, 0.05, 0.03, 0.02]
FLAT = [0.2, 0.18, 0.15, 0.13, 0.11, 0.09, 0.08, 0.06]
ONE_BLOCK = SampleConfig(block_v=64)  # the searches' passes are slow in the interpreter: keep them to one block


@pytest.mark.parametrize("probs, kw, n, config", [
    # no filter: every token, -inf ones too, passes the cut d >= -inf; the race runs over 4 blocks.
    # T = 0.5 squares the probabilities: a sampler ignoring T would score chi2 ~ 55 here
    (FLAT, {"temperature": 0.5}, 400, SMALL),
    # top-k keeps 4, top-p (on the renormalised 4) drops the 4th, min-p does not bind
    (PEAKED, {"top_k": 4, "top_p": 0.8, "min_p": 0.3}, 300, ONE_BLOCK),
    # at T = 1.5 top-p keeps 6, min-p only 4
    (PEAKED, {"temperature": 1.5, "top_p": 0.9, "min_p": 0.3}, 300, ONE_BLOCK),
], ids=["temperature", "top_k-top_p", "hot-top_p-min_p"])
def test_draws_follow_the_filtered_distribution(probs, kw, n, config):
    """Draws of one request over n steps against the reference's filtered distribution (chi-square; tokens
    the reference filters out must never be drawn). Exactness of the kept sets themselves is tested above."""
    logits = torch.full((n, 64), float("-inf"), device=DEVICE)
    logits[:, SPREAD] = torch.tensor(probs, device=DEVICE).log()
    params = _params(n, **kw)
    seed = int.from_bytes(os.urandom(7), "little")
    tokens = sample_triton(logits, **params, seeds=torch.full((n,), seed, device=DEVICE),
                           steps=torch.arange(n, device=DEVICE), config=config)
    expected = filter_logits_ref(logits[:1], *(p[:1] for p in params.values()))[0].exp().double()  # [64]
    counts = torch.bincount(tokens, minlength=64).double()
    support = expected > 0
    assert (counts[~support] == 0).all(), f"seed={seed}: drew filtered-out tokens {counts.nonzero().flatten()}"
    stat = ((counts[support] - n * expected[support]) ** 2 / (n * expected[support])).sum().item()
    df = int(support.sum()) - 1
    assert stat < CHI2_CRIT[df], f"seed={seed}: chi2 {stat:.1f} with {df} dof, counts {counts[support].tolist()}"


def _batch(gen: torch.Generator, B: int, V: int) -> dict:
    return {"logits": torch.randn(B, V, generator=gen, device=DEVICE),
            "temperature": 1.0 + torch.rand(B, generator=gen, device=DEVICE),
            "top_k": torch.randint(0, 200, (B,), generator=gen, device=DEVICE),
            "top_p": 0.8 + 0.2 * torch.rand(B, generator=gen, device=DEVICE),
            "min_p": torch.zeros(B, device=DEVICE),
            "seeds": torch.randint(0, 2**62, (B,), generator=gen, device=DEVICE),
            "steps": torch.randint(0, 1000, (B,), generator=gen, device=DEVICE)}


def test_a_row_draws_the_same_token_whatever_the_batch():
    seed, gen = _seeded()
    config = SampleConfig(block_v=64)
    batch = _batch(gen, 5, 300)
    first = sample_triton(**batch, config=config)
    assert torch.equal(first, sample_triton(**batch, config=config)), f"seed={seed}: not reproducible"
    alone = sample_triton(**{k: v[2:3] for k, v in batch.items()}, config=config)
    assert alone.item() == first[2].item(), f"seed={seed}: row 2 alone drew another token"
    # other rows replaced, the batch reordered and grown: row 2 (now row 4 of 7) is unchanged
    others = _batch(gen, 7, 300)
    mixed = {k: torch.cat([others[k][:4], batch[k][2:3], others[k][4:]]) for k in batch}
    assert sample_triton(**mixed, config=config)[4].item() == first[2].item(), f"seed={seed}"


def test_seed_and_step_both_change_the_draw():
    n = 32
    logits = torch.zeros(n, 1000, device=DEVICE)  # uniform: draws rarely repeat
    by_step = sample_triton(logits, **_params(n), seeds=torch.full((n,), 7, device=DEVICE),
                            steps=torch.arange(n, device=DEVICE))
    by_seed = sample_triton(logits, **_params(n), seeds=torch.arange(n, device=DEVICE),
                            steps=torch.full((n,), 7, device=DEVICE))
    assert by_step.unique().numel() > n // 2 and by_seed.unique().numel() > n // 2


def test_the_public_function_dispatches_to_triton():
    """What the engine calls (``sample``) runs the kernel when triton is selected."""
    seed, gen = _seeded()
    inputs = SPEC.make_inputs(SPEC.cases[2], torch.float32, DEVICE, gen)
    with registry.using("triton"):
        assert registry.select("sample", *inputs.values()).name == "triton"
        got = sample(*inputs.values())
    assert torch.equal(got, sample_ref(**inputs)), f"seed={seed}"


def test_launcher_rejects_bad_arguments():
    logits, p = torch.randn(2, 10, device=DEVICE), _params(2)
    ids = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(AssertionError, match="seeds must be"):
        sample_triton(logits, **p, seeds=ids.int(), steps=ids)
    with pytest.raises(AssertionError, match="top_p must be a contiguous"):
        sample_triton(logits, **dict(p, top_p=p["top_p"][:1]), seeds=ids, steps=ids)
    with pytest.raises(AssertionError, match="contiguous"):
        sample_triton(torch.randn(10, 2, device=DEVICE).t(), **p, seeds=ids, steps=ids)


# -- compilation for the H200 (sm_90a) -------------------------------------------------------

_SIGNATURE = {
    "logits_ptr": "*fp32", "stride_b": "i32", "V": "i32", "temperature_ptr": "*fp32", "top_k_ptr": "*i64",
    "top_p_ptr": "*fp32", "min_p_ptr": "*fp32", "seeds_ptr": "*i64", "steps_ptr": "*i64", "out_ptr": "*i64",
    "cutoff_ptr": "*i64",
    "BLOCK": "constexpr", "NUM_BLOCKS": "constexpr", "SEARCH_STEPS": "constexpr", "WRITE_CUTOFF": "constexpr",
}


def _variant(V: int, logits: str) -> dict:
    """The kernel exactly as the launcher specialises it for a vocabulary of V (the engine passes fp32)."""
    config = SampleConfig()
    blocks = 1 << (-(-V // config.block_v) - 1).bit_length()
    constexprs = {"BLOCK": config.block_v, "NUM_BLOCKS": blocks, "SEARCH_STEPS": config.search_steps,
                  "WRITE_CUTOFF": False}
    return {"signature": dict(_SIGNATURE, logits_ptr=logits), "constexprs": constexprs,
            "num_warps": config.num_warps, "num_stages": config.num_stages}


COMPILE_VARIANTS = {
    "llama3-fp32": _variant(128256, "*fp32"),
    "qwen3-bf16": _variant(151936, "*bf16"),
    "gemma3-bf16": _variant(262144, "*bf16"),
}


@pytest.fixture(scope="module")
def compile_reports() -> dict:
    requests = [dict(kernel=_sample_kernel, **variant) for variant in COMPILE_VARIANTS.values()]
    return dict(zip(COMPILE_VARIANTS, (dataclasses.asdict(r) for r in compile_checks(requests))))


@pytest.mark.parametrize("name", COMPILE_VARIANTS)
def test_compiles_for_hopper(compile_reports, name):
    report = compile_reports[name]
    assert report["ok"], report["error"]
    assert ".target sm_90a" in report["ptx"]
    assert report["spills"] in (0, None), f"{name}: {report['spills']} spill bytes"
    assert report["registers"] is None or report["registers"] <= 168, f"{name}: {report['registers']} registers"
