"""The kernel workbench: check an implementation against its reference, compile it for
Hopper without a GPU, benchmark it against the H200's ceilings, plot, and tune."""

from qml_kernels.workbench.bench import BenchResult, bench, table
from qml_kernels.workbench.check import TOLERANCES, CheckReport, check
from qml_kernels.workbench.compile import CompileReport, compile_check
from qml_kernels.workbench.plots import plot_bench
from qml_kernels.workbench.spec import Case, OpSpec, all_specs, register_spec, spec_for

__all__ = ["BenchResult", "Case", "CheckReport", "CompileReport", "OpSpec", "TOLERANCES", "all_specs", "bench",
           "check", "compile_check", "plot_bench", "register_spec", "spec_for", "table"]
