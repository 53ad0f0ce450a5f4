"""Megatron-LM's --offload-modules names (fine-grained activation offloading) as this model's submodules.

Megatron offloads, per named module, the activations it saves during its forward (its input and what it computes
inside): `attn_norm` the input RMSNorm, `qkv_linear` the query/key/value projections, `core_attn` the attention
core (softmax and the two matmuls), `attn_proj` the output projection, `mlp_norm` the pre-MLP RMSNorm. The MoE
names have nothing to act on in a dense model. The offload store (core/pipeline_parallel/offload_store.py) matches
submodule paths by their ending, so a family whose decoder layer names its parts as `model/layers.py` does needs
nothing more.
"""
from __future__ import annotations

MODULE_PATHS: dict[str, tuple[str, ...]] = {
    "attn_norm": ("input_norm",),
    "qkv_linear": ("attention.q_proj", "attention.k_proj", "attention.v_proj"),
    "core_attn": ("attention.core",),
    "attn_proj": ("attention.o_proj",),
    "mlp_norm": ("post_attention_norm",),
}
MOE_MODULES = ("expert_fc1", "moe_act")


def module_paths(names: tuple[str, ...]) -> tuple[str, ...]:
    """The submodule path endings of Megatron's module `names` (each known to `MODULE_PATHS`)."""
    return tuple(path for name in names for path in MODULE_PATHS[name])
