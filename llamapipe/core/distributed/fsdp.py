"""ZeRO-2 and ZeRO-3 data parallelism on torch FSDP2 (`fully_shard`), composed with tensor and pipeline parallelism.

`--data-parallel-sharding-strategy` (Megatron-LM's values; Rajbhandari et al., "ZeRO", arXiv 1910.02054):
no_shard (DDP all-reduce), optim (ZeRO-1, `core.optimizer.distrib_optimizer`), optim_grads (ZeRO-2) and
optim_grads_params (ZeRO-3). The last two wrap every decoder layer and then the chunk itself with
`fully_shard` over the data-parallel group (a 1-D mesh; TP weights stay TP-local tensors that FSDP shards
further along dim 0). ZeRO-3 frees each layer's gathered weights after its forward (reshard_after_forward),
ZeRO-2 keeps them until the layer's backward; both keep only a 1/dp shard between steps.

FSDP never reduces during the backward here (`set_requires_gradient_sync(False)`): gradients accumulate on
the gathered parameters over every microbatch, and `reduce_scatter_grads`, called by `finalize_model_grads`
after the step's last W, runs FSDP's own reduce-scatter (a sum, fp32 for half-precision models) and divides
by the token count. So the zero-bubble B/W split works unchanged: the deferred weight-gradient closures
write the gathered parameter's `.grad`, which is only reduced once every W ran.

Vocabulary parallelism (`--enable-vocab-parallel`): the output layer's and the input embedding's vocabulary
shards (`runs_outside_chunk`) are called by the plan's S/T actions and the embedding's pre-pass, outside their
chunk's forward. Each is an FSDP unit of its own: its forward hooks gather its weight for S and for the
pre-pass, the pre-backward hooks on S's logits and on the pre-pass's output gather it again for T and for the
embedding's backward, and its gradient is reduce-scattered with the chunk's (the same `reduce_scatter_grads`).
So they stay sharded like every other weight (the largest ones under a big vocabulary), and the optimizer,
gradient norm and checkpoints see ordinary FSDP parameters. The chunk's FSDP state is initialised at wrap time
(`_lazy_init`), because these units may run before the chunk's first forward (the pre-pass does), and FSDP
makes the first module whose forward runs the root.

Checkpoints: a chunk's `state_dict()` returns full (DP-gathered) `nn.Parameter`s carrying the TP attributes,
as the ZeRO-1 checkpoint path expects; copying into such a tensor (loading) is written back to the shard by
`sync_loaded_views`, which the optimizer's `load_state_dict`/`reload_model_params` call.
"""
from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from llamapipe.core.config import FSDP_STRATEGIES, SHARDING_STRATEGIES as STRATEGIES

_TP_ATTRS = ("tensor_model_parallel", "partition_dim", "vocab_padded", "sequence_parallel", "shared", "vocab_shard",
             "vocab_shards")


def is_sharded(chunks: list[nn.Module]) -> bool:
    """Whether `chunks` were wrapped by `apply_data_parallel_sharding`."""
    return any(getattr(chunk, "_dp_sharding", None) is not None for chunk in chunks)


def local_tensor(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """This rank's storage of a (possibly FSDP-sharded) tensor; plain tensors pass through."""
    return t._local_tensor if isinstance(t, DTensor) else t


class _ChunkSharding:
    """What one wrapped chunk needs later: its FSDP param groups, the tensors handed out by `state_dict`."""

    def __init__(self, chunk: nn.Module, attrs: dict[str, dict]) -> None:
        from torch.distributed.fsdp import FSDPModule
        self.modules = [m for m in chunk.modules() if isinstance(m, FSDPModule)]
        self.attrs = attrs                         # parameter name -> TP attributes of the original
        self.views: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self.view_versions: dict[str, int] = {}

    def param_groups(self) -> list:
        groups = []
        for module in self.modules:
            groups += module._get_fsdp_state()._fsdp_param_groups
        return groups


def apply_data_parallel_sharding(chunks: list[nn.Module], strategy: str, ps: Any) -> list[nn.Module]:
    """Wrap each decoder layer and each chunk with FSDP2 under a ZeRO-2/3 `strategy` (in place; returns `chunks`).

    Other strategies, and a data-parallel size of 1, leave the chunks as they are."""
    if strategy not in STRATEGIES:
        raise ValueError(f"--data-parallel-sharding-strategy {strategy} is not one of {', '.join(STRATEGIES)}")
    if strategy not in FSDP_STRATEGIES or ps.dp_cp_size == 1:
        return chunks
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    device = next(chunks[0].parameters()).device
    # meta parameters (the dry run) are sharded on meta, as FSDP2's deferred initialisation does; the mesh then
    # names the CPU, a device with a process-group backend
    mesh = DeviceMesh.from_group(ps.dp_cp_group, "cpu" if device.type == "meta" else device.type)
    reshard = strategy == "optim_grads_params"
    for chunk in chunks:
        attrs = {name: {a: getattr(p, a) for a in _TP_ATTRS if hasattr(p, a)} for name, p in chunk.named_parameters()}
        half = any(p.dtype in (torch.float16, torch.bfloat16) for p in chunk.parameters())
        # half-precision grads accumulate over microbatches and are reduce-scattered in fp32 (Megatron's main_grad)
        mp = MixedPrecisionPolicy(reduce_dtype=torch.float32 if half else None)
        units = [*chunk.layers.values(), *outside_modules(chunk)]
        for unit in units:
            fully_shard(unit, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
        fully_shard(chunk, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
        chunk.set_requires_gradient_sync(False)     # reduced once per step, after the last W
        for module in (*units, chunk):
            module.set_gradient_divide_factor(1.0)       # a sum: the caller divides by the global token count
            module.set_force_sum_reduction_for_comms(True)   # plain SUM (gloo has no PREMUL_SUM)
        for name, p in chunk.named_parameters():
            for key, value in attrs[name].items():
                setattr(p, key, value)
        chunk._dp_sharding = _ChunkSharding(chunk, attrs)
        chunk.register_state_dict_post_hook(_full_state_dict)
        if len(units) > len(chunk.layers):
            chunk._get_fsdp_state()._lazy_init()     # the chunk is the root, whichever unit runs first
    return chunks


def outside_modules(chunk: nn.Module) -> list[nn.Module]:
    """The chunk's submodules that the runtime calls outside the chunk's forward (the vocabulary-parallel output
    layer and embedding shards): FSDP units of their own."""
    return [m for m in chunk.children() if getattr(m, "runs_outside_chunk", False)]


def _full_state_dict(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    """Replace every sharded entry by the full tensor (collective over DP), as ZeRO-1 checkpoints expect."""
    sharding: _ChunkSharding = module._dp_sharding
    for key, value in list(state_dict.items()):
        if not isinstance(value, DTensor):
            continue
        name = key[len(prefix):]
        full = value.full_tensor().detach()
        if isinstance(value, nn.Parameter):
            full = nn.Parameter(full, requires_grad=value.requires_grad)
            for attr, attr_value in sharding.attrs.get(name, {}).items():
                setattr(full, attr, attr_value)
            sharding.views[name] = full
            sharding.view_versions[name] = full._version
        state_dict[key] = full


@torch.no_grad()
def sync_loaded_views(chunks: list[nn.Module]) -> None:
    """Write back into the shards every full tensor from `state_dict()` that was modified in place since."""
    for chunk in chunks:
        sharding: Optional[_ChunkSharding] = getattr(chunk, "_dp_sharding", None)
        if sharding is None:
            continue
        params = dict(chunk.named_parameters())
        for name, view in list(sharding.views.items()):
            if view._version != sharding.view_versions.get(name):
                local_tensor(params[name]).copy_(shard_of(view, params[name]))
                sharding.view_versions[name] = view._version


def shard_of(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This DP rank's part of `full`, laid out like the sharded `param`'s local tensor."""
    if not isinstance(param, DTensor):
        return full
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    index = tuple(slice(o, o + s) for o, s in zip(offset, shape))
    return full[index]


def full_of(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The full tensor of which `local` is this rank's part, sharded like `param` (collective over DP)."""
    if not isinstance(param, DTensor):
        return local
    dt = DTensor.from_local(local.reshape(param._local_tensor.shape), param.device_mesh, param.placements,
                            shape=param.shape, stride=param.stride(), run_check=False)
    return dt.full_tensor()


def reduce_scatter_grads(chunks: list[nn.Module], ps: Any, divisor: Optional[float]) -> None:
    """Sum the step's gathered-parameter gradients over DP into the shards and divide by `divisor`.

    Collective over TP (sequence-parallel norm gradients) and DP; call after the step's last W."""
    from llamapipe.core.distributed.grad_reduce import group_size
    from llamapipe.core.tensor_parallel.layers import all_reduce_coalesced
    for chunk in chunks:
        sharding: _ChunkSharding = chunk._dp_sharding
        groups = sharding.param_groups()
        if group_size(ps.tp_group) > 1:
            sp = [fp._unsharded_param.grad for g in groups for fp in g.fsdp_params
                  if getattr(fp._unsharded_param, "grad", None) is not None
                  and _orig_attr(chunk, sharding, fp, "sequence_parallel")]
            all_reduce_coalesced(sp, ps.tp_group)
        chunk.set_requires_gradient_sync(True)
        try:
            for group in reversed(groups):
                group.post_backward()
            for group in groups:
                group.finalize_backward()
                group._training_state = type(group._training_state).IDLE
        finally:
            chunk.set_requires_gradient_sync(False)
        if divisor is not None:
            grads = [local_tensor(p.grad) for p in chunk.parameters() if p.grad is not None]
            if grads:
                torch._foreach_div_(grads, divisor)


def _orig_attr(chunk: nn.Module, sharding: _ChunkSharding, fsdp_param: Any, attr: str) -> Any:
    info = fsdp_param._module_info
    for name, module in chunk.named_modules():
        if module is info.module:
            full_name = f"{name}.{info.param_name}" if name else info.param_name
            return sharding.attrs.get(full_name, {}).get(attr, False)
    return False


def zero_sharded_grads(chunks: list[nn.Module]) -> None:
    """Drop the gathered-parameter gradients a skipped or failed step left behind (the shards' are dropped by
    the optimizer's zero_grad)."""
    for chunk in chunks:
        sharding = getattr(chunk, "_dp_sharding", None)
        if sharding is None:
            continue
        for group in sharding.param_groups():
            for fp in group.fsdp_params:
                if hasattr(fp, "_unsharded_param"):
                    fp._unsharded_param.grad = None
                fp.unsharded_accumulated_grad = None


def storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (a local shard counts its padded storage once)."""
    seen, total = set(), 0
    for t in tensors:
        t = local_tensor(t)
        if t is None:
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total
