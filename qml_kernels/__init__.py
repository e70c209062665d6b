"""qml_kernels: the ops an LLM forward pass is built from, each with a plain-PyTorch
reference and faster implementations (Triton now; CuTe DSL and vendor libraries
later) behind one dispatch (``qml_kernels.registry``).

Shape legend, used in comments across the project: T tokens, B batch (sequences),
D hidden, H heads, Hkv kv heads, Dh head dim, I ffn dim, V vocab, E experts,
A active experts, P pages, S page size.

``load_ops()`` imports every op module, which registers its implementations and
its workbench spec.
"""

import importlib

OP_MODULES = (
    "qml_kernels.rmsnorm",
    "qml_kernels.activations",
    "qml_kernels.rope",
    "qml_kernels.rope_kv_write",
    "qml_kernels.gguf_dequant",
    "qml_kernels.sampling",
    "qml_kernels.attention",
    "qml_kernels.attention_decode",
    "qml_kernels.attention_prefill",
    "qml_kernels.linear",
    "qml_kernels.moe_routing",
    "qml_kernels.moe_route",
    "qml_kernels.moe_gemm",
    "qml_kernels.moe_fused_norms",
    "qml_kernels.moe_decode",
    "qml_kernels.page_copy",
)


def load_ops() -> None:
    for name in OP_MODULES:
        importlib.import_module(name)
