"""An ipywidgets panel to change a kernel's launch parameters and re-run check + bench."""

from __future__ import annotations

import dataclasses

import torch

from qml_kernels.workbench.bench import bench, table
from qml_kernels.workbench.check import check
from qml_kernels.workbench.spec import spec_for

_CHOICES = {
    "num_warps": [1, 2, 4, 8, 16],
    "num_stages": [1, 2, 3, 4, 5],
}


def _options(name: str, default) -> list:
    if name in _CHOICES:
        return _CHOICES[name]
    if isinstance(default, bool):
        return [False, True]
    if default is None and name.startswith("block"):
        return [None] + [2**k for k in range(0, 14)]  # None: the launcher's own choice
    if isinstance(default, int) and default > 0 and default & (default - 1) == 0:
        # block sizes: powers of two around the default
        return [2**k for k in range(max(0, default.bit_length() - 4), default.bit_length() + 3)]
    return [default]


def tuning_panel(op: str, case_index: int = 0, dtype: torch.dtype | None = None, impl: str = "triton"):
    """A panel with one dropdown per field of the op's launch config and a Run button.

    Run checks the chosen config on the op's small cases, then times it on one case
    (a model-size case on a GPU, a small one on CPU) and prints both. Returns the panel
    and ``run(config=None)``, which does the same from code, printing to the cell.
    """
    import ipywidgets as w
    from IPython.display import display

    spec = spec_for(op)
    if spec.launch_config is None:
        raise ValueError(f"{op} has no launch config to tune")
    default = spec.launch_config()
    fields = dataclasses.fields(default)
    widgets = {f.name: w.Dropdown(options=_options(f.name, getattr(default, f.name)),
                                  value=getattr(default, f.name), description=f.name) for f in fields}
    button = w.Button(description="Run check + bench", button_style="primary")
    out = w.Output()
    on_gpu = torch.cuda.is_available()
    bench_dtype = dtype or (torch.bfloat16 if on_gpu else torch.float32)
    bench_cases = list(spec.model_cases if on_gpu and spec.model_cases else spec.cases)

    def run(config=None):
        config = config or spec.launch_config(**{k: v.value for k, v in widgets.items()})
        print(config)
        report = check(op, impl, config=config)
        print(report)
        if report.ok:
            case = bench_cases[min(case_index, len(bench_cases) - 1)]
            print(table(bench(op, impl, cases=[case], dtype=bench_dtype, config=config)))

    def on_click(_):
        out.clear_output()
        with out:
            run()

    button.on_click(on_click)
    panel = w.VBox([w.HBox(list(widgets.values())[:3]), w.HBox(list(widgets.values())[3:]), button, out])
    display(panel)
    return panel, run
