"""AdamW (decoupled weight decay, Loshchilov & Hutter) over fp32 main parameters, and access to its state.

NVIDIA apex `FusedAdam` is used on CUDA when `apex.optimizers` imports; otherwise torch's AdamW
(fused kernel on CUDA, multi-tensor `foreach` on CPU). Norm and bias parameters (1-D) get no weight decay,
Megatron's rule. With a decoupled learning rate (Megatron's --decoupled-lr) the embedding and the output layer
are a param group of their own, marked `decoupled_lr`, whose rate the scheduler sets from that schedule.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from llamapipe.core.config import OptimizerConfig


def fused_adam_class() -> Optional[type]:
    """apex's FusedAdam, or None when NVIDIA apex is not installed."""
    try:
        from apex.optimizers import FusedAdam
    except ImportError:
        return None
    return FusedAdam


def decays_weight(name: str, param: torch.Tensor) -> bool:
    """Megatron's rule: weight decay on matrices only, never on biases or norm weights."""
    return param.dim() > 1 and not name.endswith(".bias")


EMBEDDING_OR_OUTPUT = ("embedding.weight", "output.weight")     # Megatron's is_embedding_or_output_parameter


def follows_decoupled_lr(name: str, opt_cfg: OptimizerConfig) -> bool:
    """Whether the parameter named `name` learns at the decoupled rate: the embedding and the output layer
    (Megatron's is_embedding_or_output_parameter), when --decoupled-lr is given."""
    return opt_cfg.decoupled_lr is not None and name in EMBEDDING_OR_OUTPUT


def make_adamw(decay: list[torch.Tensor], no_decay: list[torch.Tensor], opt_cfg: OptimizerConfig,
               decoupled: Sequence[torch.Tensor] = ()) -> Any:
    """AdamW over the param groups with and without weight decay, and the weight-decayed `decoupled` group
    (the embedding and output layer under --decoupled-lr)."""
    groups = [{"params": decay, "weight_decay": opt_cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0},
              {"params": list(decoupled), "weight_decay": opt_cfg.weight_decay, "decoupled_lr": True}]
    groups = [g for g in groups if g["params"]]
    if not groups:  # a ZeRO-1 shard made only of padding still needs an optimizer object
        groups = [{"params": [torch.zeros(0)], "weight_decay": 0.0}]
    device = groups[0]["params"][0].device
    kwargs = dict(lr=opt_cfg.lr, betas=(opt_cfg.adam_beta1, opt_cfg.adam_beta2), eps=opt_cfg.adam_eps)
    if device.type == "cuda":
        fused_adam = fused_adam_class()
        if fused_adam is not None:
            return fused_adam(groups, adam_w_mode=True, **kwargs)
        return torch.optim.AdamW(groups, fused=True, **kwargs)
    return torch.optim.AdamW(groups, foreach=True, **kwargs)


def get_adam_state(optimizer: Any, main: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(exp_avg, exp_avg_sq) of one main tensor; zeros before its first step."""
    state = optimizer.state.get(main, {})
    if "exp_avg" not in state:
        return torch.zeros_like(main), torch.zeros_like(main)
    return state["exp_avg"], state["exp_avg_sq"]


def set_adam_state(optimizer: Any, main: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                   step: int) -> None:
    """Install Adam moments and the step count for one main tensor (torch keeps it per tensor, apex per group)."""
    fused = any(g.get("fused") for g in optimizer.param_groups)
    step_device = main.device if fused else torch.device("cpu")
    optimizer.state[main] = {"step": torch.tensor(float(step), dtype=torch.float32, device=step_device),
                             "exp_avg": exp_avg.to(main).clone(), "exp_avg_sq": exp_avg_sq.to(main).clone()}
    if fused_adam_class() is not None and not isinstance(optimizer, torch.optim.AdamW):
        for group in optimizer.param_groups:
            group["step"] = step
