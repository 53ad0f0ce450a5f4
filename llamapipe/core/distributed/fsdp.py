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
gradient norm and checkpoints see ordinary FSDP parameters. Tied, the two shards (one parameter without FSDP)
become two copies kept equal (`_split_shared_weights`). The chunk's FSDP state is initialised at wrap time
(`fsdp_internals.init_root`), because these units may run before the chunk's first forward (the pre-pass
does), and FSDP makes the first module whose forward runs the root. Every use of torch's private FSDP2 and
DTensor API goes through `fsdp_internals`.

Checkpoints: a chunk's `state_dict()` returns full (DP-gathered) `nn.Parameter`s carrying the TP attributes,
as the ZeRO-1 checkpoint path expects; copying into such a tensor (loading) is written back to the shard by
`sync_loaded_views`, which the optimizer's `load_state_dict`/`reload_model_params` call.
"""
from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from llamapipe.core.config import FSDP_STRATEGIES, SHARDING_STRATEGIES as STRATEGIES, ConfigError
from llamapipe.core.distributed import fsdp_internals
from llamapipe.core.distributed.tied_embeddings import mark_tied
from llamapipe.core.tensor_parallel.layers import TP_PARTIAL_GRADS, all_reduce_coalesced, tp_size_rank

_TP_ATTRS = ("tensor_model_parallel", "partition_dim", "vocab_padded", "sequence_parallel", "per_head", "shared",
             "vocab_shard", "vocab_shards", "tied_embedding", "tied_to")


def is_sharded(chunks: list[nn.Module]) -> bool:
    """Whether `chunks` were wrapped by `apply_data_parallel_sharding`."""
    return any(getattr(chunk, "_dp_sharding", None) is not None for chunk in chunks)


def local_tensor(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """This rank's storage of a (possibly FSDP-sharded) tensor; plain tensors pass through."""
    return fsdp_internals.local_tensor(t)


class _ChunkSharding:
    """What one wrapped chunk needs later: its FSDP param groups, the tensors handed out by `state_dict`."""

    def __init__(self, chunk: nn.Module, attrs: dict[str, dict]) -> None:
        self.modules = [m for m in chunk.modules() if isinstance(m, FSDPModule)]
        self.attrs = attrs                         # parameter name -> TP attributes of the original
        self.views: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self.view_versions: dict[str, int] = {}

    def param_groups(self) -> list:
        return [group for module in self.modules for group in fsdp_internals.param_groups(module)]


def apply_data_parallel_sharding(chunks: list[nn.Module], strategy: str, ps: Any) -> list[nn.Module]:
    """Wrap each decoder layer and each chunk with FSDP2 under a ZeRO-2/3 `strategy` (in place; returns `chunks`).

    Other strategies, and a data-parallel size of 1, leave the chunks as they are."""
    if strategy not in STRATEGIES:
        raise ConfigError(f"data_parallel_sharding_strategy {strategy} is not one of {', '.join(STRATEGIES)}",
                          "data_parallel_sharding_strategy")
    if strategy not in FSDP_STRATEGIES or ps.dp_cp_size == 1:
        return chunks
    device = next(chunks[0].parameters()).device
    # meta parameters (the dry run) are sharded on meta, as FSDP2's deferred initialisation does; the mesh then
    # names the CPU, a device with a process-group backend
    mesh = DeviceMesh.from_group(ps.dp_cp_group, "cpu" if device.type == "meta" else device.type)
    reshard = strategy == "optim_grads_params"
    for chunk in chunks:
        _split_shared_weights(chunk)
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
            fsdp_internals.init_root(chunk)     # the chunk is the root, whichever unit runs first
    return chunks


def outside_modules(chunk: nn.Module) -> list[nn.Module]:
    """The chunk's submodules that the runtime calls outside the chunk's forward (the vocabulary-parallel output
    layer and embedding shards): FSDP units of their own."""
    return [m for m in chunk.children() if getattr(m, "runs_outside_chunk", False)]


def _split_shared_weights(chunk: nn.Module) -> None:
    """A weight that two outside units share (the tied vocabulary-parallel shard, the embedding's and the output
    layer's) becomes two copies kept equal, as across pipeline stages (`tied_embeddings`): FSDP2 gathers a parameter
    in the hooks of the one unit that holds it, and these two units run apart."""
    units = outside_modules(chunk)
    for unit in units[1:]:
        if any(unit.weight is other.weight for other in units if other is not unit):
            shared = unit.weight
            unit.weight = nn.Parameter(shared.detach().clone(), requires_grad=shared.requires_grad)
            for attr in _TP_ATTRS:
                if hasattr(shared, attr):
                    setattr(unit.weight, attr, getattr(shared, attr))
            mark_tied(shared, copy=False)
            mark_tied(unit.weight, copy=True)


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
    return full[fsdp_internals.local_index(param)]


def full_of(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The full tensor of which `local` is this rank's part, sharded like `param` (collective over DP)."""
    if not isinstance(param, DTensor):
        return local
    dt = DTensor.from_local(local.reshape(local_tensor(param).shape), param.device_mesh, param.placements,
                            shape=param.shape, stride=param.stride(), run_check=False)
    return dt.full_tensor()


def reduce_scatter_grads(chunks: list[nn.Module], ps: Any, divisor: Optional[float]) -> None:
    """Sum the step's gathered-parameter gradients over DP into the shards and divide by `divisor`.

    Collective over TP (sequence-parallel and per-head norm gradients) and DP; call after the step's last W."""
    for chunk in chunks:
        sharding: _ChunkSharding = chunk._dp_sharding
        groups = sharding.param_groups()
        if tp_size_rank(ps.tp_group)[0] > 1:
            all_reduce_coalesced(_tp_partial_grads(chunk, sharding, groups), ps.tp_group)
        chunk.set_requires_gradient_sync(True)
        try:
            fsdp_internals.reduce_scatter(groups)
        finally:
            chunk.set_requires_gradient_sync(False)
        if divisor is not None:
            grads = [local_tensor(p.grad) for p in chunk.parameters() if p.grad is not None]
            if grads:
                torch._foreach_div_(grads, divisor)


def _tp_partial_grads(chunk: nn.Module, sharding: _ChunkSharding, groups: list) -> list[torch.Tensor]:
    """The gradients on the gathered parameters that are partial over TP: sequence-parallel norms and per-head
    norms (`tensor_parallel.layers.TP_PARTIAL_GRADS`)."""
    prefix = {module: name for name, module in chunk.named_modules()}
    grads = []
    for module, name, param in fsdp_internals.gathered_params(groups):
        if module not in prefix or param is None or param.grad is None:
            continue
        full_name = f"{prefix[module]}.{name}" if prefix[module] else name
        if any(sharding.attrs.get(full_name, {}).get(attr, False) for attr in TP_PARTIAL_GRADS):
            grads.append(param.grad)
    return grads


def zero_sharded_grads(chunks: list[nn.Module]) -> None:
    """Drop the gathered-parameter gradients a skipped or failed step left behind (the shards' are dropped by
    the optimizer's zero_grad)."""
    for chunk in chunks:
        sharding = getattr(chunk, "_dp_sharding", None)
        if sharding is not None:
            fsdp_internals.drop_gathered_grads(sharding.param_groups())


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
