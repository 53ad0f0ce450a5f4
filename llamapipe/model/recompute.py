"""Partial activation recompute of a decoder layer's parts: Megatron-LM's `--recompute-modules` and the zero-bubble
fork's `--recompute-lgd`.

Megatron's modules (transformer_config.py `recompute_modules`, with `--recompute-granularity selective`):
`core_attn` recomputes the attention core (softmax and the two matmuls; here RoPE, the q/k norms and SDPA) from
q, k and v; `mlp` the whole feed-forward block from its input (its GEMMs run twice); `layernorm` the two RMSNorms'
outputs from their inputs. The fork's `--recompute-lgd` recomputes "layernorm, gelu and dropout": here the two
norms and the SwiGLU activation `silu(gate) * up` (LLaMA has no dropout), the cheap element-wise parts whose
outputs the next GEMM would otherwise store.

`mlp` and `core_attn` are non-reentrant `torch.utils.checkpoint` regions. A norm's or the activation's output is
not a region's: the GEMM after it saves it as its input. `discard_and_recompute` frees that output's storage once
the GEMM has run and refills it, from inputs autograd keeps anyway (the norm's input, the activation's gate and
up), just before the backward reaches a given node (a pre-hook on it): Megatron's `CheckpointWithoutOutput`
(`discard_output_and_register_recompute`). The tensor is marked `recomputed_later`, so the activation offload
store leaves it alone (it holds no bytes to move). Numerics are unchanged: the same ops on the same inputs.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from llamapipe.model.llama.config import LlamaConfig

MEGATRON_MODULES = ("core_attn", "mlp", "layernorm")         # what a dense LLaMA layer has of Megatron's names
NOT_DENSE = ("moe_act", "moe", "shared_experts", "mla_up_proj")
LGD = ("layernorm", "act")                                    # the fork's --recompute-lgd


def recompute_modules(config: "LlamaConfig") -> frozenset:
    """The parts of each layer to recompute: the config's modules, or Megatron's default (`core_attn`) under
    selective recompute without them."""
    modules = tuple(config.recompute_modules or ())
    if not modules and config.recompute_granularity == "selective":
        modules = ("core_attn",)
    return frozenset(modules)


def saved_bytes_per_token(config: "LlamaConfig", modules: frozenset, bytes_per_element: int, tp: int = 1,
                          sequence_parallel: bool = False) -> float:
    """Bytes of one layer's saved activations per token that recomputing `modules` does not store, on one tp rank:
    Korthikanti et al. 2022 (arXiv 2205.05198, section 4) counted for this layer. `layernorm`: the two norms'
    outputs, 2h (sequence shards under sequence parallelism); `act`: silu(gate) and its product with up, 2f/tp;
    `mlp`: gate, up, silu(gate) and the product, 4f/tp (its input stays: the region keeps it); `core_attn`: with a
    fused (flash) kernel only the log-sum-exp, one fp32 per head (the paper's 5as of scores and masks is what an
    unfused kernel would store)."""
    h, f = config.hidden_size, config.ffn_hidden_size
    saved = 0.0
    if "layernorm" in modules:
        saved += 2 * h * bytes_per_element / (tp if sequence_parallel else 1)
    if "mlp" in modules:
        saved += 4 * f * bytes_per_element / tp
    elif "act" in modules:
        saved += 2 * f * bytes_per_element / tp
    if "core_attn" in modules:
        saved += 4 * config.num_attention_heads / tp
    return saved


def discard_and_recompute(output: torch.Tensor, fn: Callable[..., torch.Tensor], inputs: tuple,
                          hook: torch.Tensor) -> None:
    """Free `output`'s storage now; before the backward runs `hook`'s node, refill it with `fn(*inputs)`. Nothing
    happens without a graph (evaluation, no grad) or when `output` shares its storage with more than itself."""
    if not torch.is_grad_enabled() or hook.grad_fn is None or output.grad_fn is None:
        return
    storage = output.untyped_storage()
    if storage.nbytes() != output.numel() * output.element_size() or not output.is_contiguous():
        return
    nbytes, inputs = storage.nbytes(), tuple(t.detach() for t in inputs)
    output.recomputed_later = True

    def refill(grad_outputs):
        if storage.nbytes() == 0:
            with torch.no_grad():
                fresh = fn(*inputs)
            storage.resize_(nbytes)
            storage.copy_(fresh.contiguous().untyped_storage())     # a storage copy: no version bump

    hook.grad_fn.register_prehook(refill)
    storage.resize_(0)
