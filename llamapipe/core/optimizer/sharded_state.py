"""Per-parameter optimizer state of FSDP-sharded (ZeRO-2/3) parameters in the checkpoint's full form.

Checkpoints hold, per parameter, full (DP-unsharded) tensors shaped like the TP-local parameter, whatever
the data-parallel strategy, so a run can resume under another strategy or DP size. Under FSDP2 each rank
steps the local shard of each parameter; these helpers gather it to the full form (collective over DP)
and cut a full tensor back to this rank's shard.
"""
from __future__ import annotations

from typing import Any

import torch

from llamapipe.core.distributed.fsdp import full_of, shard_of


def gather_fsdp_param_state(optimizer: Any, keys: tuple, keep: bool) -> dict[str, dict[str, torch.Tensor]]:
    """{name: {key: full CPU tensor}} of `optimizer` (an FSDP-mode `Optimizer`); collective over DP.

    Every rank gathers every tensor (the same collectives in the same order); only `keep` ranks hold them."""
    index_of = {seg.param_index: k for k, seg in enumerate(optimizer.segments)}
    param_state: dict[str, dict[str, torch.Tensor]] = {name: {} for name in optimizer.names}
    for key in keys:
        values = optimizer._segment_values(key)
        for i, (name, param, local) in enumerate(zip(optimizer.names, optimizer.model_params, optimizer.params)):
            if key == "master_param" and param.dtype == torch.float32:
                continue                  # the model parameter is the master
            k = index_of.get(i)
            value = (values[k].reshape(local.shape) if k is not None
                     else torch.zeros(local.shape, dtype=torch.float32, device=local.device))
            full = full_of(value.to(local.device, torch.float32), param)
            if keep:
                param_state[name][key] = full.to("cpu", copy=True)
    return param_state


def localize_param_state(param_state: dict, names: list[str], model_params: list[torch.Tensor]) -> dict:
    """The checkpoint's full per-parameter tensors cut to this rank's FSDP shards."""
    out = {}
    for name, param in zip(names, model_params):
        if name not in param_state:
            raise ValueError(f"the optimizer checkpoint has no state for parameter {name}")
        entry = param_state[name]
        shape = tuple(entry["exp_avg"].shape)
        if shape != tuple(param.shape):
            raise ValueError(f"the optimizer state of {name} has shape {shape} but the parameter has "
                             f"shape {tuple(param.shape)}")
        out[name] = {key: shard_of(value, param) for key, value in entry.items()}
    return out
