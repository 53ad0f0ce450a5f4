"""Distributed checkpoint save/load with exact resume and resharding between (tp, pp, vpp, dp) layouts.

`save_checkpoint` and `load_checkpoint` are collective (every rank calls them). dp_rank 0 of each
(tp_rank, pp_rank) writes the model and optimizer shards, every rank writes its RNG state, and rank 0
commits atomically (training/checkpointing/io.py). Loading reads logical tensors by name, so a checkpoint from
any layout loads into any other; optimizer state reshards like the parameters. RNG state is restored
only when the layout is unchanged (it is per rank).
"""
from __future__ import annotations

import dataclasses
import os
import random
import shutil
from typing import Any, Optional

import numpy as np
import torch
import torch.nn as nn

from llamapipe.training.checkpointing import io as cio
from llamapipe.training.checkpointing.io import latest_checkpoint  # noqa: F401  (part of this module's API)
from llamapipe.training.config import Config
from llamapipe.core.logger import get_logger
from llamapipe.core.parallel_state import ParallelState
from llamapipe.training.checkpointing.resharding import TensorSpec, named_tensors, padded_rows_for, spec_of, split_shard
from llamapipe.core.tensor_parallel.random import get_rng_tracker
from llamapipe.model.config import LlamaConfig

# Model fields a checkpoint fixes, with the flag that sets each (RoPE base and norm epsilon change the
# function without changing any shape, so they are checked too).
_MODEL_FIELDS = {"num_layers": "--num-layers", "hidden_size": "--hidden-size", "ffn_hidden_size": "--ffn-hidden-size",
                 "num_attention_heads": "--num-attention-heads", "num_query_groups": "--num-query-groups",
                 "vocab_size": "--vocab-size (or --tokenizer-model)",
                 "tie_word_embeddings": "--tie-embeddings-and-output-weights", "rope_theta": "--rotary-base",
                 "norm_epsilon": "--norm-epsilon", "kv_channels": "--kv-channels", "rotary_percent": "--rotary-percent"}


@dataclasses.dataclass(frozen=True)
class LoadResult:
    iteration: int
    consumed_samples: int


def _barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def _layout(ps: ParallelState) -> dict:
    return {"world_size": ps.world_size, "tp": ps.tp_size, "pp": ps.pp_size, "vpp": ps.vpp_size,
            "dp": ps.dp_size, "order": ps.order}


def save_checkpoint(save_dir: str, iteration: int, *, model_chunks: list[nn.Module], optimizer: Any,
                    scheduler: Any, parallel_state: Optional[ParallelState], config: Config,
                    consumed_samples: int, keep_last_n: Optional[int] = None) -> None:
    """Write `<save_dir>/iter_XXXXXXX/` atomically; collective over all ranks."""
    ps = parallel_state or ParallelState()
    tmp = cio.iter_dir(save_dir, iteration) + ".tmp"
    if ps.rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # leftover of a crashed save of this iteration
        os.makedirs(tmp)
    _barrier()
    tensors = named_tensors(model_chunks)
    specs = {name: spec_of(t) for name, t in tensors.items()}
    # collective under ZeRO-1; only dp_rank 0 (the writer) keeps the gathered state
    optim_state = optimizer.state_dict(keep=ps.dp_rank == 0) if optimizer is not None else None
    if ps.dp_rank == 0:
        cio.write_shard_file(os.path.join(tmp, cio.shard_name("model", ps.tp_rank, ps.pp_rank)),
                             tensors, specs, ps.tp_rank, ps.pp_rank)
        if optim_state is not None:
            _write_optimizer_shard(tmp, optim_state, specs, ps)
    if ps.rank == 0 and optim_state is not None:
        cio.torch_save({k: v for k, v in optim_state.items() if k != "param_state"},
                       os.path.join(tmp, cio.OPTIM_COMMON))
    cio.torch_save(_rng_state(), os.path.join(tmp, cio.rng_name(ps.rank)))
    _barrier()
    if ps.rank == 0:
        cio.write_metadata(tmp, iteration=iteration, consumed_samples=consumed_samples,
                           model_config=dataclasses.asdict(config.model), config=dataclasses.asdict(config),
                           layout=_layout(ps), has_optimizer=optim_state is not None,
                           scheduler=scheduler.state_dict() if scheduler is not None else None)
        final = cio.commit(tmp, save_dir, iteration)
        if keep_last_n is not None:
            cio.prune(save_dir, keep_last_n)
        get_logger().info(f"saved checkpoint {final} (iteration {iteration}, consumed samples {consumed_samples})")
    _barrier()


def _write_optimizer_shard(tmp: str, optim_state: dict, specs: dict[str, TensorSpec], ps: ParallelState) -> None:
    tensors, key_specs = {}, {}
    for name, fields in optim_state["param_state"].items():
        assert name in specs, f"optimizer state for {name}, which no model chunk holds"
        for field, value in fields.items():
            assert torch.is_tensor(value), f"optimizer state {name}/{field} is not a tensor"
            tensors[f"{name}/{field}"], key_specs[f"{name}/{field}"] = value, specs[name]
    cio.write_shard_file(os.path.join(tmp, cio.shard_name("optim", ps.tp_rank, ps.pp_rank)),
                         tensors, key_specs, ps.tp_rank, ps.pp_rank)


def load_checkpoint(load_dir: str, *, model_chunks: list[nn.Module], optimizer: Any, scheduler: Any,
                    parallel_state: Optional[ParallelState], config: Config, no_load_optim: bool = False,
                    no_load_rng: bool = False, finetune: bool = False) -> Optional[LoadResult]:
    """Load the newest complete checkpoint into this rank's chunks; None when there is none."""
    ps = parallel_state or ParallelState()
    found = _agreed_latest(load_dir)
    if found is None:
        get_logger().info(f"no complete checkpoint in {load_dir}; starting from scratch")
        return None
    iteration, path = found
    reader = cio.CheckpointReader(path)
    _check_model_config(reader.meta["model_config"], config.model, path)
    tensors = named_tensors(model_chunks)
    for name, target in tensors.items():
        if not reader.has(name):
            raise ValueError(f"checkpoint {path} has no tensor {name}, so it was saved from a different model")
        with torch.no_grad():
            target.copy_(_local_shard(target, reader, name, "model", ps))
    if not (finetune or no_load_optim):
        if optimizer is not None:
            _load_optimizer(reader, optimizer, tensors, ps)
        if scheduler is not None and reader.meta["scheduler"] is not None:
            scheduler.load_state_dict(reader.meta["scheduler"])
    elif optimizer is not None:
        optimizer.reload_model_params()  # fp32 masters must follow the loaded (bf16/fp16) weights
    if not (finetune or no_load_rng):
        _load_rng(reader, ps)
    _barrier()
    get_logger().info(f"loaded checkpoint {path} (iteration {iteration})" + (" for finetuning" if finetune else ""))
    if finetune:
        return LoadResult(0, 0)
    return LoadResult(iteration, int(reader.meta["consumed_samples"]))


def _agreed_latest(load_dir: str) -> Optional[tuple[int, str]]:
    """Rank 0 picks the checkpoint and every rank takes its word (file systems may disagree briefly)."""
    found = cio.latest_checkpoint(load_dir) if _rank() == 0 else None
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        choice = torch.tensor([found[0] if found else -1], dtype=torch.int64)
        torch.distributed.broadcast(choice, src=0)
        iteration = int(choice.item())
        found = (iteration, cio.iter_dir(load_dir, iteration)) if iteration >= 0 else None
    if found is not None and cio.incomplete_reason(found[1]) is not None:
        raise ValueError(f"checkpoint {found[1]} chosen by rank 0 is not complete on this rank's file system")
    return found


def _rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


def _check_model_config(saved: dict, current: LlamaConfig, path: str) -> None:
    for field, flag in _MODEL_FIELDS.items():
        if field in saved and saved[field] != getattr(current, field):
            raise ValueError(f"checkpoint {path} was saved with {field} {saved[field]} but this run has "
                             f"{getattr(current, field)}; set {flag} {saved[field]}")


def _local_shard(param: torch.Tensor, reader: cio.CheckpointReader, key: str, kind: str,
                 ps: ParallelState) -> torch.Tensor:
    """This rank's shard of logical tensor `key`, split like `param` (vocabulary rows re-padded)."""
    spec = spec_of(param)
    rows = padded_rows_for(param, spec, ps.tp_size)
    shard = split_shard(reader.logical(key, kind, rows if spec.vocab_padded else None), spec,
                        ps.tp_size, ps.tp_rank, rows)
    if shard.shape != param.shape:
        raise ValueError(f"checkpoint {reader.path}: {kind} tensor {key} has shard shape {tuple(shard.shape)} "
                         f"for tp rank {ps.tp_rank} but the model expects {tuple(param.shape)}")
    return shard


def _load_optimizer(reader: cio.CheckpointReader, optimizer: Any, tensors: dict[str, torch.Tensor],
                    ps: ParallelState) -> None:
    hint = "pass --no-load-optim to load the model weights only"
    if not reader.meta["has_optimizer"]:
        raise ValueError(f"checkpoint {reader.path} has no optimizer state; {hint}")
    fields: dict[str, list[str]] = {}
    for key in reader.keys("optim"):
        name, field = key.rsplit("/", 1)
        fields.setdefault(name, []).append(field)
    param_state, done = {}, set()
    for name, target in tensors.items():
        if not isinstance(target, nn.Parameter) or not target.requires_grad or id(target) in done:
            continue
        if name not in fields:
            raise ValueError(f"checkpoint {reader.path} has no optimizer state for parameter {name}; {hint}")
        done.add(id(target))
        param_state[name] = {field: _local_shard(target, reader, f"{name}/{field}", "optim", ps)
                             .to(target.device, copy=True)
                             for field in fields[name]}
    common = reader.load_pt(cio.OPTIM_COMMON)
    try:
        optimizer.load_state_dict({"param_state": param_state, **common})
    except (KeyError, ValueError, RuntimeError) as exc:
        raise ValueError(f"the optimizer state in {reader.path} does not fit this optimizer ({exc}); {hint}") from None


def _rng_state() -> dict:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)]}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    state["tp_tracker"] = get_rng_tracker().get_states()
    return state


def _load_rng(reader: cio.CheckpointReader, ps: ParallelState) -> None:
    if reader.meta["layout"] != _layout(ps):
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
