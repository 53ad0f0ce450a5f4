"""torch.distributed.pipelining behind our model chunks, as the schedule and peer benchmarks run it: a stage adapter
(`TorchStage`), the stage's static input/output shapes (`static_io`), our zero-bubble weight-gradient closures as
torch's `dw_builder` (`CapturedWeightGrads`), and one training step of torch's Schedule1F1B /
ScheduleZBVZeroBubble / ScheduleDualPipeV over them (`torch_step`)."""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Iterator

import torch
from torch import nn

from benchmarks.schedules_real import llama_chunks, placement
from llamapipe.core.pipeline_parallel.schedule_ir import stage_of
from llamapipe.core.tensor_parallel.weight_grad_store import WeightGradStore


class TorchStage(nn.Module):
    """Adapter from our chunk protocol to torch.distributed.pipelining's positional-tensor stages."""

    def __init__(self, chunk: nn.Module) -> None:
        super().__init__()
        self.chunk = chunk

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.chunk.pre_process:
            return self.chunk(input_ids=x)
        self.chunk.set_input_tensor(x)
        return self.chunk()                         # hidden (s, b, h), or logits (b, s, v) on the last stage


def static_io(chunk: nn.Module, config, tokens: torch.Tensor, m: int) -> dict:
    """The stage's input and output for one microbatch as meta tensors (torch's static mode).

    Without them torch infers them on its first step by running the stage's forward AND backward on
    uninitialized tensors (torch >= 2.13, `_backward_metadata_inference` via `torch.autograd.grad`). Our linears
    write their weight gradients into `.grad` inside their backward (the zero-bubble W closures), so that
    inference backward left garbage (NaN, or any value) in every linear's `.grad` on each stage with a
    gradient input; torch clears gradients after inference only for FSDP modules."""
    b, s = tokens.shape[0] // m, tokens.shape[1]
    dtype = next(chunk.parameters()).dtype
    hidden = torch.empty(s, b, config.hidden_size, dtype=dtype, device="meta", requires_grad=True)   # (s, b, h)
    first = torch.empty(b, s, dtype=tokens.dtype, device="meta")                                     # (b, s)
    logits = torch.empty(b, s, config.vocab_size, dtype=dtype, device="meta", requires_grad=True)  # (b, s, v)
    return {"input_args": first if chunk.pre_process else hidden,
            "output_args": logits if chunk.post_process else hidden}


class CapturedWeightGrads:
    """torch's `dw_builder` for our model: torch calls it right after each input backward (I) and runs
    what it returns at the matching W. Our linears queue their weight gradients in the store their forward
    ran under, so the step runs with `store` current, the store captures continuously and each call cuts
    off the closures of the I that just ran."""

    def __init__(self) -> None:
        self.count, self.store = 0, WeightGradStore()

    def _begin(self) -> None:
        self.store.begin(("torch-dw", self.count))

    def __call__(self):
        key = self.store.end()
        self.count += 1
        self._begin()
        return lambda: self.store.run(key)

    @contextmanager
    def capturing(self) -> Iterator[None]:
        """Around one schedule step: our forwards remember the store, which captures throughout."""
        self._begin()
        try:
            with self.store.active():
                yield
        finally:
            assert self.store.run(self.store.end()) == 0, "weight gradients left after the step"


def torch_step(config, ps, name: str, m: int, tokens: torch.Tensor, labels: torch.Tensor):
    """torch.distributed.pipelining's Schedule1F1B, or ScheduleZBVZeroBubble / ScheduleDualPipeV with the real
    I/W split."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleDualPipeV, ScheduleZBVZeroBubble
    two_chunks = {"torch-zbv": ScheduleZBVZeroBubble, "torch-dualpipev": ScheduleDualPipeV}
    vpp = 2 if name in two_chunks else 1
    chunks = llama_chunks(config, ps, name, vpp)
    dw = CapturedWeightGrads() if vpp == 2 else None
    stages = [PipelineStage(TorchStage(c), stage_of(ps.pp_rank, i, ps.pp_size, placement(name, vpp)),
                            ps.pp_size * vpp, torch.device("cpu"), group=ps.pp_group, dw_builder=dw,
                            **static_io(c, config, tokens, m))
              for i, c in enumerate(chunks)]

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # the loss ours computes inside its last stage (token cross-entropy, summed), written as a
        # torch.distributed.pipelining user writes it: on the logits the last stage returns
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), target.flatten(), reduction="sum")
    # a summed loss, as ours: torch's default scale_grads=True would divide the gradients by m once more
    schedule = two_chunks[name](stages, m, loss_fn=loss_fn, scale_grads=False) if vpp == 2 else \
        Schedule1F1B(stages[0], m, loss_fn=loss_fn, scale_grads=False)
    holds_first = any(c.pre_process for c in chunks)
    holds_last = any(c.post_process for c in chunks)

    def step() -> list[torch.Tensor]:
        args, losses = ((tokens,) if holds_first else ()), []
        with dw.capturing() if dw is not None else nullcontext():
            schedule.step(*args, target=labels if holds_last else None, losses=losses if holds_last else None)
        return [loss.detach() for loss in losses]
    step.chunks = chunks            # the overlap mode steps an optimizer over them
    return step
