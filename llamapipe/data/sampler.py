"""Data-parallel, resumable batch sampling (Megatron's pretraining sampler) and `build_data_iterators`.

Samples are read in dataset order (the dataset is already shuffled). The global batch that starts after
c consumed samples holds samples [c, c + gbs); it is cut into chunks of mbs x dp samples, and microbatch j
of DP rank r is

    samples  c + j * (mbs * dp) + r * mbs  ...  + mbs - 1

so the union over DP ranks of a global batch is the same set for every dp, and resuming at
consumed_samples = k continues exactly where an uninterrupted run would be (no replay, no skip). The
sampler only streams chunks, so a global batch that grows (--rampup-batch-size) is simply more chunks.
Only the first and last pipeline stages read data (every stage with packed documents, whose attention needs
the documents' boundaries); all TP ranks of a DP rank read the same samples.
"""
from __future__ import annotations

import signal
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from llamapipe.core.config import DataConfig, TrainingConfig
from llamapipe.core.num_microbatches_calculator import microbatches_per_step, samples_for_iters
from llamapipe.data.gpt_dataset import MockGPTDataset, build_gpt_datasets
from llamapipe.data.packed_documents import PackedDocuments


class PretrainingSampler:
    """Batch sampler: this DP rank's microbatches of samples [consumed_samples, total_samples)."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int, dp_rank: int,
                 dp_size: int) -> None:
        assert 0 <= dp_rank < dp_size and micro_batch_size > 0
        if consumed_samples % (micro_batch_size * dp_size):
            raise ValueError(f"consumed samples {consumed_samples} is not a multiple of micro-batch-size "
                             f"({micro_batch_size}) x data-parallel size ({dp_size})")
        if consumed_samples > total_samples:
            raise ValueError(f"consumed samples {consumed_samples} exceed the {total_samples} samples the "
                             "training iterations consume (--train-iters or --train-samples)")
        self.total, self.consumed, self.mbs, self.dp_rank, self.dp_size = (
            total_samples, consumed_samples, micro_batch_size, dp_rank, dp_size)

    def __len__(self) -> int:
        return (self.total - self.consumed) // (self.mbs * self.dp_size)

    def __iter__(self) -> Iterator[list[int]]:
        chunk = self.mbs * self.dp_size
        for start in range(self.consumed, self.total - chunk + 1, chunk):
            first = start + self.dp_rank * self.mbs
            yield list(range(first, first + self.mbs))


class EvalSampler(PretrainingSampler):
    """Cycles forever over the first num_samples samples: every evaluation scores the same batches."""

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            yield from super().__iter__()


# What people and schedulers send to end or warn a job (Ctrl-C, SLURM's --signal=USR1@120, --exit-signal's choices)
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT,
                 signal.SIGXCPU)


def ignore_stop_signals(worker_id: int) -> None:
    """DataLoader worker_init_fn: stop signals are the training process's to act on. torchrun (and SLURM, and a
    terminal's Ctrl-C) signal a rank's whole process group, workers included; a worker that died of it would
    take the rank down before --exit-signal-handler could save. The worker still exits when its rank does (it
    watches it), and a rank that stops without saving kills it (training/signals)."""
    for sig in _STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def _loader(dataset, sampler, num_workers: int) -> Iterator[dict]:
    return iter(torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                                            persistent_workers=num_workers > 0,
                                            worker_init_fn=ignore_stop_signals if num_workers > 0 else None))


def build_data_iterators(data_cfg: DataConfig, training_cfg: TrainingConfig, *, dp_rank: int, dp_size: int,
                         vocab_size: int, consumed_samples: int = 0,
                         needs_data: bool = True) -> tuple[Optional[Iterator], Optional[Iterator], Optional[Iterator]]:
    """(train, valid, test) iterators of this DP rank's microbatches {tokens, labels, loss_mask}, each (mbs, s),
    with position_ids and document_ids (mbs, s) under --reset-position-ids / --reset-attention-mask.

    train yields the microbatches of train_iters global batches (growing under --rampup-batch-size) that
    follow consumed_samples. valid and
    test (None when --eval-iters is 0 or their --split share is 0) cycle over the first eval_iters global
    batches of their split, so each evaluation that draws eval_iters x num_microbatches microbatches sees
    the same samples. Collective when torch.distributed is initialised and --data-path is used: every
    rank calls it (needs_data=False ranks only join the barrier); global rank 0 builds the index caches
    first, the others load them.
    """
    mbs, gbs = training_cfg.micro_batch_size, training_cfg.global_batch_size
    microbatches_per_step(gbs, mbs, dp_size)    # the flags were checked; a config built in code is checked here
    eval_samples = training_cfg.eval_iters * gbs
    num_samples = [samples_for_iters(training_cfg.train_iters, gbs, training_cfg.rampup_batch_size),
                   eval_samples if data_cfg.has_split(1) else 0,
                   eval_samples if data_cfg.has_split(2) else 0]
    if data_cfg.mock_data:
        if not needs_data:
            return None, None, None
        documents = PackedDocuments.of(data_cfg)
        datasets = [MockGPTDataset(n, training_cfg.seq_length, vocab_size, training_cfg.seed + 1000 * i, documents)
                    if n else None for i, n in enumerate(num_samples)]
    else:
        datasets = _build_on_rank0_first(data_cfg, training_cfg, num_samples, needs_data, vocab_size)
        if datasets is None:
            return None, None, None
    train = _loader(datasets[0], PretrainingSampler(num_samples[0], consumed_samples, mbs, dp_rank, dp_size),
                    data_cfg.num_workers)
    evals = [_loader(ds, EvalSampler(n, 0, mbs, dp_rank, dp_size), data_cfg.num_workers) if ds is not None else None
             for ds, n in zip(datasets[1:], num_samples[1:])]
    return train, evals[0], evals[1]


def _build_on_rank0_first(data_cfg: DataConfig, training_cfg: TrainingConfig, num_samples: list[int],
                          needs_data: bool, vocab_size: int):
    distributed = dist.is_available() and dist.is_initialized()
    rank0 = not distributed or dist.get_rank() == 0
    if distributed and not rank0:
        dist.barrier()      # wait until rank 0 has written the index caches
    datasets = None
    try:
        if needs_data or rank0:
            datasets = build_gpt_datasets(data_cfg.data_path, data_cfg.split, num_samples, training_cfg.seq_length,
                                          training_cfg.seed, data_cfg.data_cache_path,
                                          per_split_paths=data_cfg.per_split_paths, vocab_size=vocab_size,
                                          documents=PackedDocuments.of(data_cfg))
    finally:
        if distributed and rank0:
            dist.barrier()   # also when rank 0's data is refused: the others then meet the same error
    return datasets if needs_data else None
