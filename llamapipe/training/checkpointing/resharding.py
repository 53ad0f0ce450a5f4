"""Tensor-parallel resharding of logical tensors, and which pipeline rank holds which logical name.

A checkpoint stores every tensor under its layout-independent logical name (`embedding.weight`,
`layers.<global index>.<...>`, `final_norm.weight`, `output.weight`; tied embeddings: `embedding.weight` alone,
which the last stage's copy loads, core/distributed/tied_embeddings.py). A TP shard is the contiguous slice
of the logical tensor along `partition_dim` in tp_rank order (-1: replicated). Vocabulary-padded
tensors (embedding, output) are padded with zero rows to a tp-dependent size inside the model, so the
merge trims them to the true vocabulary and the split re-pads for the target tp size.
Under vocabulary parallelism (arXiv 2411.05288) the output layer is split over tp x pp (`vocab_shard` of
`vocab_shards`, tp-major): a save gathers the pp shards of each TP rank into that rank's ordinary TP shard
(`gather_vocab_shards`), so the files look the same with or without the split and load into either.
A tied embedding's copy on the last stage is saved as the first stage's embedding, once (`named_tensors`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

import torch
import torch.nn as nn

from llamapipe.core.distributed.tied_embeddings import is_copy
from llamapipe.core.parallel_state import ParallelState
from llamapipe.core.pipeline_parallel.layout import stage_layer_ranges
from llamapipe.core.pipeline_parallel.schedule_ir import rank_chunk_of
from llamapipe.model.families import family_of

if TYPE_CHECKING:
    from llamapipe.model.llama import LlamaConfig

_LAYER = re.compile(r"^layers\.(\d+)\.")


@dataclass(frozen=True)
class TensorSpec:
    """How one logical tensor is split over TP ranks."""
    partition_dim: int = -1            # -1: replicated over TP
    vocab_padded: bool = False         # rows padded to the tp-dependent padded vocabulary size


def spec_of(tensor: torch.Tensor) -> TensorSpec:
    """Partition attributes the model sets on its parameters (absent on buffers: replicated)."""
    if not getattr(tensor, "tensor_model_parallel", False):
        return TensorSpec(-1, bool(getattr(tensor, "vocab_padded", False)))
    return TensorSpec(int(getattr(tensor, "partition_dim")), bool(getattr(tensor, "vocab_padded", False)))


def named_tensors(model_chunks: Iterable[nn.Module], copies: bool = True) -> dict[str, torch.Tensor]:
    """Name -> parameter or persistent buffer, over all chunks of this rank (keep_vars). A tensor under two names
    (the tied vocabulary-parallel shard, also the output layer's) is listed once, under its first; `copies` False
    leaves out the last stage's copy of a tied embedding, which a checkpoint holds once, as the embedding."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for chunk in model_chunks:
        for name, tensor in chunk.state_dict(keep_vars=True).items():
            if id(tensor) in seen or (is_copy(tensor) and not copies):
                continue
            assert name not in out, f"logical name {name} held by two chunks"
            seen.add(id(tensor))
            out[name] = tensor
    return out


def merge_shards(shards: list[torch.Tensor], spec: TensorSpec, vocab_size: int) -> torch.Tensor:
    """TP shards in tp_rank order -> the logical tensor (vocabulary rows trimmed to `vocab_size`)."""
    full = shards[0] if spec.partition_dim < 0 or len(shards) == 1 else torch.cat(shards, spec.partition_dim)
    if spec.vocab_padded:
        assert full.shape[0] >= vocab_size, f"padded rows {full.shape[0]} < vocab size {vocab_size}"
        full = full[:vocab_size]
    return full


def split_shard(full: torch.Tensor, spec: TensorSpec, tp_size: int, tp_rank: int,
                padded_rows: int | None = None) -> torch.Tensor:
    """Logical tensor -> this tp_rank's shard; vocabulary rows zero-padded to `padded_rows` first."""
    if spec.vocab_padded:
        assert padded_rows is not None and padded_rows >= full.shape[0]
        if padded_rows > full.shape[0]:
            pad = full.new_zeros((padded_rows - full.shape[0],) + tuple(full.shape[1:]))
            full = torch.cat([full, pad], 0)
    if spec.partition_dim < 0 or tp_size == 1:
        return full
    size = full.shape[spec.partition_dim]
    if size % tp_size:
        raise ValueError(f"dimension {spec.partition_dim} of size {size} cannot be split over "
                         f"--tensor-model-parallel-size {tp_size}")
    return full.chunk(tp_size, spec.partition_dim)[tp_rank]


def shard_of(param: torch.Tensor, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """(shard index, shard count) of a parameter: its TP rank and size, or its vocabulary shard over tp x pp."""
    if hasattr(param, "vocab_shards"):
        return int(param.vocab_shard), int(param.vocab_shards)
    return tp_rank, tp_size


def gather_vocab_shards(tensors: dict[str, torch.Tensor], params: dict[str, torch.Tensor], pp_rank: int,
                        pp_group) -> dict[str, torch.Tensor]:
    """`tensors` (keyed like `params`, or "<name>/<field>" for optimizer state) with every vocabulary-parallel
    shard replaced by the concatenation of its pp shards, this TP rank's ordinary TP shard, kept on pp rank 0
    only; collective over `pp_group` (every pp rank holds the same vocabulary-parallel names)."""
    out = dict(tensors)
    for key in sorted(tensors):
        param = params[key.split("/")[0]]
        if not hasattr(param, "vocab_shards"):
            continue
        local = tensors[key].detach().to(param.device).contiguous()    # optimizer state may be a CPU copy
        parts = [torch.empty_like(local) for _ in range(torch.distributed.get_world_size(pp_group))]
        torch.distributed.all_gather(parts, local, group=pp_group)
        if pp_rank == 0:
            out[key] = torch.cat(parts, 0).to(tensors[key].device)
        else:
            del out[key]
    return out


def padded_rows_for(local: torch.Tensor, spec: TensorSpec, tp_size: int) -> int:
    """Full padded row count implied by a local shard of a vocabulary-padded tensor."""
    return local.shape[0] * tp_size if spec.partition_dim == 0 else local.shape[0]


def layer_index(name: str) -> int | None:
    match = _LAYER.match(name)
    return int(match.group(1)) if match else None


def pp_rank_of(name: str, num_layers: int, pp_size: int, vpp_size: int = 1,
               placement: str = "interleaved", first: int | None = None, last: int | None = None, *,
               embedding: bool = False, loss: bool = False) -> int:
    """Pipeline rank that holds logical `name` under `stage_layer_ranges`."""
    ranges = stage_layer_ranges(num_layers, pp_size, vpp_size, first, last, embedding=embedding, loss=loss)
    index = layer_index(name)
    if index is not None:
        stage = next((s for s, (start, end) in enumerate(ranges) if start <= index < end), None)
        if stage is None:
            raise ValueError(f"{name} is layer {index}, but the model has {num_layers} layers")
    else:
        stage = 0 if name.startswith("embedding.") else len(ranges) - 1
    return rank_chunk_of(stage, pp_size, placement)[0]


def model_specs(config: LlamaConfig, tp: int) -> dict[str, TensorSpec]:
    """Partition specs of every logical name, from a weightless (meta) model; checks tp against shapes."""
    with torch.device("meta"):
        model = family_of(config).model_class(config, ParallelState(tp_size=tp, world_size=tp))
    return {name: spec_of(param) for name, param in model.named_parameters()}
