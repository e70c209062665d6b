"""cProfile of the engine's loop thread, for benchmarks that want the host's side of a step
(``engine_h200.py --profile-loop``): scheduling, tier bookkeeping, launches, and the waits
inside them. torch.profiler shows the device; this shows which Python call waited."""

from __future__ import annotations

from pathlib import Path


def profile_engine_loops(out: Path) -> None:
    """Each engine's loop thread runs under cProfile (the host's side of a step: scheduling, tier
    bookkeeping, launches, and the waits inside them); when the engine stops, the stats go to
    ``out/loop-{cumulative,tottime}.txt`` and the tiers' and scheduler's callees to
    ``out/loop-callees.txt`` (the last engine of the run wins)."""
    import cProfile
    import io
    import pstats

    from qml_runtime import engine as engine_mod

    loop = engine_mod.Engine._loop

    def profiled(self):
        prof = cProfile.Profile()
        prof.enable()
        try:
            loop(self)
        finally:
            prof.disable()
            for key in ("cumulative", "tottime"):
                text = io.StringIO()
                pstats.Stats(prof, stream=text).sort_stats(key).print_stats(80)
                (out / f"loop-{key}.txt").write_text(text.getvalue())
            text = io.StringIO()
            pstats.Stats(prof, stream=text).print_callees(
                "_admit|restore_host|_upload|_upload_layers|flush_spills|_gather_spills|_copy_down|_gather$|"
                "gather_pages|spill|pump|_fill_first|_iterate|_prepare")
            (out / "loop-callees.txt").write_text(text.getvalue())

    engine_mod.Engine._loop = profiled


class TurnProfile:
    """cProfile of the engine thread's loop iterations only while ``on`` is set (one turn, not the
    prompts around it): ``with prof.turn(): ...`` around a request, then ``prof.dump(path)``."""

    def __init__(self):
        import cProfile
        import threading

        from qml_runtime import engine as engine_mod

        self.on = threading.Event()
        self.prof = cProfile.Profile()
        iterate = engine_mod.Engine._iterate
        prof, on = self.prof, self.on

        def profiled(engine, inflight):
            if not on.is_set():
                return iterate(engine, inflight)
            prof.enable()
            try:
                return iterate(engine, inflight)
            finally:
                prof.disable()

        engine_mod.Engine._iterate = profiled

    def turn(self):
        import contextlib

        @contextlib.contextmanager
        def scope():
            self.on.set()
            try:
                yield
            finally:
                self.on.clear()
        return scope()

    def dump(self, path: Path, lines: int = 60) -> str:
        import io
        import pstats

        text = io.StringIO()
        for key in ("cumulative", "tottime"):
            pstats.Stats(self.prof, stream=text).sort_stats(key).print_stats(lines)
        path.write_text(text.getvalue())
        return text.getvalue()
