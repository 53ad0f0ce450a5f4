"""Synthetic-cost stages for benchmarks/peers_worker.py (bench_peers.py --synthetic): every framework's own schedule
engine, unchanged, over stages whose forward, input backward and weight backward SLEEP a fixed time while real
activation tensors cross the pipeline (bench_schedules.py's synthetic mode: `_Sleep`, with its timer-slack and
overshoot calibration). With more ranks than cores, a sleeping rank leaves its core to the others, so p = 4 on 2
cores still measures the schedule and each framework's per-action overhead (Python, p2p), not the machine.

A stage of `n` layers sleeps n x sleep for each of F, B and W per microbatch; a framework that fuses B and W (1F1B,
interleaved: DeepSpeed, megatron-core, torch's Schedule1F1B / ScheduleInterleaved1F1B, ours) sleeps both in one
backward; the zero-bubble schedules (ours ZB-V / auto, torch's ZB-V / DualPipeV) run W when their plan says. The
last stage's output is the sum over the hidden dimension (no output layer: the balanced shape, head negligible);
its loss the mean. Activations are (sequence, micro-batch, hidden) fp32 as in the real model ((micro-batch,
sequence, hidden) for torch's and DeepSpeed's, which split inputs along dimension 0): the same bytes per message.
"""
from __future__ import annotations

import dataclasses
import itertools

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.bench_schedules import _calibrate_sleep, _Sleep

OURS = {"ours-1f1b": ("1f1b", 1), "ours-interleaved": ("interleaved", 2), "ours-zbv": ("zbv", 2),
        "ours-auto": ("auto", 1), "ours-auto-v": ("auto", 2)}


class SleepStage(nn.Module):
    """One pipeline stage (or chunk) of `layers` sleeping layers; any framework's stage protocol: positional or
    `input_ids` input on the first stage, `set_input_tensor` elsewhere, a per-token output on the last."""

    def __init__(self, layers: int, sleep_s: float, pre_process: bool, post_process: bool, config=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1))
        self.times, self.pre_process, self.post_process = (layers * sleep_s,) * 3, pre_process, post_process
        self.input_tensor, self.config = None, config

    def set_input_tensor(self, t) -> None:
        self.input_tensor = t[0] if isinstance(t, (list, tuple)) else t

    def forward(self, input_ids=None, labels=None):
        x = input_ids if input_ids is not None else self.input_tensor
        x = x[0] if isinstance(x, (list, tuple)) else x
        out = _Sleep.apply(x, self.weight, self.times)
        return out.sum(-1) if self.post_process else out


def _per_chunk(shape, chunks: int) -> int:
    return shape.layers // (dist.get_world_size() * chunks)


def _mean_loss(out, *unused):
    return out.float().mean()


def ours(shape, name: str):
    """Our runtime (get_forward_backward_func) over sleeping chunks placed as the schedule places them."""
    from llamapipe.core.parallel_state import initialize_model_parallel
    from llamapipe.core.pipeline_parallel.runtime import RuntimeOptions
    from llamapipe.core.pipeline_parallel.schedule_ir import stage_of
    from llamapipe.core.pipeline_parallel.schedule_specs import SPECS
    from llamapipe.core.pipeline_parallel.schedules import get_forward_backward_func
    schedule, vpp = OURS[name]
    ps = dataclasses.replace(initialize_model_parallel(1, dist.get_world_size()), vpp_size=vpp)
    ids = [stage_of(ps.pp_rank, c, ps.pp_size, SPECS[schedule].placement(vpp)) for c in range(vpp)]
    last = ps.pp_size * vpp - 1
    chunks = [SleepStage(_per_chunk(shape, vpp), shape.sleep_s, s == 0, s == last) for s in ids]
    x = torch.randn(shape.seq, shape.micro_batch, shape.hidden)
    data = [itertools.repeat({"input_ids": x}) if s == 0 else None for s in ids]
    fb = get_forward_backward_func(ps, schedule, options=RuntimeOptions(profile_iters=2))

    def loss_step(data_iterator, model):
        out = model(**(next(data_iterator) if data_iterator is not None else {}))
        return out, lambda o: (o.float().sum(), torch.tensor(o.numel()), {})   # ours: (sum, tokens, logs)

    def step() -> list[float]:
        fb(forward_step_func=loss_step, data_iterator=data, model=chunks, num_microbatches=shape.microbatches)
        return []
    return chunks, step, [f"ours: {schedule} over {vpp} sleeping chunk(s) per rank"]


def torch_pipelining(shape, name: str):
    """torch.distributed.pipelining's schedule over sleeping stages (ZB-V / DualPipeV with the I/W split)."""
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleDualPipeV,
                                              ScheduleInterleaved1F1B, ScheduleZBVZeroBubble)
    from llamapipe.core.pipeline_parallel.schedule_ir import stage_of
    from llamapipe.core.pipeline_parallel.schedule_specs import SPECS
    from llamapipe.core.parallel_state import initialize_model_parallel
    from benchmarks.torch_adapter import CapturedWeightGrads
    kinds = {"torch-1f1b": ("1f1b", Schedule1F1B, 1), "torch-interleaved": ("interleaved", ScheduleInterleaved1F1B, 2),
             "torch-zbv": ("zbv", ScheduleZBVZeroBubble, 2), "torch-dualpipev": ("dualpipev", ScheduleDualPipeV, 2)}
    ours_name, cls, vpp = kinds[name]
    ps = initialize_model_parallel(1, dist.get_world_size())
    n = ps.pp_size * vpp
    ids = [stage_of(ps.pp_rank, c, ps.pp_size, SPECS[ours_name].placement(vpp)) for c in range(vpp)]
    chunks = [SleepStage(_per_chunk(shape, vpp), shape.sleep_s, s == 0, s == n - 1) for s in ids]
    b, s, h = shape.micro_batch, shape.seq, shape.hidden
    dw = CapturedWeightGrads() if name in ("torch-zbv", "torch-dualpipev") else None

    def io(chunk):
        hidden = torch.empty(b, s, h, device="meta", requires_grad=not chunk.pre_process)
        out = torch.empty(b, s, device="meta", requires_grad=True) if chunk.post_process else \
            torch.empty(b, s, h, device="meta", requires_grad=True)
        return {"input_args": hidden, "output_args": out}
    stages = [PipelineStage(c, i, n, torch.device("cpu"), group=ps.pp_group, dw_builder=dw, **io(c))
              for i, c in zip(ids, chunks)]
    schedule = cls(stages if vpp == 2 else stages[0], shape.microbatches, loss_fn=_mean_loss)
    x, target = torch.randn(shape.microbatches * b, s, h), torch.zeros(shape.microbatches * b, s)
    first, last = any(c.pre_process for c in chunks), any(c.post_process for c in chunks)

    def step() -> list[float]:
        with dw.capturing() if dw is not None else _Null():
            schedule.step(*((x,) if first else ()), target=target if last else None)
        return []
    return chunks, step, []


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def deepspeed_1f1b(shape, lr: float):
    """DeepSpeed's PipelineModule + TrainSchedule over one sleeping stage per rank."""
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule
    pp = dist.get_world_size()
    layers = [LayerSpec(SleepStage, _per_chunk(shape, 1), shape.sleep_s, s == 0, s == pp - 1) for s in range(pp)]
    module = PipelineModule(layers=layers, num_stages=pp, loss_fn=_mean_loss, partition_method="uniform")
    config = {"train_micro_batch_size_per_gpu": shape.micro_batch, "gradient_accumulation_steps": shape.microbatches,
              "steps_per_print": 10 ** 9, "zero_optimization": {"stage": 0}, "wall_clock_breakdown": False}
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=torch.optim.Adam(module.parameters(), lr=lr),
                                           config=config)
    batches = [((torch.randn(shape.micro_batch, shape.seq, shape.hidden),), torch.zeros(shape.micro_batch, shape.seq))
               for _ in range(shape.microbatches)]

    def step() -> list[float]:
        engine.train_batch(data_iter=iter(batches))
        return []
    return None, step, ["DS_ACCELERATOR=cpu", "deepspeed.init_distributed(dist_backend='gloo')"]


def megatron(shape, name: str):
    """megatron-core's forward_backward_pipelining_without/with_interleaving over sleeping chunks (the schedules'
    CPU patches of benchmarks/peers_megatron.py; GPTModel is not built)."""
    from benchmarks.peers_megatron import patch_for_cpu
    patches = patch_for_cpu()[:3]
    from megatron.core import parallel_state as mpu
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.enums import ModelType
    from megatron.core.transformer import TransformerConfig
    pp, vpp = dist.get_world_size(), 2 if name == "megatron-interleaved" else 1
    mpu.initialize_model_parallel(1, pp, virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None)
    config = TransformerConfig(num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
                               pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp if vpp > 1
                               else None, pipeline_dtype=torch.float32, use_cpu_initialization=True,
                               batch_p2p_comm=False, deallocate_pipeline_outputs=False)
    chunks = []
    for v in range(vpp):
        vp = v if vpp > 1 else None
        chunks.append(SleepStage(_per_chunk(shape, vpp), shape.sleep_s,
                                 mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
                                 mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp), config=config))
        chunks[-1].model_type = ModelType.encoder_or_decoder      # the schedules ask every chunk for it
    x, fb = torch.randn(shape.seq, shape.micro_batch, shape.hidden), get_forward_backward_func()

    def forward_step(data_iterator, model):
        out = model(input_ids=x) if model.pre_process else model()
        return out, lambda o: (o.float().mean(), {})

    def step() -> list[float]:
        fb(forward_step_func=forward_step, data_iterator=[None] * vpp if vpp > 1 else None,
           model=chunks if vpp > 1 else chunks[0], num_microbatches=shape.microbatches, seq_length=shape.seq,
           micro_batch_size=shape.micro_batch)
        return []
    return chunks, step, patches


def build(shape, name: str):
    """(chunks or None, step, notes) of case `name` on sleeping stages; calibrates the sleeps first."""
    _calibrate_sleep()
    if name.startswith("ours"):
        return ours(shape, name)
    if name.startswith("torch"):
        return torch_pipelining(shape, name)
    if name.startswith("megatron"):
        return megatron(shape, name)
    return deepspeed_1f1b(shape, shape.lr)
