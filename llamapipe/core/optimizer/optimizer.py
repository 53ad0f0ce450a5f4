"""The training optimizer: fp32 master weights, loss scaling, global grad-norm clipping, AdamW, ZeRO-1.

One class covers every precision and layout. Each rank steps the `Segment`s of its `ShardLayout`: all of
its parameters (plain) or its DP range of them (`--use-distributed-optimizer`). A segment's main tensor is
a view of the model parameter when that is fp32 (the update lands in the model directly) and an fp32
master copy when the model is bf16/fp16 (grads are converted into fp32 main grads before the step, and the
updated masters are written back after it). Under ZeRO-2/3 (`core.distributed.fsdp`) the segments are this
rank's FSDP shards, and with `--optimizer-cpu-offload` every main tensor is an fp32 CPU copy. Step order follows Megatron: main grads -> unscale and
global inf check (fp16) -> global grad norm -> clip -> AdamW -> copy back / all-gather over DP.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from llamapipe.core.config import OptimizerConfig
from llamapipe.core.logger import get_logger
from llamapipe.core.optimizer.adamw import (decays_weight, follows_decoupled_lr, get_adam_state, make_adamw,
                                            set_adam_state)
from llamapipe.core.optimizer.clip_grads import (clip_grads_, counts_for_norm, local_squared_norm, unscale_and_check_,
                                                 unscale_local_)
from llamapipe.core.optimizer import post_validation as pv
from llamapipe.core.optimizer.distrib_optimizer import ShardLayout, gather_shards, pack_shard, unflatten
from llamapipe.core.optimizer.sharded_state import gather_fsdp_param_state, localize_param_state
from llamapipe.core.distributed.fsdp import is_sharded as is_fsdp_sharded, local_tensor, sync_loaded_views, \
    zero_sharded_grads
from llamapipe.core.optimizer.grad_scaler import build_grad_scaler
from llamapipe.core.parallel_state import ParallelState

STATE_KEYS = ("exp_avg", "exp_avg_sq", "master_param")


@dataclass(frozen=True)
class StepResult:
    update_successful: bool
    grad_norm: float        # global norm before clipping; NaN when the loss scaler skipped the step
    found_inf: bool         # inf/NaN grads under loss scaling: update skipped, loss scale updated


def named_model_params(model_chunks: list[torch.nn.Module]) -> list[tuple[str, torch.nn.Parameter]]:
    """Trainable parameters of all chunks with their logical names (unique across chunks)."""
    named = [(n, p) for chunk in model_chunks for n, p in chunk.named_parameters() if p.requires_grad]
    names = [n for n, _ in named]
    assert len(set(names)) == len(names), "parameter names must be unique across model chunks"
    return named


class Optimizer:
    """AdamW with master weights, loss scaling, clipping and optional ZeRO-1 sharding over DP."""

    def __init__(self, model_chunks: list[torch.nn.Module], opt_cfg: OptimizerConfig,
                 parallel_state: ParallelState, shard_over_dp: bool = False) -> None:
        ps = parallel_state
        named = named_model_params(model_chunks)
        self.chunks = model_chunks
        self.names = [n for n, _ in named]
        self.model_params = [p for _, p in named]          # FSDP: sharded DTensors
        self.params = [local_tensor(p) for p in self.model_params]   # this rank's storage of each
        assert all(p.is_contiguous() for p in self.params), "parameters must be contiguous"
        self.opt_cfg = opt_cfg
        self.parallel_state = ps
        self.fsdp = is_fsdp_sharded(model_chunks)           # ZeRO-2/3: each rank steps its FSDP shards
        self.sharded = shard_over_dp and ps.dp_cp_size > 1 and not self.fsdp
        self.offload = opt_cfg.optimizer_cpu_offload
        self.layout = ShardLayout(tuple(p.numel() for p in self.params),
                                  ps.dp_cp_size if self.sharded else 1, ps.dp_cp_rank if self.sharded else 0)
        self.segments = self.layout.segments()
        self.mains = [self._main_for(seg.param_index, seg.start, seg.end) for seg in self.segments]
        self._has_master = [self.params[s.param_index].dtype != torch.float32 or self.offload for s in self.segments]
        self._counted = [counts_for_norm(self.model_params[s.param_index], ps.tp_rank) for s in self.segments]
        decay = [decays_weight(self.names[s.param_index], self.params[s.param_index]) for s in self.segments]
        decoupled = [follows_decoupled_lr(self.names[s.param_index], opt_cfg) for s in self.segments]
        self.inner = make_adamw([m for m, d, c in zip(self.mains, decay, decoupled) if d and not c],
                                [m for m, d, c in zip(self.mains, decay, decoupled) if not d and not c], opt_cfg,
                                [m for m, c in zip(self.mains, decoupled) if c])
        self.grad_scaler = build_grad_scaler(opt_cfg)
        self.num_steps = 0
        self.device = self.params[0].device if self.params else torch.device("cpu")
        # together these groups cover every element exactly once (DP too when DP ranks hold disjoint shards)
        self._reduce_groups = ([ps.dp_cp_group] if self.sharded or self.fsdp else []) + [ps.mp_group]
        self._snapshot = pv.Snapshot()          # post-validation's rollback copy, allocated on first use

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    def _main_for(self, index: int, start: int, end: int) -> torch.Tensor:
        flat = self.params[index].detach().view(-1)[start:end]
        if self.offload:      # --optimizer-cpu-offload: fp32 masters, moments and the update on the CPU
            # (meta parameters, the dry run's, keep meta masters: a meta tensor has nothing to copy out)
            return flat.to("meta" if flat.is_meta else "cpu", torch.float32, copy=True)
        return flat if flat.dtype == torch.float32 else flat.to(torch.float32, copy=True)

    def get_loss_scale(self) -> float:
        """The factor the runtime multiplies each microbatch loss by before backward."""
        return self.grad_scaler.scale if self.grad_scaler is not None else 1.0

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.fsdp:
            zero_sharded_grads(self.chunks)
        for p in self.model_params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        self._release_main_grads()

    def _release_main_grads(self) -> None:
        for main in self.mains:
            main.grad = None

    def _main_grads(self) -> list[torch.Tensor]:
        """Point (fp32) or convert (bf16/fp16) each segment's slice of param.grad into the main grad."""
        grads = []
        for seg, main in zip(self.segments, self.mains):
            grad = local_tensor(self.model_params[seg.param_index].grad)
            if grad is None:
                flat = torch.zeros_like(main)
            else:
                flat = grad.detach().reshape(-1)[seg.start:seg.end]
            main.grad = flat.to(main.device, torch.float32)
            grads.append(main.grad)
        return grads

    def _local_stats(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """[squared norm of the counted grads, 0, 0, 0]: the post-validation statistics layout, so that the
        synchronous and the post-validated norms come from the same reduction of the same-sized tensor."""
        pack = torch.zeros(pv.STATS, dtype=torch.float64, device=self.device)
        pack[pv.SQ] = local_squared_norm([g for g, c in zip(grads, self._counted) if c])
        return pack

    @torch.no_grad()
    def step(self) -> StepResult:
        """One update from the grads in param.grad (already reduced over DP and divided by the token count)."""
        grads = self._main_grads()
        if self.grad_scaler is not None:
            found_inf = unscale_and_check_(grads, self.grad_scaler.inv_scale, self._reduce_groups, self.device)
            self.grad_scaler.update(found_inf)
            if found_inf:
                get_logger().info("found inf/NaN in the gradients: update skipped, loss scale is now %g",
                                  self.grad_scaler.scale)
                self._release_main_grads()
                return StepResult(False, float("nan"), True)
        pack = self._local_stats(grads)
        pv.wait(pv.reduce_stats_async(pack, self._reduce_groups))
        grad_norm = math.sqrt(pack[pv.SQ].item())  # inf and NaN pass through
        if not math.isfinite(grad_norm):
            get_logger().info("gradient norm is %s: update skipped", grad_norm)
            self._release_main_grads()
            return StepResult(False, grad_norm, False)
        if self.opt_cfg.clip_grad > 0:
            clip_grads_(grads, self.opt_cfg.clip_grad, grad_norm)
        self._update()
        self._release_main_grads()
        return StepResult(True, grad_norm, False)

    def _update(self) -> None:
        self.inner.step()
        self.num_steps += 1
        self._copy_main_to_model()

    @torch.no_grad()
    def begin_post_validated_step(self, loss_sum: float, tokens: float, always_speculate: bool = False,
                                  paused: bool = False) -> pv.PendingStep:
        """Start a post-validated step (`post_validation` module): reduce this step's statistics without
        blocking and, when this rank's own statistics allow it, apply the unclipped update now.
        `loss_sum`/`tokens`: what this rank holds of the step's loss (DP-reduced; 0 on other ranks). Speculate
        `always_speculate` (tests), or never when `paused` (`SpeculationPolicy`; alike on every rank: no flag)."""
        grads = self._main_grads()
        found_inf = None
        if self.grad_scaler is not None:
            found_inf = unscale_local_(grads, self.grad_scaler.inv_scale, self.device)
        pack = self._local_stats(grads)     # of the unscaled grads, as step() takes it
        if found_inf is not None:
            pack[pv.NONFINITE] = found_inf.double().sum()
        pv.wait(pv.reduce_stats_async(pack, self._reduce_groups[:-1]))   # DP peers (ZeRO-1): same decision
        may = not paused and (always_speculate or pv.may_speculate(pack, self.opt_cfg.clip_grad, loss_sum))
        pack[pv.LOSS], pack[pv.TOKENS] = loss_sum, tokens
        work = pv.reduce_stats_async(pack, self._reduce_groups[-1:])
        # The rank whose gradients are final last completes the reduction itself: it steps synchronously, with
        # no snapshot. (ZeRO-1 DP peers must decide alike, so they do not look at timing.)
        speculate = may and (always_speculate or self.sharded or not pv.arrives_within(work, pv.GRACE_S))
        ps = self.parallel_state
        flag, flag_work = pv.count_speculating(speculate, [] if paused else [ps.dp_cp_group, ps.mp_group], self.device)
        if speculate:
            self._snapshot.capture(self)
            if self.grad_scaler is not None:
                self.grad_scaler.update(False)
            self._update()
        self._release_main_grads()
        return pv.PendingStep(pack, work, grads, speculate, flag, flag_work)

    @torch.no_grad()
    def resolve_post_validated_step(self, pending: pv.PendingStep) -> pv.Resolution:
        """Wait for the step's statistics and leave the parameters as the synchronous step would have."""
        if pending.resolution is not None:
            return pending.resolution
        pv.wait(pending.work, pending.flag_work)
        action, grad_norm = pv.decide(pending.pack, self.opt_cfg.clip_grad, self.grad_scaler is not None)
        rolled_back = pending.speculated and action != "apply"
        if rolled_back:
            self._snapshot.restore(self)
        if not (pending.speculated and action == "apply"):
            if self.grad_scaler is not None:
                self.grad_scaler.update(action == "found_inf")
            if action in ("apply", "clip"):
                for main, grad in zip(self.mains, pending.grads):
                    main.grad = grad
                if action == "clip":
                    clip_grads_(pending.grads, self.opt_cfg.clip_grad, grad_norm)
                self._update()
                self._release_main_grads()
            elif rolled_back:
                self._copy_main_to_model()
        pending.grads = []
        pending.resolution = pv.Resolution(action, grad_norm, pending.pack[pv.LOSS].item(),
                                           pending.pack[pv.TOKENS].item(),
                                           pending.flag.item() > 0 and action != "apply")
        return pending.resolution

    def _copy_main_to_model(self) -> None:
        if not self.sharded:
            for seg, main, has_master in zip(self.segments, self.mains, self._has_master):
                if has_master:
                    self.params[seg.param_index].detach().view(-1)[seg.start:seg.end].copy_(main)
            return
        dtypes = {p.dtype for p in self.params}
        dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
        shard = pack_shard(self.layout, self.segments, self.mains, dtype, self.device)
        full = gather_shards(shard, self.layout, self.parallel_state.dp_cp_group)
        for p, value in zip(self.params, unflatten(full, self.layout, [p.shape for p in self.params])):
            p.detach().copy_(value)

    def reload_model_params(self) -> None:
        """Refresh the fp32 masters from the model (after loading model weights without optimizer state)."""
        if self.fsdp:
            sync_loaded_views(self.chunks)
        for seg, main, has_master in zip(self.segments, self.mains, self._has_master):
            if has_master:
                main.copy_(self.params[seg.param_index].detach().view(-1)[seg.start:seg.end])

    def _segment_values(self, key: str) -> list[torch.Tensor]:
        if key == "master_param":
            return self.mains
        return [get_adam_state(self.inner, main)[0 if key == "exp_avg" else 1] for main in self.mains]

    def state_dict(self, *, keep: bool = True) -> dict:
        """Per-parameter state, each tensor shaped like the local (TP-shard) parameter, on the CPU.

        Collective over DP. `keep=False` (ranks that do not write the checkpoint) takes part in the gathers
        but keeps nothing, so only the writer ever holds the full, unsharded ZeRO-1 state.
        """
        param_state: dict[str, dict[str, torch.Tensor]] = {name: {} for name in self.names}
        shapes = [p.shape for p in self.params]
        mixed = any(p.dtype != torch.float32 for p in self.params)  # same on every DP rank: safe collective
        if self.fsdp:
            param_state = gather_fsdp_param_state(self, STATE_KEYS if mixed else STATE_KEYS[:2], keep)
        for key in () if self.fsdp else STATE_KEYS if mixed else STATE_KEYS[:2]:
            shard = pack_shard(self.layout, self.segments, self._segment_values(key), torch.float32, self.device)
            full = gather_shards(shard, self.layout, self.parallel_state.dp_cp_group)
            if not keep:
                continue
            for name, p, value in zip(self.names, self.params, unflatten(full, self.layout, shapes)):
                if key != "master_param" or p.dtype != torch.float32:
                    param_state[name][key] = value.to("cpu", copy=True)
        scaler = self.grad_scaler.state_dict() if self.grad_scaler is not None else {}
        return {"param_state": param_state, "step": self.num_steps, "grad_scaler": scaler}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load the per-parameter form of `state_dict()`, keeping only this rank's shard."""
        param_state = state_dict["param_state"]
        if self.fsdp:
            sync_loaded_views(self.chunks)       # the model weights the checkpoint reader copied into full views
            param_state = localize_param_state(param_state, self.names, self.model_params)
        for name, p in zip(self.names, self.params):
            if name not in param_state:
                raise ValueError(f"the optimizer checkpoint has no state for parameter {name}")
            shape = tuple(param_state[name]["exp_avg"].shape)
            if shape != tuple(p.shape):
                raise ValueError(f"the optimizer state of {name} has shape {shape} but the parameter has "
                                 f"shape {tuple(p.shape)}")
        step = int(state_dict["step"])
        for seg, main, has_master in zip(self.segments, self.mains, self._has_master):
            state = param_state[self.names[seg.param_index]]
            part = lambda t: t.reshape(-1)[seg.start:seg.end]  # noqa: E731
            set_adam_state(self.inner, main, part(state["exp_avg"]), part(state["exp_avg_sq"]), step)
            if has_master:
                source = state.get("master_param", self.params[seg.param_index].detach())
                main.copy_(part(source))
        self.num_steps = step
        if self.grad_scaler is not None and state_dict.get("grad_scaler"):
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])


def build_optimizer(model_chunks: list[torch.nn.Module], opt_cfg: OptimizerConfig,
                    parallel_state: ParallelState) -> Optimizer:
    """The optimizer for this rank's chunks; ZeRO-1 over DP with `--use-distributed-optimizer`."""
    return Optimizer(model_chunks, opt_cfg, parallel_state, shard_over_dp=opt_cfg.use_distributed_optimizer)
