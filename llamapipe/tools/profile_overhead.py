"""The part of a training step that `llamapipe profile`'s pass times leave out, measured through the trainer's
own step code, for `llamapipe plan --profile` (issue 29).

The pass times (`profile_model.measure_chunk`) are the model's F, B and W alone. A training step also runs, per
action, the executor's bookkeeping, the data loader's microbatch and the loss function's reduction
(`training.setup.forward_step`), and once per iteration zeroing the gradients, the loss and token-count
totals, `finalize_model_grads` (dividing the gradients by the token count) and the parts of `Optimizer.step`
around its AdamW update (grad norm, clipping factor, inf check). Three numbers model them:

- `action_s`, seconds per plan action: a whole model of a tiny shape (one layer, hidden 32) runs through
  the 1F1B forward-backward (`get_forward_backward_func`, one stage: F and BW per microbatch) at two
  microbatch counts; the slope of its time over the action count, minus the chunk's own F + B + W measured
  as the profile measures passes, is the time each action costs beyond its compute.
- `iteration_s` and `param_s`: the time of the step outside the forward-backward (zero_grad, totals,
  `finalize_model_grads`, `Optimizer.step`) minus the AdamW update and grad norm that `optimizer_s_per_param`
  already models, measured on the tiny model and on one decoder layer of the profiled shape with its
  embedding and output layer; a line through the two gives the fixed seconds (plus the forward-backward's
  own intercept) and the seconds per parameter of this rank.

p2p messages are not part of it: `profile_comm` measures their latency and bandwidth between real ranks.
Times are the main thread's CPU time under one CPU thread (as the pass times), else wall time.
"""
from __future__ import annotations

import statistics
import time
import types
from typing import Callable, Optional

import torch

from llamapipe.core.config import OptimizerConfig
from llamapipe.core.optimizer.adamw import make_adamw
from llamapipe.core.optimizer.clip_grads import local_squared_norm
from llamapipe.core.optimizer.optimizer import Optimizer
from llamapipe.core.parallel_state import ParallelState
from llamapipe.core.pipeline_parallel.profile_costs import PassCosts
from llamapipe.core.pipeline_parallel.schedules import cached_plan, get_forward_backward_func
from llamapipe.data.gpt_dataset import MockGPTDataset
from llamapipe.model.llama import LlamaConfig
from llamapipe.model.families import family_of
from llamapipe.training.setup import forward_step
from llamapipe.training.step import run_schedule

TINY = dict(num_layers=1, hidden_size=32, ffn_hidden_size=64, num_attention_heads=2, num_query_groups=2,
            vocab_size=256, kv_channels=None)
MICROBATCHES = (2, 8)


def _clock(device: torch.device) -> Callable[[], float]:
    if device.type == "cuda":
        return lambda: (torch.cuda.synchronize(device), time.perf_counter())[1]
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


class _Trainer:
    """One single-rank model with the trainer's optimizer, data and forward-backward; `iteration(m)` times
    one step as (seconds in the forward-backward, seconds in the rest of the step)."""

    def __init__(self, m: LlamaConfig, seq: int, mbs: int, dtype: torch.dtype, device: torch.device) -> None:
        self.chunk = family_of(m).model_class(m, params_dtype=dtype).to(device)
        ps = ParallelState()
        self.parts = types.SimpleNamespace(ps=ps, chunks=[self.chunk], grad_sync=None,
                                           optimizer=Optimizer([self.chunk], OptimizerConfig(), ps),
                                           fb_func=get_forward_backward_func(ps, "1f1b"))
        loader = torch.utils.data.DataLoader(MockGPTDataset(1 << 30, seq, m.vocab_size, seed=0), batch_size=mbs)
        self.data, self.seq, self.mbs, self.device, self.vocab_size = iter(loader), seq, mbs, device, m.vocab_size
        self.params = sum(p.numel() for p in self.chunk.parameters())
        self.clock = _clock(device)

    def iteration(self, m: int) -> tuple[float, float]:
        from llamapipe.core.distributed.grad_reduce import finalize_model_grads
        p, clock = self.parts, self.clock
        t0 = clock()
        p.optimizer.zero_grad()
        t1 = clock()
        _, tokens = run_schedule(p, [self.data], forward_only=False, num_microbatches=m)
        t2 = clock()
        finalize_model_grads(p.chunks, p.ps, None, global_tokens=tokens)
        p.optimizer.step()
        return t2 - t1, t1 - t0 + clock() - t2

    def median(self, m: int, repeats: int) -> tuple[float, float]:
        runs = [self.iteration(m) for _ in range(repeats + 1)][1:]
        return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)

    def adamw_s(self, repeats: int) -> float:
        """The AdamW update and grad norm alone on this model's parameters (what `optimizer_s_per_param` times)."""
        params = list(self.chunk.parameters())
        for q in params:
            q.grad = torch.randn_like(q)
        opt = make_adamw([q for q in params if q.dim() > 1], [q for q in params if q.dim() == 1], OptimizerConfig())

        def step() -> None:
            local_squared_norm([q.grad for q in params])
            opt.step()
        times = []
        for _ in range(repeats + 1):
            start = self.clock()
            step()
            times.append(self.clock() - start)
        return statistics.median(times[1:])

    def batch(self) -> dict:
        tokens = torch.randint(0, self.vocab_size, (self.mbs, self.seq), device=self.device)
        return {"input_ids": tokens, "labels": tokens}


def _actions(m: int) -> int:
    return len(cached_plan("1f1b", 1, 1, m).actions[0])


def measure(m: LlamaConfig, seq: int, mbs: int, dtype: torch.dtype, device: torch.device, repeats: int,
            chunk_costs: Callable[..., PassCosts]) -> dict:
    """`action_s`, `iteration_s` and `param_s` (module docstring); `chunk_costs(chunk, make_batch, repeats,
    device)` is the profile's pass timer (`profile_model.measure_chunk`)."""
    tiny = _Trainer(m.replace(**TINY), seq, mbs, dtype, device)
    few, many = MICROBATCHES
    fb_few, rest_tiny = tiny.median(few, repeats)
    fb_many, _ = tiny.median(many, repeats)
    passes = chunk_costs(tiny.chunk, tiny.batch, repeats, device)
    compute = passes.f + passes.b + passes.w
    action_s = max(0.0, (fb_many - fb_few - (many - few) * compute) / (_actions(many) - _actions(few)))
    fb_fixed = max(0.0, fb_few - few * compute - _actions(few) * action_s)
    extra_tiny = rest_tiny - tiny.adamw_s(repeats)
    big = _Trainer(m.replace(num_layers=1), seq, mbs, dtype, device)
    extra_big = big.median(1, max(repeats // 2, 2))[1] - big.adamw_s(max(repeats // 2, 2))
    param_s = max(0.0, (extra_big - extra_tiny) / (big.params - tiny.params))
    iteration_s = fb_fixed + max(0.0, extra_tiny - param_s * tiny.params)
    return {"action_s": action_s, "iteration_s": iteration_s, "param_s": param_s}


def _pipeline_step_s(fb: Callable, chunk: torch.nn.Module, data, m: int, repeats: int) -> float:
    """Median wall seconds of one forward-backward of `m` microbatches, over all ranks the slowest."""
    import torch.distributed as dist
    times = []
    for _ in range(repeats + 1):
        dist.barrier()
        start = time.perf_counter()
        fb(forward_step_func=forward_step, data_iterator=[data], model=[chunk], num_microbatches=m)
        times.append(time.perf_counter() - start)
    result = torch.tensor([statistics.median(times[1:])], dtype=torch.float64)
    dist.all_reduce(result, op=dist.ReduceOp.MAX)
    return float(result)


def _simulated(stages: list[PassCosts], m: int, hop: float, action_s: float) -> float:
    from llamapipe.core.pipeline_parallel.profile_costs import StageCosts
    from llamapipe.core.pipeline_parallel.simulator import simulate
    costs = StageCosts(f=max(s.f for s in stages), b=max(s.b for s in stages), w=max(s.w for s in stages),
                       comm=hop, stages=tuple(stages), action_s=action_s)
    return simulate(cached_plan("1f1b", len(stages), 1, m), costs).makespan


def measure_pipeline(m: LlamaConfig, seq: int, mbs: int, dtype: torch.dtype, device: torch.device, repeats: int,
                     comm: Optional[dict], chunk_costs: Callable[..., PassCosts]) -> Optional[float]:
    """Seconds per action of the executor with every rank of the torchrun job as one pipeline stage of a
    tiny model (1F1B; p2p calls, waits and wake-ups included): the slope of the measured forward-backward
    over two microbatch counts, less the slope the simulator gives for the tiny stages' measured passes and
    the measured p2p latency, per action on the critical path. None without several ranks. Collective."""
    import torch.distributed as dist
    if comm is None or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    world, rank = dist.get_world_size(), dist.get_rank()
    tiny = m.replace(**{**TINY, "num_layers": world})
    chunk = family_of(tiny).model_class(tiny, layer_range=(rank, rank + 1), pre_process=rank == 0,
                                        post_process=rank == world - 1, params_dtype=dtype).to(device)
    ps = ParallelState(rank=rank, world_size=world, pp_size=world, pp_rank=rank, pp_ranks=tuple(range(world)),
                       pp_group=dist.group.WORLD, mp_group=dist.group.WORLD)
    fb = get_forward_backward_func(ps, "1f1b")
    loader = torch.utils.data.DataLoader(MockGPTDataset(1 << 30, seq, tiny.vocab_size, seed=0), batch_size=mbs)
    data = iter(loader) if rank in (0, world - 1) else None
    few, many = MICROBATCHES
    measured = {n: _pipeline_step_s(fb, chunk, data, n, repeats) for n in (few, many)}

    def make_batch() -> dict:
        if rank > 0:
            chunk.set_input_tensor(torch.randn(seq, mbs, tiny.hidden_size, dtype=dtype, device=device,
                                               requires_grad=True))     # (s, b, h)
        tokens = torch.randint(0, tiny.vocab_size, (mbs, seq), device=device)
        return {"input_ids": tokens if rank == 0 else None, "labels": tokens if rank == world - 1 else None}
    mine = chunk_costs(chunk, make_batch, repeats, device)
    passes = torch.tensor([mine.f, mine.b, mine.w], dtype=torch.float64)
    gathered = [torch.zeros_like(passes) for _ in range(world)]
    dist.all_gather(gathered, passes)
    stages = [PassCosts(*map(float, g)) for g in gathered]
    hop = comm["p2p_latency_s"] + seq * mbs * tiny.hidden_size * 4 / comm["p2p_bandwidth_Bps"]
    probe = 1e-3
    slope = {n: (_simulated(stages, n, hop, probe) - _simulated(stages, n, hop, 0.0)) / probe for n in (few, many)}
    base = {n: _simulated(stages, n, hop, 0.0) for n in (few, many)}
    return max(0.0, (measured[many] - measured[few] - base[many] + base[few]) / (slope[many] - slope[few]))
