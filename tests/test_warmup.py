"""The start-up warm-up: it runs the eager paths and times fresh prefills without leaving anything
behind (no pages held, nothing in the prefix cache), and hands the curve to the restore planner."""

from __future__ import annotations

from qml_runtime.config import CacheConfig, SchedulerConfig
from qml_runtime.engine import Engine
from qml_runtime.sampling_params import SamplingParams
from qml_runtime.warmup import warm_up

GREEDY = SamplingParams(max_tokens=12, temperature=0)


def fresh_engine(engine, tmp_path, **kw) -> Engine:
    cfg = CacheConfig(block_size=16, num_blocks=64, disk_dir=str(tmp_path), disk_bytes=2**30)
    return Engine(engine.model, engine.tokenizer, engine.model_config, model_id="warm", device=engine.device,
                  dtype=engine.dtype, cache=cfg, scheduler=SchedulerConfig(), fingerprint=b"w" * 32, **kw)


def test_warm_up_leaves_no_pages_and_no_cache_and_feeds_the_planner(engine, tmp_path):
    eng = fresh_engine(engine, tmp_path)
    free = eng.blocks.num_free
    curve = warm_up(eng, sizes=(48, 100, 37), chunk=40)
    assert [n for n, _ in curve] == [37, 48, 100]  # sorted, all timed
    assert all(s > 0 for _, s in curve)
    assert eng.blocks.num_free == free and eng.blocks.num_cached == 0
    assert eng.tiers.planner.prefill_curve == curve
    eng.tiers.close()


def test_sizes_that_do_not_fit_are_skipped(engine, tmp_path):
    eng = fresh_engine(engine, tmp_path)
    # 64 pages of 16 tokens: nothing near 1,000 tokens fits beside the chunk and a second prompt
    assert warm_up(eng, sizes=(1000, 2000), chunk=40) == []
    assert eng.tiers.planner.prefill_curve == []
    eng.tiers.close()


def test_an_engine_warmed_up_at_start_answers_as_one_that_was_not(engine, tmp_path, monkeypatch):
    import functools

    import qml_runtime.engine as engine_module

    monkeypatch.setattr(engine_module, "warm_up", functools.partial(warm_up, sizes=(40, 72), chunk=24))
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours."}])
    cold = engine.generate_sync(prompt, GREEDY)
    eng = fresh_engine(engine, tmp_path, warmup=True)
    eng.start()
    try:
        assert [n for n, _ in eng.tiers.planner.prefill_curve] == [40, 72]  # it ran, at start
        out = eng.generate_sync(prompt, GREEDY)
    finally:
        eng.shutdown()
    assert out.token_ids == cold.token_ids


def test_the_warm_up_is_off_on_cpu_by_default(engine, tmp_path):
    eng = fresh_engine(engine, tmp_path)
    assert eng.warmup is False
    eng.tiers.close()


def test_warm_up_with_one_size_then_serves(engine, tmp_path):
    eng = fresh_engine(engine, tmp_path)
    warm_up(eng, sizes=(40,), chunk=24)
    eng.start()
    try:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}])
        assert eng.generate_sync(prompt, GREEDY).token_ids == engine.generate_sync(prompt, GREEDY).token_ids
    finally:
        eng.shutdown()


def test_short_prompts_are_timed_too(engine, tmp_path):
    eng = fresh_engine(engine, tmp_path)
    curve = warm_up(eng, sizes=(100,), chunk=24, timed_short=(20, 50, 400))
    assert [n for n, _ in curve] == [20, 50, 100]  # those shorter than the compiled sizes
    eng.tiers.close()


def test_no_warm_up_step_is_larger_than_a_served_one(engine, tmp_path):
    """The default chunk (4,999 tokens, past the prefill graphs) is cut to what one step may take."""
    eng = Engine(engine.model, engine.tokenizer, engine.model_config, model_id="warm", device=engine.device,
                 dtype=engine.dtype, cache=CacheConfig(block_size=16, num_blocks=64),
                 scheduler=SchedulerConfig(max_batched_tokens=64), fingerprint=b"w" * 32)
    steps = []
    step = eng.runner.step
    eng.runner.step = lambda batch, **kw: (steps.append(sum(batch.num_tokens)), step(batch, **kw))[1]
    assert [n for n, _ in warm_up(eng, sizes=(40,))] == [40]
    assert steps and max(steps) <= 64, steps


def test_short_eager_chunks_run_over_the_longest_cached_context(engine, tmp_path):
    """A turn restored from host RAM runs without a graph over a long context: the warm-up runs that
    path (eager, both sides of 16) after the long chunk, so its kernels are loaded before a restore."""
    eng = fresh_engine(engine, tmp_path)
    steps = []
    step = eng.runner.step

    def spy(batch, eager=False):
        steps.append((list(batch.num_tokens), [s.num_computed for s in batch.seqs], eager))
        return step(batch, eager=eager)

    eng.runner.step = spy
    warm_up(eng, sizes=(100, 48), chunk=40, turns=(21, 32))
    eager = [(n, done) for n, done, e in steps if e]
    assert eager == [([21], [140]), ([32], [161])], steps  # over the 100-token prompt + its 40-token chunk
    assert eng.blocks.num_free == 64 and eng.blocks.num_cached == 0
    eng.tiers.close()


def test_every_dense_weight_shape_gets_a_gemm_at_every_row_count(monkeypatch):
    import torch

    from qml_kernels import linear as linear_module
    from qml_runtime import warmup

    model = torch.nn.Module()
    model.a = torch.nn.Parameter(torch.zeros(6, 4))
    model.b = torch.nn.Parameter(torch.zeros(6, 4))  # the same shape: once
    model.c = torch.nn.Parameter(torch.zeros(3, 5))
    model.wide = torch.nn.Parameter(torch.zeros(warmup.WIDE_N + 1, 2))  # an LM head: fewer rows
    model.norm = torch.nn.Parameter(torch.zeros(4))  # not a GEMM weight
    model.ids = torch.nn.Parameter(torch.zeros(2, 2, dtype=torch.int32), requires_grad=False)  # not floating
    calls = []
    monkeypatch.setattr(linear_module, "linear", lambda x, w: calls.append((x.shape[0], tuple(w.shape))))
    assert warmup.load_gemm_kernels(model, rows=5, rows_wide=2, device_type="cpu") == 12
    assert sorted(calls) == sorted([(m, (6, 4)) for m in range(1, 6)] + [(m, (3, 5)) for m in range(1, 6)]
                                   + [(m, (warmup.WIDE_N + 1, 2)) for m in (1, 2)])
    assert warmup.load_gemm_kernels(model, device_type="cuda") == 0  # nothing of the model is there


def test_long_eager_chunks_run_where_they_fit_and_never_displace_a_prompt_size(engine, tmp_path):
    """Chunks of more than 512 queries over the long context build the chunk path's cuDNN graphs; where the
    context is short they are left out rather than the fresh prompt sizes."""
    eng = fresh_engine(engine, tmp_path)
    steps = []
    step = eng.runner.step

    def spy(batch, eager=False):
        steps.append((list(batch.num_tokens), eager))
        return step(batch, eager=eager)

    eng.runner.step = spy
    # 64 pages of 16: beside a 100-token prompt and its 40-token chunk, 530 more fit, 900 do not
    curve = warm_up(eng, sizes=(100, 48), chunk=40, turns=(21, 900, 530))
    assert [n for n, _ in curve] == [48, 100]
    assert [n for n, e in steps if e] == [[21], [530]], steps
    assert eng.blocks.num_free == 64 and eng.blocks.num_cached == 0
    eng.tiers.close()
