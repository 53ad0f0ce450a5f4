"""Global L2 gradient norm over every TP/PP/DP rank, gradient clipping, and the global inf/NaN check.

Callers pass only the grads this rank must count (a parameter replicated over TP counts on tp_rank 0 only;
pipeline-duplicated `shared` parameters count once) and the groups that together cover each counted
element exactly once: the model-parallel group, plus the DP group when DP ranks hold disjoint shards.
"""
from __future__ import annotations

import math
from typing import Any, Iterable

import torch
import torch.distributed as dist

from llamapipe.core.distributed.grad_reduce import all_reduce_over


def counts_for_norm(param: torch.Tensor, tp_rank: int) -> bool:
    """Whether this rank's copy of `param` contributes to the global grad norm."""
    if getattr(param, "shared", False):
        return False
    return bool(getattr(param, "tensor_model_parallel", False)) or tp_rank == 0


def global_grad_norm(grads: list[torch.Tensor], groups: Iterable[Any], device: torch.device) -> float:
    """L2 norm of the union of every rank's `grads` (collective over `groups`)."""
    squared = local_squared_norm(grads).reshape(1).to(device)
    all_reduce_over(squared, groups)
    return math.sqrt(squared.item())  # inf and NaN pass through for the caller to report


def clip_grads_(grads: list[torch.Tensor], max_norm: float, total_norm: float) -> float:
    """Scale `grads` in place so the global norm is at most `max_norm` (Megatron's rule); returns the factor."""
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff < 1.0 and grads:
        torch._foreach_mul_(grads, coeff)
    return min(coeff, 1.0)


def local_squared_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """Sum of squares of `grads` on this rank, as a float64 scalar tensor."""
    squared = torch.zeros((), dtype=torch.float64, device=grads[0].device if grads else "cpu")
    if grads:
        norms = torch._foreach_norm([g.float() if g.dtype != torch.float32 else g for g in grads])
        squared += torch.stack(norms).double().pow(2).sum()
    return squared


def unscale_local_(grads: list[torch.Tensor], inv_scale: float, device: torch.device) -> torch.Tensor:
    """Multiply fp32 `grads` by `inv_scale` in place; a 1-element tensor > 0 if this rank saw inf or NaN."""
    found_inf = torch.zeros(1, dtype=torch.float32, device=device)
    if grads:
        inv = torch.full((1,), inv_scale, dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv)
    return found_inf


def unscale_and_check_(grads: list[torch.Tensor], inv_scale: float, groups: Iterable[Any],
                       device: torch.device) -> bool:
    """Multiply fp32 `grads` by `inv_scale` in place; True if any rank in `groups` saw inf or NaN."""
    found_inf = unscale_local_(grads, inv_scale, device)
    all_reduce_over(found_inf, groups, op=dist.ReduceOp.MAX)
    return found_inf.item() > 0
