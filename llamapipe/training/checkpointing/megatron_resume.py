"""`--load` of a Megatron-LM save directory in training (issue 49): which source a --load resumes from, and a
Megatron save staged as a checkpoint of ours so that the one load path (save_load.py) resumes it in any layout.

Sources, in this order: `<load>/llamapipe/` (where `--ckpt-format torch_dist` keeps our own checkpoints beside
Megatron's `iter_*`, megatron_save.py) when its newest checkpoint is at least Megatron's tracked iteration; our
checkpoints in `<load>`; a Megatron save (torch_dist or legacy). A Megatron save is read by rank 0 with
convert_megatron's reader and written as one checkpoint of ours in the staging directory `<--save or
--load>/megatron_import.tmp/`; every rank waits for it (barrier, one error line for all), the ordinary load
resumes from it (it reads logical tensors, so the staged tp 1 x pp 1 loads into any layout), and it is removed.

Staged from the Megatron save: the weights; the iteration and consumed samples (common.pt `iteration`,
`args.consumed_train_samples`); the LR schedule (common.pt `opt_param_scheduler`: Megatron counts it in
samples, so an iteration-based run divides by `args.global_batch_size`); Adam's moments, the fp32 master
weights and the step where the save holds them per parameter: `optimizer.state.{exp_avg,exp_avg_sq,fp32_param}.
<param>` and common.pt's `common_step` (the non-distributed optimizer, tested), or `optimizer.state.{exp_avg,
exp_avg_sq,param}.<param>` and the param groups' `step` (the distributed one with
`--dist-ckpt-optim-fully-reshardable`, megatron-core 0.16.1's names; no CPU test makes one). Not staged: the RNG
state (per rank, CUDA's) and the distributed optimizer's default flattened buffers; such a save resumes with
`--no-load-optim` or `--finetune`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
from typing import Any, Iterator, Optional

import torch

from llamapipe.core.logger import get_logger
from llamapipe.core.optimizer.lr_scheduler import DECAY_STYLES
from llamapipe.training.checkpointing import catalog
from llamapipe.training.checkpointing.selection import is_megatron_save, scan

OURS = catalog.OURS              # our checkpoints inside a --ckpt-format torch_dist save directory
STAGING = "megatron_import.tmp"  # a Megatron save staged as ours, removed after the load
_OPTIM = "optimizer.state."
# Megatron's field -> ours: the non-distributed optimizer's fp32 masters are `fp32_param`, the distributed
# one's (fully_reshardable) `param`
_FIELDS = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "fp32_param": "master_param", "param": "master_param"}


def _newest_complete(directory: str) -> Optional[int]:
    if not os.path.isdir(directory):
        return None
    return next((iteration for iteration, defect in scan(directory) if defect is None), None)


def source(load_dir: str) -> tuple[str, str]:
    """("ours", directory to load) or ("megatron", the Megatron save directory) for `--load load_dir`."""
    inner = os.path.join(load_dir, OURS)
    newest = _newest_complete(inner)
    megatron = is_megatron_save(load_dir)
    if newest is not None and (not megatron or newest >= (catalog.read_tracker(load_dir) or 0)):
        return "ours", inner
    if megatron and _newest_complete(load_dir) is None:
        return "megatron", load_dir
    return "ours", load_dir


def megatron_meta(load_dir: str) -> tuple[dict, str]:
    """(the fields of a checkpoint's metadata.json that --use-checkpoint-args reads, the iter dir) of a Megatron
    save: the model from common.pt's args, the sequence length and the tokenizer's vocabulary size."""
    from llamapipe.training.checkpointing.megatron_read import config_of, iteration_dir, megatron_args_of
    path = iteration_dir(load_dir)
    args = megatron_args_of(path)
    config = config_of(args, path)
    return {"model_config": dataclasses.asdict(config),
            "config": {"training": {"seq_length": getattr(args, "seq_length", None)},
                       "data": {"vocab_size": getattr(args, "vocab_size", None)}}}, path


def scheduler_state(state: Optional[dict], args: Any, counts_samples: bool, override: bool,
                    path: str) -> Optional[dict]:
    """Our OptimizerParamScheduler.state_dict from Megatron's (`opt_param_scheduler`, counted in samples)."""
    if not state:
        return None
    style = state.get("lr_decay_style")
    if style not in DECAY_STYLES and not override:
        raise ValueError(f"{path}: Megatron's LR schedule has lr_decay_style {style!r}, which llamapipe does not "
                         f"implement ({', '.join(DECAY_STYLES)}); pass --override-opt_param-scheduler to take the "
                         "command line's schedule")
    unit = 1 if counts_samples else getattr(args, "global_batch_size", None)
    if not unit or state["num_steps"] % unit:
        raise ValueError(f"{path}: Megatron's LR schedule is at {state['num_steps']} samples, not a whole number of "
                         f"iterations of its global batch size {unit} (a --rampup-batch-size run); resume it with "
                         "--train-samples, which counts samples as Megatron does")

    def steps(value: float) -> float:
        value = value / unit
        return int(value) if float(value).is_integer() else value
    return {"num_steps": state["num_steps"] // unit, "max_lr": state["max_lr"], "min_lr": state["min_lr"],
            "lr_warmup_steps": steps(state["lr_warmup_steps"]), "lr_decay_steps": steps(state["lr_decay_steps"]),
            "lr_decay_style": style}


def optimizer_state(tensors: dict[str, torch.Tensor], common: dict, config: Any,
                    path: str) -> tuple[Optional[dict], str]:
    """(our Optimizer.state_dict form, or None; why None) from a Megatron save's `optimizer.*` tensors."""
    from llamapipe.training.checkpointing.megatron_read import _ours
    from llamapipe.training.checkpointing.megatron_format import fit_rows
    by_field: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        if key.startswith(_OPTIM):
            field, _, name = key[len(_OPTIM):].partition(".")
            by_field.setdefault(field, {})[name] = tensor
    if not {"exp_avg", "exp_avg_sq"} <= set(by_field):
        why = ("its optimizer state is the distributed optimizer's flattened buffers (save it with "
               "--dist-ckpt-optim-fully-reshardable for per-parameter state)" if tensors else
               "it holds no optimizer state that llamapipe reads (a legacy save's is by parameter index)")
        return None, why
    param_state: dict[str, dict[str, torch.Tensor]] = {}
    rows = config.padded_vocab_size(1)
    for field, mine in _FIELDS.items():
        if field in by_field:
            for name, tensor in fit_rows(_ours(by_field[field], config, path), rows).items():
                param_state.setdefault(name, {})[mine] = tensor.float()
    saved = common.get("optimizer") or {}
    groups = saved.get("param_groups") or [{}]    # the distributed optimizer keeps the step in its groups
    step = (saved.get("state") or {}).get("common_step", groups[0].get("step", 0) if isinstance(groups[0], dict)
                                          else 0)
    return {"param_state": param_state, "step": int(step), "grad_scaler": {}}, ""


def stage(load_dir: str, staging: str, run: Any, *, wants_optimizer: bool) -> str:
    """Write the Megatron save in `load_dir` as a checkpoint of ours in `staging`; returns the log line."""
    from llamapipe.training.checkpointing.megatron_read import read_megatron, run_config
    from llamapipe.training.checkpointing.megatron_format import fit_rows
    from llamapipe.training.checkpointing.resharding import model_specs
    from llamapipe.training.checkpointing.io import write_layout
    config, full, common, path, tensors = read_megatron(load_dir)
    args = common["args"]
    optim, why = optimizer_state(tensors, common, config, path)
    if optim is None and wants_optimizer:
        raise ValueError(f"--load {load_dir}: Megatron save {path} cannot resume with its optimizer: {why}; pass "
                         "--no-load-optim (weights and iteration, a fresh optimizer and LR schedule, as in "
                         "Megatron) or --finetune (weights only, iteration 0)")
    ckpt = run.checkpoint
    scheduler = scheduler_state(common.get("opt_param_scheduler"), args, run.training.train_samples is not None,
                                ckpt.override_opt_param_scheduler, path) if wants_optimizer else None
    iteration = int(common.get("iteration", 0) or 0)
    shutil.rmtree(staging, ignore_errors=True)
    write_layout(staging, iteration, fit_rows(full, config.padded_vocab_size(1)), model_specs(config, 1),
                 dataclasses.asdict(config), tp=1, pp=1, config=run_config(config, args),
                 consumed_samples=int(getattr(args, "consumed_train_samples", 0) or 0),
                 optim=optim if wants_optimizer else None, scheduler=scheduler)
    carried = ", ".join(["weights", "iteration", "consumed samples"] + (
        ["Adam's state", "LR schedule" if scheduler else "(no LR schedule saved)"] if wants_optimizer else []))
    return (f"--load {load_dir} is a Megatron-LM save: imported {path} ({carried}) into {staging}, resuming from "
            "it (removed after the load)")


@contextlib.contextmanager
def resolved(load_dir: str, run: Any, rank: int, *, wants_optimizer: bool) -> Iterator[str]:
    """The directory the load reads for `--load load_dir`: a Megatron save is staged first (rank 0; every rank
    gets its one error line) and removed after the load."""
    from llamapipe.training.checkpointing.save_load import _barrier, _from_rank0
    # every rank looks for itself (files only): loading our own checkpoints takes no collective, so a rank may
    # load alone, as resharding tools and tests do; only a Megatron save's staging is agreed on below
    kind, directory = source(load_dir)
    if kind == "ours":
        yield directory
        return
    staging = os.path.join(run.checkpoint.save or load_dir, STAGING)
    outcome: tuple[bool, str] = (True, "")
    if rank == 0:
        try:
            outcome = (True, stage(load_dir, staging, run, wants_optimizer=wants_optimizer))
        except (ValueError, OSError, KeyError) as exc:
            shutil.rmtree(staging, ignore_errors=True)
            outcome = (False, str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)
    ok, line = _from_rank0(outcome)
    if not ok:
        raise ValueError(line)
    if rank == 0:
        get_logger().info(line)
    try:
        yield staging
    except BaseException:
        if rank == 0:     # no barrier: the other ranks may have stopped too
            shutil.rmtree(staging, ignore_errors=True)
        raise
    _barrier()
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
