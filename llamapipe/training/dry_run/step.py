"""One training step of the real executor on meta tensors, for one pipeline rank.

The step runs as the training loop runs it: this rank's plan (the schedule's builder, verified by the
simulator), `setup.forward_step`, the job's runtime options (`setup.build_runtime_options`:
the overlapped gradient reduction among them) with the dry run's communicator (`messages`), then the end of
step gradient reduction (`finalize_model_grads`). The data are meta batches with the real sample's fields and
dtypes (`gpt_dataset.make_sample`), so nothing is read. Every action of the plan runs; what the executor keeps
alive is followed as it goes (`LiveActivations`: the storages autograd saved behind each forward and the
tensors each deferred weight gradient holds until its W), which gives the activations at the plan's real peak,
and the simulator's unit to express it in (what `auto` and `plan` reason in, `ActivationProbe`'s): the bytes
one microbatch's forward saves on the largest chunk.

The meta device has no attention kernels of its own: scaled_dot_product_attention on meta tensors takes the
math path, which saves the s x s scores that a flash kernel (the GPU's, or the CPU's) never stores. The step
therefore runs the meta attention through the flash kernel's op (`flash_attention_on_meta`), whose meta
implementation saves what the real kernel saves: q, k, v (the grouped keys and values unexpanded), the output
and its log-sum-exp.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import weakref
from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np
import torch

from llamapipe.core.distributed.grad_reduce import finalize_model_grads
from llamapipe.core.parallel_state import ParallelState
from llamapipe.core.pipeline_parallel import executor
from llamapipe.core.pipeline_parallel.activation_memory import saved_storages, storage_id
from llamapipe.core.pipeline_parallel.runtime import StepObserver
from llamapipe.core.pipeline_parallel.schedule_ir import Plan
from llamapipe.core.pipeline_parallel.schedules import cached_plan
from llamapipe.core.pipeline_parallel.seq_split import piece_iterators
from llamapipe.core.pipeline_parallel.simulator import verify
from llamapipe.data.gpt_dataset import make_sample
from llamapipe.training.config import Config
from llamapipe.training.dry_run.messages import DryRunCommunicator, MessageLedger, expected_spec
from llamapipe.training.setup import build_runtime_options, forward_step, params_dtype, seq_splits


@dataclass(frozen=True)
class StepResult:
    """What one pipeline rank's step on meta tensors measured (bytes)."""
    activations: int            # live activations at the step's peak (on the device)
    offloaded: int              # the most activations held in host memory (--cpu-offload), else 0
    peak_units: float           # the same in the simulator's units: microbatches of the largest chunk...
    unit_bytes: int             # ...whose forward saves this many bytes
    grads: int                  # the gradients the step accumulated
    actions: int                # actions of this rank's plan that ran


class LiveActivations(StepObserver):
    """Live bytes of the storages saved behind each forward and held by the deferred weight gradients, and
    their peak over the step; storages are followed with weak references, so a freed one stops counting."""

    def __init__(self, chunks: Iterable[torch.nn.Module]) -> None:
        self.exclude = {storage_id(t.untyped_storage()) for c in chunks for t in [*c.parameters(), *c.buffers()]}
        self.live = self.peak = 0
        self.store = None               # the step's offload store (--cpu-offload): what it holds on the device
        self.host_peak = 0              # the most it held in host memory
        self.unit = 0                   # the most one forward saved: the simulator's unit (ActivationProbe's)
        self.tracked: dict[int, int] = {}

    def _track(self, storages: Iterable[torch.UntypedStorage]) -> None:
        for storage in storages:
            key = storage_id(storage)
            if storage.nbytes() == 0 or key in self.exclude or key in self.tracked:
                continue
            self.tracked[key] = storage.nbytes()
            self.live += storage.nbytes()
            weakref.finalize(storage, self._free, key)
        self.peak = max(self.peak, self.live)

    def _free(self, key: int) -> None:
        self.live -= self.tracked.pop(key, 0)

    def offload_begin(self, store) -> None:
        self.store = store

    def action_done(self, action, start: float, end: float, blocked_s: float) -> None:
        if self.store is not None:      # offloaded forwards' saved tensors are behind the store's hooks
            self.peak = max(self.peak, self.live + self.store.device_bytes())
            self.host_peak = max(self.host_peak, self.store.host_bytes())

    def forward_done(self, key, output: torch.Tensor) -> None:
        if output.grad_fn is not None:
            saved = saved_storages(output, self.exclude).values()
            hooked = self.store.recorded_bytes(key) if self.store is not None else 0
            self.unit = max(self.unit, sum(storage.nbytes() for storage in saved) + hooked)
            self._track(saved)

    def backward_done(self, key, split: bool, held=()) -> None:
        self._track([t.untyped_storage() for t in held if t.is_floating_point()])


def _flash(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
    """scaled_dot_product_attention as the flash kernel's op (the grouped k, v taken as they are)."""
    assert attn_mask is None and not dropout_p, "the flash kernel takes no mask and no dropout"
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)[0]


@contextlib.contextmanager
def flash_attention_on_meta() -> Iterator[None]:
    """While open, scaled_dot_product_attention on meta tensors is the flash kernel's op (the module docstring says
    why): a kernel for its meta autograd key, so activation recompute's second forward takes it too; closing drops
    the registration."""
    library = torch.library.Library("aten", "IMPL")
    library.impl("scaled_dot_product_attention", _flash, "AutogradMeta")
    try:
        yield
    finally:
        del library


def meta_batches(config: Config) -> Iterator[dict]:
    """Microbatches of meta tensors with the fields and dtypes of the real samples, (micro-batch, seq)."""
    cfg = config.training
    sample = make_sample(np.zeros(cfg.seq_length + 1, dtype=np.int64))
    batch = {name: torch.empty((cfg.micro_batch_size, *t.shape), dtype=t.dtype, device="meta")
             for name, t in sample.items()}
    return itertools.repeat(batch)


def job_plan(config: Config, ps: ParallelState) -> Plan:
    """The plan this job's steps run (the profiled schedules: their unit-cost plan), verified by the simulator."""
    par = config.parallel
    plan = cached_plan(par.pipeline_schedule, ps.pp_size, ps.vpp_size, config.training.num_microbatches,
                       par.num_seq_splits)          # Seq1F1B: the microbatches' sequence pieces as units
    if par.vocab_parallel:
        plan = executor.vocab_plan(plan)
    verify(plan)
    return plan


def message_spec(config: Config, ps: ParallelState, kind: str, unit: int = 0) -> tuple:
    """What this rank's receiver expects for a message of `kind` (`messages.expected_spec`) of plan unit `unit`
    (under Seq1F1B a piece, whose length its boundaries give)."""
    par, cfg = config.parallel, config.training
    seq = cfg.seq_length
    splits = seq_splits(config)
    if splits is not None:
        bounds = splits.bounds(seq)
        seq = bounds[unit % splits.count + 1] - bounds[unit % splits.count]
    return expected_spec(kind, seq_length=seq, micro_batch=cfg.micro_batch_size,
                         hidden=config.model.hidden_size, cp=ps.cp_size,
                         sp_tp=ps.tp_size if par.sequence_parallel else 1, dtype=params_dtype(config))


def storage_bytes(tensors: Iterable) -> int:
    """Bytes of the distinct storages behind `tensors` (None entries skipped), on any device."""
    storages = {storage_id(t.untyped_storage()): t.untyped_storage().nbytes() for t in tensors if t is not None}
    return sum(storages.values())


def run_step(config: Config, ps: ParallelState, chunks: list[torch.nn.Module], roles: list[tuple[bool, bool]],
             ledger: MessageLedger) -> StepResult:
    """One step of this rank's plan on its meta chunks; messages go into `ledger`."""
    plan = job_plan(config, ps)
    live = LiveActivations(chunks)
    options = build_runtime_options(config, ps, chunks, observers=(live,))
    options = dataclasses.replace(options, communicator=functools.partial(
        DryRunCommunicator, ledger=ledger, expect=functools.partial(message_spec, config, ps)))
    batches = meta_batches(config)
    packed = config.data.packed_documents            # every chunk reads them then (setup.build_iterators)
    iterators = [batches if pre or post or packed else None for pre, post in roles]
    if config.parallel.vocab_parallel:
        iterators.append(batches)       # the vocabulary-parallel embedding's, on every rank
    m = config.training.num_microbatches
    if options.seq_splits is not None:         # Seq1F1B: each microbatch's pieces, as ForwardBackward cuts them
        iterators, m = piece_iterators(iterators, options.seq_splits), m * options.seq_splits.count
    with flash_attention_on_meta():
        executor.run(plan, model_chunks=chunks, forward_step_func=forward_step, data_iterator=iterators,
                     parallel_state=ps, num_microbatches=m, options=options)
    params = [p for chunk in chunks for p in chunk.parameters() if p.requires_grad]
    grads = storage_bytes(p.grad for p in params)
    finalize_model_grads(chunks, ps, None, bucket_size=config.parallel.ddp_bucket_size,
                         overlap_grad_reduce=config.parallel.overlap_grad_reduce,
                         global_tokens=config.training.global_batch_size * config.training.seq_length,
                         grad_sync=options.grad_sync)
    unit = live.unit
    return StepResult(activations=live.peak, offloaded=live.host_peak,
                      peak_units=live.peak / unit if unit else 0.0, unit_bytes=unit,
                      grads=grads, actions=len(plan.actions[ps.pp_rank]))
