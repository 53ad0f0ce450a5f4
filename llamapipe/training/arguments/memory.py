"""Sizes that cannot fit in this machine's memory at all, refused before any process group (issue 32).

Two lower bounds, each far below what a run really needs: a rank's share of the weights (parameters /
(tp x pp), / (dp x cp) under ZeRO-3) in the parameter dtype, and one microbatch's logits on the last stage
(micro-batch x seq-length / cp x vocabulary / tp: context parallelism splits the sequence). On CPU the ranks of a node share its memory, so the weights
count once per local rank; on GPU each rank has its device's memory. A run that passes may still run out
of memory; one that fails could never start, and without this check would allocate for minutes first.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from llamapipe.core.config import ArgumentError, ParallelConfig, TrainingConfig
from llamapipe.model.llama import LlamaConfig
from llamapipe.model.families import model_parameters


def machine_memory_bytes(backend: str) -> Optional[int]:
    """Memory one rank can use at most: its GPU's (nccl), else the host's physical memory; None if unknown."""
    if backend == "nccl" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", "0"))).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _gib(n: float) -> str:
    return f"{n / 2 ** 30:.1f} GiB"


def check_fits_memory(m: LlamaConfig, par: ParallelConfig, training: TrainingConfig, half: bool,
                      memory: Optional[int], local_ranks: int = 1) -> None:
    """Raise ArgumentError when a lower bound of one rank's memory exceeds `memory` bytes (None: no check)."""
    if memory is None:
        return
    where = "its GPU's" if par.distributed_backend == "nccl" else "this machine's"
    ranks = 1 if par.distributed_backend == "nccl" else max(local_ranks, 1)
    dtype, width = ("bf16/fp16", 2) if half else ("fp32", 4)
    zero3 = par.data_parallel_sharding_strategy == "optim_grads_params"
    replicas = par.dp_size * par.cp_size        # ZeRO-3 shards over every rank holding the same weights
    shards = par.tp_size * par.pp_size * (replicas if zero3 else 1)
    params = model_parameters(m, par.tp_size)
    weights = params / shards * width
    if weights * ranks > memory:
        split = f"tp {par.tp_size} x pp {par.pp_size}" + (f" x dp x cp {replicas} (ZeRO-3)" if zero3 else "")
        on = f", x {ranks} ranks on this machine" if ranks > 1 else ""
        raise ArgumentError(f"the weights alone need {_gib(weights)} per rank ({params / 1e9:.2f} billion "
                            f"parameters in {dtype} / ({split}){on}), more than {where} {_gib(memory)} of memory; "
                            "use a larger --tensor-model-parallel-size or --pipeline-model-parallel-size, or a "
                            "smaller model")
    tokens = training.micro_batch_size * training.seq_length // par.cp_size
    logits = tokens * m.padded_vocab_size(par.tp_size) / par.tp_size * 4
    if logits > memory:
        cp = f" / cp {par.cp_size}" if par.cp_size > 1 else ""
        raise ArgumentError(f"one microbatch's logits need {_gib(logits)} (--micro-batch-size "
                            f"{training.micro_batch_size} x --seq-length {training.seq_length}{cp} x vocabulary "
                            f"{m.padded_vocab_size(par.tp_size)} / tp {par.tp_size} in fp32), more than {where} "
                            f"{_gib(memory)} of memory; lower --micro-batch-size or --seq-length")
