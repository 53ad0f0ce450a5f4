"""The process-level entry of a training run: check what must be checked before any process group, join the
group (one per job), build the parallel state and the Trainer (training/loop.py), train, and leave every exit
path alike: a background save waited for, the --save lock released, the process groups destroyed while the
interpreter runs. Errors every rank agrees on (a memory limit, a failed save) end in one line from rank 0.
"""
from __future__ import annotations

import random
import sys

import numpy as np
import torch
import torch.distributed as dist

from llamapipe.core.config import ArgumentError
from llamapipe.core.host_memory import keep_freed_host_memory
from llamapipe.core.logger import get_logger
from llamapipe.core.parallel_state import initialize_model_parallel
from llamapipe.training.config import Config
from llamapipe.training.flag_names import flag_message
from llamapipe.training.initialize import first_to_report, init_distributed
from llamapipe.training.log import check_wandb
from llamapipe.training.loop import Trainer
from llamapipe.training.process_control import run_as_one_job
from llamapipe.training.signals import StopReport, stop_on_signals

log = get_logger()


def set_seeds(seed: int, tp_rank: int) -> None:
    """Python, numpy and torch from `seed`; the TP RNG tracker's stream differs per TP rank (Megatron)."""
    from llamapipe.core.tensor_parallel.random import model_parallel_seed
    random.seed(seed)
    np.random.seed(seed % 2 ** 32)
    model_parallel_seed(seed, tp_rank)


def pretrain(config: Config) -> int:
    """Train as `config` says; returns the process exit status."""
    try:
        check_wandb(config.logging)     # every rank alike, before any process group
    except ArgumentError as err:
        if first_to_report():
            sys.stderr.write(f"pretrain_llama.py: error: {err}\n")
        return 2
    with stop_on_signals(config.training.exit_signal, config.training.exit_signal_handler) as stop:
        device = init_distributed(config.parallel)
        if device.type == "cpu" and config.training.keep_host_memory and keep_freed_host_memory():
            log.info("CPU memory: what a training step frees stays in this process for the next step, which "
                     "makes steps faster but keeps the process's memory use at its peak (malloc keeps freed "
                     "memory; --release-host-memory returns it to the system instead)")
        return run_as_one_job(lambda: _build_and_train(config, device, stop))


def _build_and_train(config: Config, device: torch.device, stop: StopReport) -> int:
    """Setup and training on this rank; an error raised here ends the whole job (`run_as_one_job`)."""
    par = config.parallel
    others = {axis: n for axis, n in par.sizes.items() if axis not in ("tp", "pp", "dp")}   # dp: what is left
    ps = initialize_model_parallel(par.tp_size, par.pp_size, par.vpp_size, par.order, **others)
    set_seeds(config.training.seed, ps.tp_rank)
    trainer = Trainer(config, config.model, ps, device)
    stop.state = trainer.state      # a stop signal's line names the iteration reached
    from llamapipe.core.pipeline_parallel.auto_schedule import MemoryLimitError
    from llamapipe.training.checkpointing.save_load import CheckpointSaveError, finalize_async_save
    try:
        status = trainer.train()
        finalize_async_save()    # every exit path waits for a background save (collective)
    except MemoryLimitError as err:  # raised on every rank alike, from measured numbers all ranks share
        if dist.get_rank() == 0:
            sys.stderr.write(f"pretrain_llama.py: error: {flag_message(err)}\n")
        status = 2
    except CheckpointSaveError as err:  # agreed on by all ranks (e.g. a full disk on one)
        if dist.get_rank() == 0:
            sys.stderr.write(f"pretrain_llama.py: error: {err}\n")
        status = 1
    finally:
        trainer.metrics.close()  # no collective here: a rank-local failure must exit, not wait in a barrier
        trainer.save_lock.release()     # after the last save is finalized; errors before this: atexit
    dist.barrier()
    _release_groups(trainer)
    return status


def _release_groups(trainer: "Trainer") -> None:
    """Destroy the process groups while the interpreter runs, not at its exit: a gloo group still referenced
    at interpreter teardown (by the module's ParallelState, or by chunks, optimizer and communicators waiting
    for the cycle collector) is destroyed among C++ statics and can abort a finished run ('terminate called
    without an active exception', exit -6 after 'training done', seen about once per full test suite)."""
    from llamapipe.core.parallel_state import destroy_model_parallel
    trainer.__dict__.clear()         # chunks, optimizer, step, communicators: their group handles go with them
    destroy_model_parallel()
    dist.destroy_process_group()
