"""One role of the dry run: the real setup of its rank on fake process groups and meta tensors.

In the role's fake world (`world.role_world`): the parallel state and its groups against the rank grid, the
model chunks on the meta device (`setup.build_model_chunks`), one training step (`step.run_step`), the
data-parallel sharding (ZeRO-2/3 wrap the chunks with FSDP2 after the step: FSDP2 refuses to train meta
parameters, and the step's work does not depend on it), the optimizer (`build_optimizer`: ZeRO-1's range)
with its Adam state made by torch's own first step on meta, and the checkpoint files this rank would write.
Ranks of one pipeline stage that differ only in their tp or cp index hold shards of the same shapes, so their
steps are the same on meta: the step runs once per distinct shard and the others reuse its result
(`RoleRun.steps`); the steps answer repeated meta operations from one cache (`meta_cache`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

import torch

from llamapipe.core.comm_memory import a2a_buffer_bytes, fsdp_gather_bytes, grad_bucket_bytes, p2p_receive_bytes, \
    zero1_gather_bytes
from llamapipe.core.config import FSDP_STRATEGIES
from llamapipe.core.distributed.fsdp import apply_data_parallel_sharding, is_sharded, local_tensor
from llamapipe.core.optimizer import build_optimizer
from llamapipe.core.parallel_state import ParallelState
from llamapipe.core.pipeline_parallel.activation_memory import storage_id
from llamapipe.training.config import Config
from llamapipe.training.dry_run import checkpoint as ckpt
from llamapipe.training.dry_run.messages import MessageLedger
from llamapipe.training.dry_run.meta_cache import MetaOpCache
from llamapipe.training.dry_run.step import StepResult, run_step, storage_bytes
from llamapipe.training.dry_run.world import GridGroups, Role, check_groups, grid_of, role_world
from llamapipe.training.setup import build_model_chunks, chunk_stages

META = torch.device("meta")


@dataclass
class RoleReport:
    """What one role holds, in bytes (parameter counts in elements)."""
    role: Role
    stages: list[int]                 # virtual stage of each local chunk
    layers: list[int]                 # decoder layers of each local chunk
    own_params: int                   # elements only this role's (tp, pp) shard holds (tp-replicated: at tp 0)
    params: int
    grads: int
    optimizer: int
    activations: int
    comm: int
    step: StepResult
    zero: str
    files: list[tuple[str, int]]     # the checkpoint files it writes
    resume: Optional[ckpt.ResumeReads]   # what a resume reads (None: no --load)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.comm


@dataclass
class RoleRun:
    """The job-wide state of a dry run: its config, the message ledger and the steps run so far by shard."""
    config: Config
    ledger: MessageLedger = field(default_factory=MessageLedger)
    steps: dict[tuple, StepResult] = field(default_factory=dict)
    resume: Optional[ckpt.ResumeSource] = None

    def __post_init__(self) -> None:
        self.grid = GridGroups(grid_of(self.config.parallel))
        self.op_cache = MetaOpCache()           # shared by the steps: stages repeat each other's shapes

    def run(self, role: Role) -> RoleReport:
        config, par = self.config, self.config.parallel
        with role_world(role, par) as ps:
            check_groups(ps, self.grid)
            stepped = _without_fsdp(config)
            chunks, roles = build_model_chunks(stepped, config.model, ps, META)
            key = _shard_key(ps, chunks, roles)
            if key not in self.steps:
                with self.op_cache:
                    self.steps[key] = run_step(stepped, ps, chunks, roles, self.ledger)
            step = self.steps[key]
            for chunk in chunks:
                chunk.zero_grad(set_to_none=True)
            # what is counted on the whole (tp, pp) shard comes before FSDP splits it over dp
            comm = _comm_bytes(config, ps, chunks, self.ledger)
            files = ckpt.files_written(chunks, config, ps)
            resume = self.resume.check(chunks, config) if self.resume is not None else None
            own = _own_params(chunks, ps)
            apply_data_parallel_sharding(chunks, par.data_parallel_sharding_strategy, ps)
            optimizer = build_optimizer(chunks, config.optimizer, ps)
            params = [local_tensor(p) for chunk in chunks for p in chunk.parameters()]
            optim, zero = optimizer_state_bytes(optimizer, params), _zero_text(optimizer, chunks, ps)
            if config.optimizer.optimizer_cpu_offload:      # not on the GPU: said, not counted
                optim, zero = 0, f"{zero}; optimizer state in host memory ({optim / 2 ** 30:.2f} GiB a rank)"
            return RoleReport(
                role=role, stages=chunk_stages(config, ps), layers=[len(c.layers) for c in chunks], own_params=own,
                params=storage_bytes(params), grads=step.grads, optimizer=optim, activations=step.activations,
                comm=comm + _zero1_gather_bytes(optimizer, params), step=step, zero=zero, files=files, resume=resume)


def _without_fsdp(config: Config) -> Config:
    """The config the step runs under: FSDP's sharding comes after it (the module docstring says why), and
    --compile changes no shape."""
    par, cfg = config.parallel, config.training
    if par.data_parallel_sharding_strategy in FSDP_STRATEGIES:
        par = dataclasses.replace(par, data_parallel_sharding_strategy="no_shard", overlap_grad_reduce=False)
    return dataclasses.replace(config, parallel=par, training=dataclasses.replace(cfg, compile=False))


def _shard_key(ps: ParallelState, chunks: list[torch.nn.Module], roles: list) -> tuple:
    """What a step on meta depends on: the pipeline position, the chunks' roles and their parameters' shapes."""
    shapes = tuple((name, tuple(p.shape), p.dtype) for c in chunks for name, p in c.named_parameters())
    return ps.pp_rank, tuple(roles), shapes


def _own_params(chunks: list[torch.nn.Module], ps: ParallelState) -> int:
    """Elements of this (tp, pp) shard counted once over the job: a split tensor's part on every tp rank, a
    tp-replicated one (a norm) on tp rank 0 only. A DTensor's numel is its whole (unsharded over dp) shard."""
    total = 0
    for chunk in chunks:
        for p in chunk.parameters():
            split = getattr(p, "tensor_model_parallel", False) or hasattr(p, "vocab_shards")
            total += p.numel() if split or ps.tp_rank == 0 else 0
    return total


def optimizer_state_bytes(optimizer, params: list[torch.Tensor]) -> int:
    """Adam's moments, made by torch's first step on the meta mains (their real shapes and dtypes), and the
    fp32 masters that are not the model's own parameters."""
    for main in optimizer.mains:
        main.grad = torch.zeros_like(main)
    optimizer.inner.step()
    for main in optimizer.mains:
        main.grad = None
    own = {storage_id(p.untyped_storage()) for p in params}
    state = [t for s in optimizer.inner.state.values() for k, t in s.items() if k != "step"]
    masters = [m for m in optimizer.mains if storage_id(m.untyped_storage()) not in own]
    return storage_bytes(state + masters)


def _comm_bytes(config: Config, ps: ParallelState, chunks: list[torch.nn.Module], ledger: MessageLedger) -> int:
    """Communication buffers beside the activations, as `comm_memory` counts them (the planner's model too): the
    receives posted ahead for the largest message of each peer, and the data-parallel reduction's flat buckets or,
    under ZeRO-2/3, FSDP's gathered weights."""
    p2p = p2p_receive_bytes(ledger.largest_from_peers(ps.pp_rank).values())
    par = config.parallel
    params = [p for chunk in chunks for p in chunk.parameters() if p.requires_grad]
    if par.cp_size > 1 and par.cp_comm_type in ("a2a", "a2a+p2p"):   # all-to-all buffers of one attention
        m, tokens = config.model, config.training.seq_length // par.cp_size * config.training.micro_batch_size
        p2p += a2a_buffer_bytes(tokens, m.num_attention_heads // par.tp_size, m.num_query_groups // par.tp_size,
                                m.head_dim, max(p.dtype.itemsize for p in params))
    if par.data_parallel_sharding_strategy in FSDP_STRATEGIES and ps.dp_cp_size > 1:
        units = [sum(p.numel() * p.dtype.itemsize for p in unit.parameters()) for chunk in chunks
                 for unit in chunk.layers.values()]
        return p2p + fsdp_gather_bytes(units, par.data_parallel_sharding_strategy)
    return p2p + grad_bucket_bytes([p.numel() for p in params], par.ddp_bucket_size, par.overlap_grad_reduce)


def _zero1_gather_bytes(optimizer, params: list[torch.Tensor]) -> int:
    """ZeRO-1's all-gather of the updated parameters (`comm_memory.zero1_gather_bytes`)."""
    if not optimizer.sharded:
        return 0
    return zero1_gather_bytes(optimizer.layout.padded_total, max(p.dtype.itemsize for p in params))


def _zero_text(optimizer, chunks: list[torch.nn.Module], ps: ParallelState) -> str:
    if is_sharded(chunks):
        return f"ZeRO-2/3 (FSDP2): parameters, gradients and optimizer state in 1/{ps.dp_cp_size} shards"
    if optimizer.sharded:
        mine = sum(seg.end - seg.start for seg in optimizer.segments)
        return (f"ZeRO-1: this rank steps {mine:,} of {optimizer.layout.total:,} parameters "
                f"(1/{ps.dp_cp_size}, {len(optimizer.segments)} segments)")
    return "no ZeRO: every data-parallel rank steps all of its parameters"
