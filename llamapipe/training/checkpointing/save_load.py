"""Distributed checkpoint save/load with exact resume and resharding between (tp, cp, pp, vpp, dp) layouts.

`save_checkpoint` and `load_checkpoint` are collective (every rank calls them). Rank 0 of the dp x cp group
of each (tp_rank, pp_rank) (the replicas of its weights: CP ranks hold whole weights too) writes the model and
optimizer shards, every rank writes its RNG state, each verifies what it wrote and rank 0 commits atomically
(writer.py, catalog.py), inline or in the background (--async-save; `finalize_async_save` waits). A load takes
the newest checkpoint whose files all pass their checksums (selection.py). Loading reads logical tensors by
name, so a checkpoint from any layout loads into any other; optimizer state reshards like the parameters (a tied
embedding is stored once, the last stage's copy loads it). RNG state is restored only when the layout is
unchanged (it is per rank; a layout recorded before an axis existed has that axis at size 1).
"""
from __future__ import annotations

import dataclasses
import os
import random
from typing import Any, Optional

import numpy as np
import torch
import torch.nn as nn

from llamapipe.training.checkpointing import io as cio
from llamapipe.training.checkpointing.catalog import remove_stale_tmp
from llamapipe.training.checkpointing.resume_checks import OPTIM_HINT, check_loadable, trainable
from llamapipe.training.checkpointing.io import latest_checkpoint  # noqa: F401  (part of this module's API)
from llamapipe.training.checkpointing.selection import choose_checkpoint, same_layout
from llamapipe.training.checkpointing.tokenizer_record import check_tokenizer, tokenizer_record
from llamapipe.training.checkpointing.writer import (  # noqa: F401  (finalize and the error: this module's API)
    CheckpointSaveError, FileJob, SaveJob, finalize_async_save, start)
from llamapipe.training.config import Config
from llamapipe.training.flag_names import flag_message
from llamapipe.core.logger import get_logger
from llamapipe.core.parallel_state import AXES, ParallelState
from llamapipe.training.checkpointing.resharding import (TensorSpec, gather_vocab_shards, named_tensors,
                                                          padded_rows_for, shard_of, spec_of, split_shard)
from llamapipe.training.checkpointing.tie_check import check_tie
from llamapipe.core.distributed.tied_embeddings import logical_name
from llamapipe.core.tensor_parallel.random import get_rng_tracker

@dataclasses.dataclass(frozen=True)
class LoadResult:
    iteration: int
    consumed_samples: int


def _barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def _layout(ps: ParallelState) -> dict:
    """The saving job's layout, every axis by name (what loading at another layout reshards from)."""
    return {"world_size": ps.world_size, **{axis: ps.size(axis) for axis in AXES}, "vpp": ps.vpp_size,
            "order": ps.order}


def save_checkpoint(save_dir: str, iteration: int, *, model_chunks: list[nn.Module], optimizer: Any,
                    scheduler: Any, parallel_state: Optional[ParallelState], config: Config,
                    consumed_samples: int, keep_last_n: Optional[int] = None, async_save: bool = False) -> None:
    """Write `<save_dir>/iter_XXXXXXX/` atomically, every file checksummed and verified; collective.

    With `async_save` the state is copied to CPU here and written by a background thread; the caller goes on
    and calls `finalize_async_save()` before its next save and before it exits. A previous pending save is
    finalized first. Raises `CheckpointSaveError` (one line) when any rank fails to write.
    """
    finalize_async_save()
    ps = parallel_state or ParallelState()
    tmp = cio.iter_dir(save_dir, iteration) + ".tmp"
    setup_error = None
    if ps.rank == 0:
        try:
            os.makedirs(save_dir, exist_ok=True)
            remove_stale_tmp(save_dir)   # leftovers of crashed saves, this iteration's included
            os.makedirs(tmp)
        except OSError as exc:
            setup_error = f"saving checkpoint {cio.iter_dir(save_dir, iteration)}: cannot create {tmp} ({exc})"
    setup_error = _from_rank0(setup_error)
    if setup_error is not None:
        raise CheckpointSaveError(setup_error)
    check_tie(model_chunks, ps, iteration)     # a tied embedding is saved once: its copies must be equal
    files = _rank_files(model_chunks, optimizer, ps, copy=async_save)    # collective under ZeRO-1
    has_optimizer = optimizer is not None
    fields = dict(iteration=iteration, consumed_samples=consumed_samples,
                  model_config=dataclasses.asdict(config.model), config=dataclasses.asdict(config),
                  layout=_layout(ps), has_optimizer=has_optimizer, tokenizer=tokenizer_record(config.data),
                  scheduler=scheduler.state_dict() if scheduler is not None else None)
    start(SaveJob(save_dir, iteration, ps.rank, ps.world_size, files, keep_last_n=keep_last_n, background=async_save,
                  meta=lambda records: cio.write_metadata(tmp, records, **fields)))
    if config.checkpoint.megatron_save is not None:    # --ckpt-format torch_dist
        from llamapipe.training.checkpointing.megatron_save import write_megatron_copy
        write_megatron_copy(config.checkpoint.megatron_save, cio.iter_dir(save_dir, iteration), ps.rank, keep_last_n)


def _rank_files(model_chunks: list[nn.Module], optimizer: Any, ps: ParallelState, copy: bool) -> list[FileJob]:
    """This rank's files, each with the state it holds (copied, for a background writer, when `copy`)."""
    params = named_tensors(model_chunks, copies=False)    # a tied embedding once, as the embedding
    specs = {name: spec_of(t) for name, t in params.items()}
    # collective under ZeRO-1; only dp_rank 0 (the writer) keeps the gathered state
    optim_state = optimizer.state_dict(keep=ps.dp_cp_rank == 0) if optimizer is not None else None
    files = []
    tensors = dict(params)
    copies = set(named_tensors(model_chunks)) - set(params)      # a tied copy's state is the embedding's
    optim_tensors, key_specs = ({}, {}) if optim_state is None or ps.dp_cp_rank else \
        _optimizer_shard(optim_state, specs, copies)
    if ps.dp_cp_rank == 0 and any(hasattr(t, "vocab_shards") for t in params.values()):
        # collective over pp: the vocabulary-parallel output layer as ordinary TP shards, on pp rank 0
        tensors = gather_vocab_shards(tensors, params, ps.pp_rank, ps.pp_group)
        optim_tensors = gather_vocab_shards(optim_tensors, params, ps.pp_rank, ps.pp_group)
    tensors = {name: _stage(name, t) if copy else t.detach() for name, t in tensors.items()}
    if ps.dp_cp_rank == 0:
        files.append(FileJob(cio.shard_name("model", ps.tp_rank, ps.pp_rank), lambda path, rank: cio.write_shard_file(
            path, tensors, specs, ps.tp_rank, ps.pp_rank, rank)))
        if optim_state is not None:
            files.append(FileJob(cio.shard_name("optim", ps.tp_rank, ps.pp_rank), lambda path, rank: cio.write_shard_file(
                path, optim_tensors, key_specs, ps.tp_rank, ps.pp_rank, rank)))
    if ps.rank == 0 and optim_state is not None:
        common = _cpu({k: v for k, v in optim_state.items() if k != "param_state"}, copy)
        files.append(FileJob(cio.OPTIM_COMMON, lambda path, rank: cio.torch_save(common, path, rank)))
    rng = rng_state()
    files.append(FileJob(cio.rng_name(ps.rank), lambda path, rank: cio.torch_save(rng, path, rank)))
    return files


# Reused CPU copies of the model tensors for background saves: the previous save is finalized before the
# next one copies, and reusing the pages saves the allocation (page faults) that dominates the copy's stall.
_staging: dict[str, torch.Tensor] = {}


def _stage(name: str, t: torch.Tensor) -> torch.Tensor:
    buf = _staging.get(name)
    if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
        buf = _staging[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())
    return buf.copy_(t.detach())


def _cpu(obj: Any, copy: bool) -> Any:
    """Tensors in `obj` on CPU, detached; cloned when `copy` (training goes on changing them in place)."""
    if torch.is_tensor(obj):
        return obj.detach().to("cpu", copy=copy)
    if isinstance(obj, dict):
        return {k: _cpu(v, copy) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu(v, copy) for v in obj)
    return obj


def _optimizer_shard(optim_state: dict, specs: dict[str, TensorSpec], skip: set[str]) -> tuple[dict, dict]:
    """The per-parameter optimizer state but `skip`'s as one shard's tensors; `Optimizer.state_dict` returns CPU
    copies that the caller owns, so a background writer needs no second copy."""
    tensors, key_specs = {}, {}
    for name, fields in optim_state["param_state"].items():
        if name in skip:
            continue
        assert name in specs, f"optimizer state for {name}, which no model chunk holds"
        for field, value in fields.items():
            assert torch.is_tensor(value), f"optimizer state {name}/{field} is not a tensor"
            tensors[f"{name}/{field}"], key_specs[f"{name}/{field}"] = value, specs[name]
    return tensors, key_specs


def load_checkpoint(load_dir: str, *, model_chunks: list[nn.Module], optimizer: Any, scheduler: Any,
                    parallel_state: Optional[ParallelState], config: Config, no_load_optim: bool = False,
                    no_load_rng: bool = False, finetune: bool = False) -> Optional[LoadResult]:
    """Load the newest complete checkpoint into this rank's chunks; None when there is none. A Megatron-LM save
    directory is staged as one of ours first (megatron_resume.py)."""
    from llamapipe.training.checkpointing.megatron_resume import resolved
    ps = parallel_state or ParallelState()
    wants_optimizer = optimizer is not None and not (finetune or no_load_optim)
    with resolved(load_dir, config, ps.rank, wants_optimizer=wants_optimizer) as directory:
        return _load(directory, model_chunks, optimizer, scheduler, ps, config, no_load_optim, no_load_rng, finetune)


def _load(load_dir: str, model_chunks: list[nn.Module], optimizer: Any, scheduler: Any, ps: ParallelState,
          config: Config, no_load_optim: bool, no_load_rng: bool, finetune: bool) -> Optional[LoadResult]:
    found = choose_checkpoint(load_dir, _layout(ps))
    if found is None:
        get_logger().info(f"no checkpoint in {load_dir}; starting from scratch")
        return None
    iteration, path = found
    reader = cio.CheckpointReader(path)
    check_tokenizer(reader.meta.get("tokenizer"), config.data, path, config.checkpoint.allow_tokenizer_change)
    tensors = named_tensors(model_chunks)
    check_loadable(reader.meta, path, tensors, config.model,
                   optimizer=optimizer is not None and not (finetune or no_load_optim))
    for name, target in tensors.items():
        key = logical_name(name, target)         # a tied copy loads the embedding (check_loadable: it is there)
        with torch.no_grad():
            target.copy_(_local_shard(target, reader, key, "model", ps))
    if not (finetune or no_load_optim):
        if optimizer is not None:
            _load_optimizer(reader, optimizer, tensors, ps)
        if scheduler is not None and reader.meta["scheduler"] is not None:
            _load_scheduler(scheduler, reader.meta["scheduler"], config, path)
    elif optimizer is not None:
        optimizer.reload_model_params()  # fp32 masters must follow the loaded (bf16/fp16) weights
    if not (finetune or no_load_rng):
        _load_rng(reader, ps)
    _barrier()
    get_logger().info(f"loaded checkpoint {path} (iteration {iteration})" + (" for finetuning" if finetune else ""))
    if finetune:
        return LoadResult(0, 0)
    return LoadResult(iteration, int(reader.meta["consumed_samples"]))


def _from_rank0(value: Any) -> Any:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        box = [value]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]
    return value


def _load_scheduler(scheduler: Any, state: dict, config: Config, path: str) -> None:
    """Megatron's rule: the command line and the checkpoint must agree on the schedule unless one is chosen."""
    ckpt = config.checkpoint
    try:
        scheduler.load_state_dict(state, override=ckpt.override_opt_param_scheduler,
                                  use_checkpoint=ckpt.use_checkpoint_opt_param_scheduler)
    except ValueError as err:
        raise ValueError(f"checkpoint {path}: {flag_message(err)}") from None


def _local_shard(param: torch.Tensor, reader: cio.CheckpointReader, key: str, kind: str,
                 ps: ParallelState) -> torch.Tensor:
    """This rank's shard of logical tensor `key`, split like `param` (vocabulary rows re-padded)."""
    spec = spec_of(param)
    index, count = shard_of(param, ps.tp_rank, ps.tp_size)
    rows = padded_rows_for(param, spec, count)
    shard = split_shard(reader.logical(key, kind, rows if spec.vocab_padded else None), spec, count, index, rows)
    if shard.shape != param.shape:
        raise ValueError(f"checkpoint {reader.path}: {kind} tensor {key} has shard shape {tuple(shard.shape)} "
                         f"for tp rank {ps.tp_rank} but the model expects {tuple(param.shape)}")
    return shard


def _load_optimizer(reader: cio.CheckpointReader, optimizer: Any, tensors: dict[str, torch.Tensor],
                    ps: ParallelState) -> None:
    fields: dict[str, list[str]] = {}
    for key in reader.keys("optim"):
        name, field = key.rsplit("/", 1)
        fields.setdefault(name, []).append(field)
    param_state = {}
    for name, target in trainable(tensors).items():      # each has state: check_loadable said so
        key = logical_name(name, target)
        param_state[name] = {field: _local_shard(target, reader, f"{key}/{field}", "optim", ps)
                             .to(target.device, copy=True)
                             for field in fields[key]}
    common = reader.load_pt(cio.OPTIM_COMMON)
    try:
        optimizer.load_state_dict({"param_state": param_state, **common})
    except (KeyError, ValueError, RuntimeError) as exc:
        raise ValueError(f"the optimizer state in {reader.path} does not fit this optimizer ({exc}); "
                         f"{OPTIM_HINT}") from None


def rng_state() -> dict:
    """This process's random states, as a checkpoint's rng file holds them."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)]}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    state["tp_tracker"] = get_rng_tracker().get_states()
    return state


def _load_rng(reader: cio.CheckpointReader, ps: ParallelState) -> None:
    if not same_layout(reader.meta["layout"], _layout(ps)):
        if ps.rank == 0:
            get_logger().warning(f"checkpoint {reader.path} was saved with layout {reader.meta['layout']}; "
                                 "random states are per rank, so they are not restored in this layout")
        return
    if cio.rng_name(ps.rank) not in reader.meta["files"]:
        if ps.rank == 0:
            get_logger().warning(f"checkpoint {reader.path} has no random states (e.g. converted from HF)")
        return
    state = reader.load_pt(cio.rng_name(ps.rank))
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_rng_tracker().set_states(state["tp_tracker"])
