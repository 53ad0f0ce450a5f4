"""Data-parallel gradient all-reduce overlapped with the backward (Megatron-LM's `--overlap-grad-reduce`).

Each model chunk's parameters are grouped into buckets (reverse parameter order, the order backward
produces them). A bucket's all-reduce is launched asynchronously as soon as every gradient in it is
final, while the rest of the step's backward runs; `finish` (called by `finalize_model_grads`) launches
what is left, waits, divides by the step's token count and writes the sums back.

When is a gradient final? The executor arms a chunk during the chunk's last B or BW action of the step
(`arm`/`disarm`). A parameter's gradient is final once its AccumulateGrad hook has fired while its chunk
is armed (its last autograd contribution) and no deferred weight-gradient closure is still queued for it
in the step's `WeightGradStore` (zero-bubble W actions run those later; the store reports each one that ran).
After a chunk's last backward-related action every one of its parameters is final (`chunk_done`), which
also covers parameters that received no gradient. Readiness only ever depends on this rank's plan, so
every data-parallel replica launches the same buckets in the same order.

Late gradients: a parameter marked `grad_after_plan` (the vocabulary-parallel input embedding's shard, whose
backward runs after the plan's last action) is final only at the step's end, so it sits in buckets of its own
that `finish` launches, after the others.

The sums are the same as `core.distributed.all_reduce_bucketed`'s: fp32 flat buckets, summed over DP,
then divided; the gradients TP ranks hold parts of (sequence-parallel and per-head norms) are summed over TP
first, within their bucket.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from llamapipe.core.config import ConfigError
from llamapipe.core.distributed.fsdp import is_sharded
from llamapipe.core.distributed.grad_reduce import DEFAULT_BUCKET_SIZE, bucket_groups, group_size, unpack_bucket
from llamapipe.core.tensor_parallel.weight_grad_store import WeightGradStore
from llamapipe.core.tensor_parallel.layers import all_reduce_coalesced, grad_dtype, grad_partial_over_tp


class _Bucket:
    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.waiting = len(params)          # parameters not yet final this step
        self.flat: Optional[torch.Tensor] = None
        self.work: Any = None
        self.phase = 0                      # launched before (0), during (1) or after (2) the last backward action


class GradSync:
    """Launches the DP all-reduce of each gradient bucket as soon as the bucket is final."""

    def __init__(self, model_chunks: Sequence[nn.Module], parallel_state, bucket_size: int = DEFAULT_BUCKET_SIZE):
        if bucket_size <= 0:
            raise ConfigError(f"ddp_bucket_size {bucket_size} must be positive", "ddp_bucket_size")
        self.dp_group, self.tp_group = parallel_state.dp_cp_group, parallel_state.tp_group
        self.chunk_buckets: list[list[_Bucket]] = []
        self._where: dict[int, tuple[int, _Bucket]] = {}      # id(param) -> (chunk, bucket)
        self._hooks = []
        self._store: Optional[WeightGradStore] = None      # the running step's, from begin_step
        self.last_counts = (0, 0, 0)          # last step's buckets launched before/during/after the last action
        # ZeRO-2/3: FSDP reduce-scatters once after the last W (`fsdp.reduce_scatter_grads`), so no buckets here
        self.fsdp = is_sharded(list(model_chunks))
        per_chunk = [[p for p in chunk.parameters() if p.requires_grad and not self.fsdp] for chunk in model_chunks]
        if len({id(p) for params in per_chunk for p in params}) < sum(map(len, per_chunk)):
            raise ConfigError("overlap_grad_reduce cannot handle a parameter shared by two model chunks",
                              "overlap_grad_reduce")
        late = [p for params in per_chunk for p in params if getattr(p, "grad_after_plan", False)]
        self.late_buckets = [_Bucket(group) for group in bucket_groups(late, bucket_size, grad_dtype)]
        for c, params in enumerate(per_chunk):
            params = [p for p in params if not getattr(p, "grad_after_plan", False)]
            buckets = [_Bucket(group) for group in bucket_groups(params, bucket_size, grad_dtype)]
            self.chunk_buckets.append(buckets)
            for bucket in buckets:
                for p in bucket.params:
                    self._where[id(p)] = (c, bucket)
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._on_accumulate))
        self._reset()

    @property
    def buckets(self) -> list[_Bucket]:
        """Every bucket, in launch order at `finish`: the chunks' ones, then the late ones."""
        return [b for buckets in self.chunk_buckets for b in buckets] + self.late_buckets

    def _reset(self) -> None:
        self._armed: Optional[int] = None
        self._phase = 0                       # 0: before the last backward action, 1: during it, 2: after
        self._accumulated: set[int] = set()   # params whose last AccumulateGrad of the step has fired
        self._final: set[int] = set()
        for bucket in self.buckets:
            bucket.waiting, bucket.flat, bucket.work, bucket.phase = len(bucket.params), None, None, 0

    # --- called by the executor -------------------------------------------------------------------
    def begin_step(self, store: WeightGradStore) -> None:
        """A step starts; `store` holds its deferred weight gradients."""
        if any(b.flat is not None for b in self.buckets):
            raise RuntimeError("GradSync.begin_step: the previous step's gradients were never finished")
        self._reset()
        self._store = store
        store.set_listener(self._on_weight_grads)

    def arm(self, chunk: int) -> None:
        """The next action is `chunk`'s last B or BW of the step."""
        self._armed = chunk

    def disarm(self) -> None:
        self._armed = None

    def chunk_done(self, chunk: int, last_action: bool) -> None:
        """`chunk` has no backward work left this step; `last_action`: nor has this rank."""
        self._phase = 2 if last_action else self._phase
        for bucket in self.chunk_buckets[chunk]:
            for p in bucket.params:
                self._mark_final(p)

    def last_action(self) -> None:
        """The next action is this rank's last backward-related action of the step."""
        self._phase = 1

    def end_step(self) -> None:
        self._phase = 2
        self._stop_listening()

    def _stop_listening(self) -> None:
        if self._store is not None:
            self._store.remove_listener(self._on_weight_grads)

    # --- readiness ---------------------------------------------------------------------------------
    def _on_accumulate(self, param: torch.Tensor) -> None:
        where = self._where.get(id(param))
        if where is None or where[0] != self._armed:
            return
        self._accumulated.add(id(param))
        if self._store.queued(param) == 0:           # armed only inside a step, so a store is set
            self._mark_final(param)

    def _on_weight_grads(self, params: Sequence[torch.Tensor]) -> None:
        for p in params:
            if id(p) in self._accumulated and self._store.queued(p) == 0:
                self._mark_final(p)

    def _mark_final(self, param: torch.Tensor) -> None:
        if id(param) in self._final or id(param) not in self._where:
            return
        self._final.add(id(param))
        bucket = self._where[id(param)][1]
        bucket.waiting -= 1
        if bucket.waiting == 0:
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        for p in bucket.params:
            if p.grad is None:            # every DP replica must pack identical buckets
                p.grad = torch.zeros_like(p, dtype=grad_dtype(p))
        sp = [p.grad for p in bucket.params if grad_partial_over_tp(p)]
        if group_size(self.tp_group) > 1:
            all_reduce_coalesced(sp, self.tp_group)
        dtype = torch.promote_types(bucket.params[0].grad.dtype, torch.float32)
        bucket.flat = torch.cat([p.grad.reshape(-1).to(dtype) for p in bucket.params])
        if group_size(self.dp_group) > 1:
            bucket.work = dist.all_reduce(bucket.flat, group=self.dp_group, async_op=True)
        bucket.phase = self._phase

    # --- called by finalize_model_grads ------------------------------------------------------------
    def finish(self, divisor: Optional[float]) -> tuple[int, int, int]:
        """Launch the buckets not yet launched (the late ones last), wait for all, divide, write back; returns
        how many buckets were launched before, during and after this rank's last backward action."""
        self.end_step()
        for bucket in self.buckets:
            if bucket.flat is None:
                self._launch(bucket)
        for bucket in self.buckets:
            unpack_bucket([p.grad for p in bucket.params], bucket.flat, bucket.work, divisor)
        self.last_counts = tuple(sum(b.phase == k for b in self.buckets) for k in range(3))
        self._reset()
        return self.last_counts

    def summary(self) -> str:
        """One line on where the last step's all-reduces started, naming the config field overlap_grad_reduce."""
        if self.fsdp:
            return ("overlap_grad_reduce with a sharded data-parallel strategy: FSDP reduce-scatters the "
                    "gradients once, after the step's last backward action")
        before, during, after = self.last_counts
        return (f"overlap_grad_reduce: of this rank's {before + during + after} gradient buckets, {before} "
                f"started their data-parallel all-reduce before its last backward action, {during} during it "
                f"and {after} after it")

    def discard(self) -> None:
        """Wait for whatever was launched and drop it (a skipped step): replicas stay in step."""
        self.end_step()
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
        self._reset()

    def abort(self) -> None:
        """A failed step: forget it without waiting (peers may be gone)."""
        self.end_step()
        self._reset()

    def remove(self) -> None:
        self._stop_listening()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
