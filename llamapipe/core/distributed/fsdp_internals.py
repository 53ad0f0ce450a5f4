"""torch's private FSDP2 and DTensor API, in one place: what `fsdp.py` needs that torch does not publish.

Why: ZeRO-2/3 here (`fsdp.py`) reduce-scatter once per step, after the plan's last W (the zero-bubble B/W split
defers weight gradients past FSDP's own post-backward), make a chunk the FSDP root before any of its units runs
(the vocabulary-parallel pre-pass), and read the gathered parameters and the local shards; `fully_shard` has no
public call for any of these. torch moves its internals between releases, so every private name is used here
and nowhere else, and tests/unit/test_fsdp_internals.py checks each one (kind and signature) on the installed
torch and runs this module on a one-rank `fully_shard` model. Written against torch 2.13.
"""
from __future__ import annotations

from typing import Iterator, Optional

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


def param_groups(module: FSDPModule) -> list:
    """The FSDP parameter groups of one `fully_shard`ed module (one per call of fully_shard on it)."""
    return list(module._get_fsdp_state()._fsdp_param_groups)


def init_root(module: FSDPModule) -> None:
    """Initialise FSDP's state with `module` as the root now, instead of at the first forward that runs."""
    module._get_fsdp_state()._lazy_init()


def gathered_params(groups: list) -> Iterator[tuple[nn.Module, str, Optional[nn.Parameter]]]:
    """(owning module, parameter name in it, gathered parameter or None when not allocated) of every parameter
    the `groups` manage."""
    for group in groups:
        for fsdp_param in group.fsdp_params:
            info = fsdp_param._module_info
            yield info.module, info.param_name, getattr(fsdp_param, "_unsharded_param", None)


def reduce_scatter(groups: list) -> None:
    """Run FSDP's post-backward for `groups` now: reduce-scatter the gradients accumulated on the gathered
    parameters into the shards' `.grad` (the module's gradient sync must be on), then mark the groups idle so
    the next step's forward starts afresh."""
    for group in reversed(groups):
        group.post_backward()
    for group in groups:
        group.finalize_backward()
        group._training_state = TrainingState.IDLE


def drop_gathered_grads(groups: list) -> None:
    """Forget the gradients accumulated on the gathered parameters of `groups` (a skipped or failed step)."""
    for group in groups:
        for fsdp_param in group.fsdp_params:
            if hasattr(fsdp_param, "_unsharded_param"):
                fsdp_param._unsharded_param.grad = None
            fsdp_param.unsharded_accumulated_grad = None


def local_tensor(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """This rank's storage of a DTensor itself (not an autograd view of it, as `to_local` gives under grad
    mode, which an in-place update of a parameter shard cannot use); plain tensors pass through."""
    return t._local_tensor if isinstance(t, DTensor) else t


def local_index(param: DTensor) -> tuple[slice, ...]:
    """The part of the full tensor that this rank's shard of `param` holds, as an index into the full tensor."""
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(slice(o, o + s) for o, s in zip(offset, shape))
