"""Programmatic dependent launch (qml_kernels.pdl): the rules every PDL kernel must keep, checked
in the PTX each one compiles to for sm_90a, and the switch that turns it off.

A kernel launched with PDL may start while the one before it still runs, so a load of an
activation or any store placed before ``griddepcontrol.wait`` would race with it. The GPU run
compares outputs (a race shows as a wrong token only sometimes); this checks the order itself.
"""

from __future__ import annotations

import pytest
import torch

from qml_kernels import pdl
from qml_kernels.activations import _gated_activation_kernel
from qml_kernels.moe_gemm import _moe_gemm_kernel
from qml_kernels.rmsnorm import _rmsnorm_kernel
from qml_kernels.sampling import _sample_kernel
from qml_kernels.workbench.compile import compile_checks_by_name, grid_dependency_order
from tests import (
    test_activations_triton,
    test_attention_decode_triton,
    test_attention_prefill_triton,
    test_gemv,
    test_moe_fused_norms,
    test_moe_gemm_triton,
    test_moe_route,
    test_moe_routing,
    test_rmsnorm_triton,
    test_rope_kv_write_triton,
    test_sampling_triton,
)

# modules whose compile variants do not name their kernel
_KERNEL_OF = {test_rmsnorm_triton: _rmsnorm_kernel, test_activations_triton: _gated_activation_kernel,
              test_sampling_triton: _sample_kernel, test_moe_gemm_triton: _moe_gemm_kernel}


def _requests() -> dict[str, dict]:
    """One compile request per PDL kernel, taken from its own test module's variants."""
    out = {}
    for module in (test_gemv, test_rmsnorm_triton, test_rope_kv_write_triton, test_attention_decode_triton,
                   test_attention_prefill_triton, test_moe_route, test_moe_fused_norms, test_moe_gemm_triton,
                   test_moe_routing,
                   test_sampling_triton, test_activations_triton):
        for variant in module.COMPILE_VARIANTS.values():
            request = {"kernel": _KERNEL_OF.get(module), **variant}
            name = request["kernel"].fn.__name__ if hasattr(request["kernel"], "fn") else request["kernel"].__name__
            out.setdefault(name, request)  # the first variant of each kernel
    return out


REQUESTS = _requests()


@pytest.fixture(scope="module")
def reports() -> dict:
    requests = {name: {**r, "signature": {**r["signature"], "PDL": "constexpr"},
                       "constexprs": {**r["constexprs"], "PDL": True}} for name, r in REQUESTS.items()}
    requests["_gemv_kernel without PDL"] = {**REQUESTS["_gemv_kernel"],
                                             "constexprs": {**REQUESTS["_gemv_kernel"]["constexprs"], "PDL": False}}
    return compile_checks_by_name(requests)


def test_every_decode_kernel_is_covered():
    # the kernels a decode step launches (Llama and Qwen3-MoE), each under the PTX check below
    assert {"_gemv_kernel", "_rmsnorm_kernel", "_rope_kv_write_kernel", "_paged_decode_attention_kernel",
            "_paged_decode_attention_merge_kernel", "_paged_prefill_attention_kernel", "_moe_route_kernel",
            "_moe_gemm_kernel", "_moe_combine_kernel", "_sample_kernel", "_gated_activation_kernel",
            "_moe_norm_route_kernel", "_moe_combine_rmsnorm_kernel"} <= set(REQUESTS)


@pytest.mark.parametrize("name", sorted(REQUESTS))
def test_waits_before_any_global_access(reports, name):
    report = reports[name]
    assert report.ok, report.error
    order = grid_dependency_order(report.ptx)
    assert order.wait >= 0 and order.release > order.wait, f"{name}: the wait, then the release of the next kernel"
    assert order.safe, \
        f"{name}: '{order.first_access_op}' before griddepcontrol.wait: it would race with the kernel before"


def test_off_means_no_grid_dependency_instructions(reports):
    ptx = reports["_gemv_kernel without PDL"].ptx
    assert "griddepcontrol" not in ptx


def test_launch_args_off_on_cpu_and_when_disabled(monkeypatch):
    x = torch.zeros(4)
    assert pdl.launch_args(x) == {"PDL": False}
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert pdl.launch_args(x) == {"PDL": False} and not pdl.enabled(x)


@pytest.mark.parametrize("body, safe, op", [
    ("griddepcontrol.wait;\ngriddepcontrol.launch_dependents;\n\tld.global.b32 %r1, [%rd1];", True, "ld.global"),
    ("\t@%p1 ld.global.b32 %r1, [%rd1];\ngriddepcontrol.wait;\ngriddepcontrol.launch_dependents;", False, "ld.global"),
    ("\tatom.global.add.u32 %r1, [%rd1], 1;\ngriddepcontrol.wait;\ngriddepcontrol.launch_dependents;", False, "atom."),
    ("\tcp.async.commit_group;\ngriddepcontrol.wait;\ngriddepcontrol.launch_dependents;", True, None),
    ("griddepcontrol.launch_dependents;\ngriddepcontrol.wait;", False, None),
    ("\tld.global.b32 %r1, [%rd1];", False, "ld.global"),
])
def test_grid_dependency_order_reads_the_ptx(body, safe, op):
    # the check the kernels above pass, on PTX written to break it (and its commit/wait exemptions)
    order = grid_dependency_order(".target sm_90a\n" + body)
    assert order.safe is safe and order.first_access_op == op
