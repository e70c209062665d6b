"""Sampling the next token from a batch of logits, with per-row parameters and a seeded per-row stream.

Order of the filters (as vLLM and llama.cpp apply them): temperature, then top-k,
top-p (nucleus) and min-p on the tempered distribution, then a draw; the most likely
token always survives. A row with temperature 0 is greedy: the argmax of the raw
logits, ties to the lowest index (as ``torch.argmax``). Randomness is counter-based:
a row's draw depends only on its request ``seed``, its ``step`` (tokens generated so
far) and its own logits and parameters, so a request is reproducible whatever it is
batched with. Reference and kernel use different generators (torch's seeded by
``stream_seed(seed, step)``; Philox in the kernel): each is reproducible and has the
right distribution, they do not draw the same tokens.

The Triton kernel runs one program per row and never sorts. Each pass reads the row
(B*V*bytes from HBM for the first, mostly L2 hits after); FLOPs are negligible. A pass
keeps its running values per lane (a max and its index, a min, a count or mass) and
reduces across the lanes once, after its loop: with a reduction in every block step, each
of the 37 steps of a 152K-token row waited on shared-memory barriers. On the H200 (151,936
tokens, batch 1, benchmarks/sampler_h200.py) that took a greedy row 28.6 -> 13.7 us and a
sampled one (top-k 50, top-p 0.9) 478 -> 246 us, tokens unchanged; the Qwen3-30B-A3B decode
step 3.117 -> 3.093 ms (results/serve-h200-qwen3-30b-a3b-2026-12-04.md).
1. max, argmax and min of the raw logits. Greedy rows stop here.
2. In ``d = (x - max) * log2(e) / T`` (log2 of each token's probability relative to
   the most likely one) every filter is a cut ``keep d >= tau``, so the kernel looks
   for ``tau``. min-p: ``tau = log2(min_p)``. top-k and top-p: bisection on the value
   of the cut; a pass counts the tokens (or sums their mass ``2^d``) at or above a
   trial cut and also returns the nearest token values on either side of it, so the
   bracket snaps to token values and stops once it holds a single value. The cut is
   then exactly the k-th largest value (top-k), or exactly the value of the nucleus's
   last token (top-p, whose target is top_p times the mass of the top-k set, one
   more pass), up to fp32 rounding of masses summed per lane, then in a tree
   (relative ~1e-6, as the reference's fp32 cumsum). Ties at a cut are kept whole (the reference, by
   sorting, keeps an arbitrary subset). Each step halves the bracket, so a search
   takes about log2(range / spacing of the values near the cut) passes: typically
   8-12 for logits from a bf16 matmul, up to ~20 for arbitrary fp32. ``search_steps``
   caps it; a capped search keeps a superset (the values left in its bracket).
3. The draw is an exponential race (argmax of d - log2 E, E ~ Exp(1)) in two levels:
   over blocks weighted by their kept mass, then over the kept tokens of the winning
   block. That is exact in distribution and needs V / BLOCK + BLOCK random numbers
   instead of V: a Philox number costs ~100 integer instructions, so one per token
   of a 262144-token row would make the draw compute-bound on its SM. Counters
   (index, step, 0 for tokens / 1 for blocks, 0), key = seed; the draws therefore
   also depend on ``block_v``, which the engine keeps fixed.
Sources: the exponential-race (Gumbel-max) trick; sorting-free filtering in the
spirit of FlashInfer's sampling kernels (which use pivots and rejection; the
bisection on the cut here is written from the filters' definitions).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from qml_kernels import pdl
from qml_kernels.registry import dispatch, register
from qml_kernels.workbench.spec import Case, OpSpec, register_spec

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class SampleConfig:
    block_v: int = 4096  # tokens per block; the draw's second race runs over one block
    num_warps: int = 8
    num_stages: int = 3
    search_steps: int = 32  # cap on the passes of each bisection (top-k, top-p)


@triton.jit
def _exp_draw(seed, index, step, STREAM: tl.constexpr):
    """Exp(1) variates for Philox counters (index, step, STREAM, 0) under key ``seed``."""
    c0 = index.to(tl.uint32)
    zero = c0 * 0
    bits, _, _, _ = tl.philox(seed, c0, zero + step.to(tl.uint32), zero + STREAM, zero)
    # u in (0, 1]. E = -log1p(-u), through Goldberg's correction log(w) * u / (1 - w) with w = fl(1 - u):
    # the small E that win races come from small u, exact in fp32; E = -log(u) would take them from u
    # near 1, where fp32 rounds u to 1 and E to 0 (a certain win) for ~1 token in 3e7
    u = (bits.to(tl.float32) + 0.5) * 2.3283064365386963e-10
    one_minus = 1.0 - u
    safe = tl.where(one_minus < 1.0, one_minus, 0.5)
    return tl.where(one_minus < 1.0, -tl.log(safe) * (u / (1.0 - safe)), u)


@triton.jit
def _pass_at(base, V, x_max, scale, t, BLOCK: tl.constexpr, MASS: tl.constexpr):
    """Count (or mass 2^d) of the tokens with d >= t, and the nearest token values below and at/above t.
    Accumulated per lane and reduced across the lanes once, after the loop (as pass 1)."""
    cols = tl.arange(0, BLOCK)
    f = tl.zeros([BLOCK], tl.float32)
    below = tl.full([BLOCK], -float("inf"), tl.float32)
    above = tl.full([BLOCK], float("inf"), tl.float32)
    for start in range(0, V, BLOCK):
        idx = start + cols
        d = (tl.load(base + idx, mask=idx < V, other=-float("inf")).to(tl.float32) - x_max) * scale  # [BLOCK]
        ge = d >= t
        if MASS:
            f += tl.where(ge, tl.exp2(d), 0.0)
        else:
            f += ge.to(tl.float32)
        below = tl.maximum(below, tl.where(ge, -float("inf"), d))
        above = tl.minimum(above, tl.where(ge, d, float("inf")))
    return tl.sum(f, axis=0), tl.max(below, axis=0), tl.min(above, axis=0)


@triton.jit
def _largest_cut(base, V, x_max, scale, lo, target, BLOCK: tl.constexpr, MASS: tl.constexpr,
                 SEARCH_STEPS: tl.constexpr):
    """The largest token value c in [lo, 0] with f(c) >= target, given f(lo) >= target (0 is the max's value)."""
    ub = tl.zeros_like(lo)  # a token value >= the cut
    n = tl.zeros_like(lo).to(tl.int32)
    while (lo < ub) & (n < SEARCH_STEPS):
        t = lo + (ub - lo) * 0.5
        t = tl.where(t > lo, t, ub)
        f, below, above = _pass_at(base, V, x_max, scale, t, BLOCK, MASS)
        hit = f >= target
        lo = tl.where(hit, above, lo)  # no token lies in [t, above): f(above) = f(t)
        ub = tl.where(hit, ub, below)  # the cut is a token value < t
        n += 1
    return lo


@triton.jit
def _sample_kernel(logits_ptr, stride_b, V, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seeds_ptr, steps_ptr,
                   out_ptr, cutoff_ptr, BLOCK: tl.constexpr, NUM_BLOCKS: tl.constexpr, SEARCH_STEPS: tl.constexpr,
                   WRITE_CUTOFF: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride_b
    cols = tl.arange(0, BLOCK)
    # pass 1 keeps a running max, its index and a running min per lane, and reduces across the lanes once
    # after the loop: a reduction in every step (three, each through shared memory and barriers) made the
    # loop wait on itself 37 times for a 152K vocabulary, ~30 us of a batch-1 decode step on the H200
    lane_max = tl.full([BLOCK], -float("inf"), tl.float32)
    lane_arg = tl.zeros([BLOCK], tl.int32)
    lane_min = tl.full([BLOCK], float("inf"), tl.float32)
    for start in range(0, V, BLOCK):
        idx = start + cols
        x = tl.load(base + idx, mask=idx < V, other=-float("inf")).to(tl.float32)  # [BLOCK]
        better = x > lane_max  # strict: a lane keeps the first index of its max (ties: lowest index)
        lane_arg = tl.where(better, idx, lane_arg)
        lane_max = tl.where(better, x, lane_max)
        lane_min = tl.minimum(lane_min, tl.where(x > -float("inf"), x, float("inf")))
    x_max = tl.max(lane_max, axis=0)
    # the lowest index among the lanes holding the max (all lanes when every logit is -inf: index 0)
    arg = tl.min(tl.where(lane_max == x_max, lane_arg, V), axis=0)
    x_min = tl.min(lane_min, axis=0)

    token = arg
    tau = 0.0
    temperature = tl.load(temperature_ptr + row).to(tl.float32)
    if temperature > 0:
        # div_rn: `/` compiles to an approximate division (2 ulp), and the cut must agree with torch's d
        # to the last bit; the minimum keeps an underflowing T from giving 0 * inf
        scale = tl.minimum(tl.math.div_rn(tl.full((), 1.4426950408889634, tl.float32), temperature), 1e30)
        top_k = tl.load(top_k_ptr + row)
        top_p = tl.load(top_p_ptr + row).to(tl.float32)
        min_p = tl.load(min_p_ptr + row).to(tl.float32)
        tau = tl.where(min_p > 0, tl.log2(tl.maximum(min_p, 1e-30)), -float("inf"))
        tau_k = -float("inf")
        if (top_k > 0) & (top_k < V):
            lo = tl.where(top_k == 1, 0.0, (x_min - x_max) * scale)
            tau_k = _largest_cut(base, V, x_max, scale, lo, top_k.to(tl.float32), BLOCK, False, SEARCH_STEPS)
        tau = tl.maximum(tau, tau_k)
        if top_p < 1.0:
            mass_k, _, _ = _pass_at(base, V, x_max, scale, tau_k, BLOCK, True)
            # tokens lighter than (1 - p) * mass / V hold less than (1 - p) * mass together: the cut is above
            floor = tl.log2((1.0 - top_p) * mass_k / V)
            tau = _largest_cut(base, V, x_max, scale, tl.maximum(tau, floor), top_p * mass_k, BLOCK, True,
                               SEARCH_STEPS)

        # race over blocks, weighted by their kept mass, then over the kept tokens of the winner
        seed = tl.load(seeds_ptr + row)
        step = tl.load(steps_ptr + row)
        blocks = tl.arange(0, NUM_BLOCKS)
        block_mass = tl.zeros([NUM_BLOCKS], dtype=tl.float32)
        for start in range(0, V, BLOCK):
            idx = start + cols
            d = (tl.load(base + idx, mask=idx < V, other=-float("inf")).to(tl.float32) - x_max) * scale  # [BLOCK]
            mass = tl.sum(tl.where(d >= tau, tl.exp2(d), 0.0), axis=0)
            block_mass = tl.where(blocks == start // BLOCK, mass, block_mass)
        block_score = tl.where(block_mass > 0, tl.log2(tl.maximum(block_mass, 1e-38)), -float("inf"))
        block = tl.argmax(block_score - tl.log2(_exp_draw(seed, blocks, step, 1)), axis=0)
        idx = block * BLOCK + cols
        d = (tl.load(base + idx, mask=idx < V, other=-float("inf")).to(tl.float32) - x_max) * scale  # [BLOCK]
        score = tl.where(d >= tau, d - tl.log2(_exp_draw(seed, idx, step, 0)), -float("inf"))
        best, j = tl.max(score, axis=0, return_indices=True)
        token = tl.where(best > -float("inf"), block * BLOCK + j, arg)
    tl.store(out_ptr + row, token.to(tl.int64))
    if WRITE_CUTOFF:
        tl.store(cutoff_ptr + row, tau)


def sample_triton(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor, out: torch.Tensor | None = None,
                  cutoff: torch.Tensor | None = None, config: SampleConfig = SampleConfig()) -> torch.Tensor:
    """Same as ``sample_ref``; ``cutoff`` (fp32 [B], optional) receives each row's cut ``tau``: the kept
    tokens are those with ``(x - max) * log2(e) / T >= tau`` (0 on greedy rows: the argmax alone)."""
    assert logits.dim() == 2, f"logits must be [B, V], got {tuple(logits.shape)}"
    B, V = logits.shape
    assert logits.dtype in (torch.float32, torch.float16, torch.bfloat16), f"logits dtype {logits.dtype}"
    assert logits.stride(1) == 1 or V == 1, "logits rows must be contiguous"
    assert 0 < V < 2**24, f"vocabulary of {V} tokens: counts are fp32 sums, exact below 2^24"
    fp32, ints, int64 = (torch.float32,), (torch.int32, torch.int64), (torch.int64,)
    for name, t, dtypes in (("temperature", temperature, fp32), ("top_k", top_k, ints), ("top_p", top_p, fp32),
                            ("min_p", min_p, fp32), ("seeds", seeds, int64), ("steps", steps, int64)):
        assert t.shape == (B,) and t.is_contiguous(), f"{name} must be a contiguous [B] = [{B}], got {tuple(t.shape)}"
        assert t.dtype in dtypes, f"{name} must be {' or '.join(map(str, dtypes))}, got {t.dtype}"
        assert t.device == logits.device, f"{name} is on {t.device}, logits on {logits.device}"
    if out is None:
        out = torch.empty(B, dtype=torch.int64, device=logits.device)
    assert out.shape == (B,) and out.dtype == torch.int64 and out.device == logits.device, "out must be int64 [B]"
    if cutoff is not None:
        assert cutoff.shape == (B,) and cutoff.dtype == torch.float32, "cutoff must be fp32 [B]"
    if B == 0:
        return out
    _sample_kernel[(B,)](
        logits, logits.stride(0), V, temperature, top_k, top_p, min_p, seeds, steps, out,
        cutoff if cutoff is not None else out,
        BLOCK=config.block_v, NUM_BLOCKS=triton.next_power_of_2(triton.cdiv(V, config.block_v)),
        SEARCH_STEPS=config.search_steps, WRITE_CUTOFF=cutoff is not None,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl.launch_args(logits),
    )
    return out


def filter_logits_ref(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                      top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """logits: [B, V]; per-row temperature (>0), top_k (0 = off), top_p, min_p: [B] -> log-probs [B, V].

    Tokens removed by a filter get -inf.
    """
    x = logits.float() / temperature.float()[:, None]  # [B, V]
    V = x.shape[-1]
    sorted_x, order = x.sort(dim=-1, descending=True)  # [B, V]
    rank = torch.arange(V, device=x.device)[None, :]  # [1, V]
    k = torch.where(top_k > 0, top_k, V).clamp(max=V)[:, None]  # [B, 1]
    drop = rank >= k
    probs = torch.softmax(sorted_x.masked_fill(drop, float("-inf")), dim=-1)  # [B, V]
    # keep the smallest prefix whose mass reaches top_p: a token goes if the mass before it already does
    mass_before = probs.cumsum(dim=-1) - probs
    # top_p = 1 is off: the fp32 cumsum can reach 1.0 before the tail, which would drop it
    drop |= (mass_before >= top_p.float()[:, None]) & (top_p < 1)[:, None]
    drop |= probs < min_p.float()[:, None] * probs[:, :1]
    drop[:, 0] = False  # the most likely token always survives
    filtered = sorted_x.masked_fill(drop, float("-inf"))
    out = torch.empty_like(filtered).scatter_(1, order, filtered)
    return torch.log_softmax(out, dim=-1)


def stream_seed(seed: int, step: int) -> int:
    """The reference's generator seed for (request seed, step): SplitMix64 of both, so that neighbouring
    seeds and steps give unrelated streams."""
    mask = (1 << 64) - 1

    def mix(z: int) -> int:
        z = (z + 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    return mix((mix(seed & mask) + step) & mask)


def sample_ref(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
               min_p: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """logits: [B, V]; temperature, top_p, min_p fp32 [B]; top_k int [B] (0 = off); seeds, steps int64 [B]
    -> token ids int64 [B]. Rows with temperature 0 are greedy; the others draw from a generator seeded
    by ``stream_seed(seed, step)``."""
    greedy = temperature <= 0
    tokens = logits.argmax(dim=-1)  # [B]
    rows = (~greedy).nonzero().flatten().tolist()
    if rows:
        logp = filter_logits_ref(logits[rows], temperature[rows], top_k[rows], top_p[rows], min_p[rows])
        seed_list, step_list = seeds.tolist(), steps.tolist()
        for j, row in enumerate(rows):
            gen = torch.Generator(device=logits.device).manual_seed(stream_seed(seed_list[row], step_list[row]))
            # Gumbel-max through exponential races: argmax p_i / E_i with E_i ~ Exp(1) draws token i with
            # probability p_i. exponential_ can return 0, which would score a filtered token -inf + inf = NaN
            race = torch.empty_like(logp[j]).exponential_(generator=gen).clamp_min(torch.finfo(torch.float32).tiny)
            tokens[row] = (logp[j] - race.log()).argmax()
    return tokens


def _triton_supports(logits, temperature, top_k, top_p, min_p, seeds, steps, **kwargs) -> bool:
    return (logits.dim() == 2 and logits.dtype in (torch.float32, torch.float16, torch.bfloat16)
            and (logits.stride(1) == 1 or logits.shape[1] == 1) and 0 < logits.shape[1] < 2**24
            and all(t.dtype == torch.float32 for t in (temperature, top_p, min_p))
            and top_k.dtype in (torch.int32, torch.int64) and seeds.dtype == steps.dtype == torch.int64)


register("sample", "reference", sample_ref)
register("sample", "triton", sample_triton, devices=("cuda",), supports=_triton_supports)
sample = dispatch("sample")


def _make_inputs(case: Case, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> dict:
    """Rows whose outcome is deterministic, so tokens compare exactly: greedy rows, and sampled rows whose
    filters leave only the argmax (top_k=1; top_p=1e-6 after top_k=50; min_p=1 after top_p=0.9). The max
    is made unique, since ties would leave a choice."""
    B, V = case.dims["B"], case.dims["V"]
    logits = (torch.randn(B, V, generator=gen, device=device) * 4).to(dtype)  # [B, V]
    if case.dims.get("masked"):
        logits[:, 1::3] = float("-inf")  # a vocabulary padded or masked with -inf
    rows = torch.arange(B, device=device)
    logits[rows, logits.float().argmax(-1)] = logits.float().amax(-1).add(1.0).to(dtype)
    kind = rows % 4
    temperature = torch.where(kind == 0, 0.0, 0.5 + torch.rand(B, generator=gen, device=device))
    top_k = torch.where(kind == 1, 1, torch.where(kind == 2, 50, 0))
    top_p = torch.where(kind == 2, 1e-6, torch.where(kind == 3, 0.9, 1.0)).float()
    min_p = torch.where(kind == 3, 1.0, 0.0).float()
    seeds = torch.randint(0, 2**62, (B,), generator=gen, device=device)
    steps = torch.randint(0, 4096, (B,), generator=gen, device=device)
    return {"logits": logits, "temperature": temperature.float(), "top_k": top_k, "top_p": top_p, "min_p": min_p,
            "seeds": seeds, "steps": steps}


def _bytes_moved(inputs: dict) -> int:
    B, V = inputs["logits"].shape
    # one compulsory read of the logits (the search passes re-read rows, mostly from L2), the
    # parameters (temperature, top_p, min_p fp32; top_k, seed, step int64) and the int64 tokens
    return B * V * inputs["logits"].element_size() + B * (3 * 4 + 3 * 8) + B * 8


register_spec(OpSpec(
    op="sample",
    reference=sample_ref,
    make_inputs=_make_inputs,
    cases=(
        Case("one-token-vocab", {"B": 4, "V": 1}, edge="V = 1: every row can only pick token 0"),
        Case("one-row", {"B": 1, "V": 300}, edge="a single row, one partial block"),
        Case("odd-vocab", {"B": 8, "V": 1000}, edge="non-power-of-2 vocabulary, all four row kinds twice"),
        Case("two-blocks", {"B": 5, "V": 5000}, edge="a row longer than one block, partial last block"),
        Case("masked", {"B": 4, "V": 777, "masked": True}, edge="a third of the vocabulary at -inf"),
    ),
    model_cases=(
        Case("llama3-decode", {"B": 1, "V": 128256}),
        Case("llama3-batch", {"B": 128, "V": 128256}),
        Case("qwen3-decode", {"B": 1, "V": 151936}),
        Case("qwen3-batch", {"B": 128, "V": 151936}),
        Case("gemma3-decode", {"B": 1, "V": 262144}),
        Case("gemma3-batch", {"B": 64, "V": 262144}),
    ),
    bytes_moved=_bytes_moved,
    exact=True,
    out_arg="out",
    launch_config=SampleConfig,
    notes="Tokens compare exactly on the deterministic rows make_inputs draws; the sampled distribution "
          "is checked statistically in tests/test_sampling_triton.py. Time depends on the filters: "
          "plain and min-p rows read the row twice, top-k / top-p add one pass per bisection step.",
))
