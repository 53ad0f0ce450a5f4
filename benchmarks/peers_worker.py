"""One peer framework's training iterations, run by benchmarks/bench_peers.py under torchrun (one process a rank,
gloo, one thread each). Every rank writes {"iter_s": [seconds of each iteration], "cpu_s": [its main-thread CPU
seconds], "first_loss": mean token loss of iteration 1 or null, "patches": [...]} to OUT_DIR/rank<r>.json.

An iteration: zero the gradients, one forward-backward over M microbatches with the framework's schedule, a
torch.optim.Adam step on this rank's parameters (DeepSpeed: its engine's `train_batch`, which steps the same Adam).
Model bodies: torch.distributed.pipelining and DeepSpeed run llamapipe's LlamaModel chunks (the very layers ours
runs, split evenly); megatron-core runs its own GPTModel with the local spec (benchmarks/peers_megatron.py).
With --sleep-ms every framework (ours too) runs sleeping stages instead (benchmarks/peers_synthetic.py).

    torchrun --nproc_per_node 2 benchmarks/peers_worker.py --framework torch-zbv --vocab 256 --out-dir /tmp/x
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

FRAMEWORKS = ["deepspeed-1f1b", "megatron-1f1b", "megatron-interleaved", "torch-1f1b", "torch-interleaved",
              "torch-zbv", "torch-dualpipev"]
SYNTHETIC_ONLY = ["ours-1f1b", "ours-interleaved", "ours-zbv", "ours-auto", "ours-auto-v"]
TWO_CHUNKS = {"megatron-interleaved", "torch-interleaved", "torch-zbv", "torch-dualpipev"}


def _batches(shape, seed: int = 1234) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"tokens": torch.randint(0, shape.vocab, (shape.micro_batch, shape.seq), generator=g),
             "labels": torch.randint(0, shape.vocab, (shape.micro_batch, shape.seq), generator=g)}
            for _ in range(shape.microbatches)]


def _our_config(shape):
    from llamapipe.model.llama import LlamaConfig
    return LlamaConfig(num_layers=shape.layers, hidden_size=shape.hidden, ffn_hidden_size=shape.ffn,
                       num_attention_heads=shape.heads, num_query_groups=shape.groups, vocab_size=shape.vocab,
                       max_position_embeddings=shape.seq)


def torch_pipelining(shape, name: str):
    """torch.distributed.pipelining's schedule `name` over our LlamaModel chunks (the I/W split for the V schedules,
    as benchmarks/schedules_real.py sets it up)."""
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleDualPipeV,
                                              ScheduleInterleaved1F1B, ScheduleZBVZeroBubble)
    from llamapipe.core.parallel_state import initialize_model_parallel
    from llamapipe.core.pipeline_parallel.schedule_ir import stage_of
    from llamapipe.core.pipeline_parallel.schedule_specs import SPECS
    from benchmarks.torch_adapter import CapturedWeightGrads, TorchStage, static_io
    from llamapipe.model.llama import LlamaModel
    ps, config = initialize_model_parallel(1, dist.get_world_size()), _our_config(shape)
    kinds = {"torch-1f1b": ("1f1b", Schedule1F1B), "torch-interleaved": ("interleaved", ScheduleInterleaved1F1B),
             "torch-zbv": ("zbv", ScheduleZBVZeroBubble), "torch-dualpipev": ("dualpipev", ScheduleDualPipeV)}
    ours, cls = kinds[name]
    vpp = 2 if name in TWO_CHUNKS else 1
    stages_n, per = ps.pp_size * vpp, shape.layers // (ps.pp_size * vpp)
    ids = [stage_of(ps.pp_rank, c, ps.pp_size, SPECS[ours].placement(vpp)) for c in range(vpp)]
    chunks = [LlamaModel(config, ps, layer_range=(s * per, (s + 1) * per), pre_process=s == 0,
                         post_process=s == stages_n - 1) for s in ids]
    batches = _batches(shape)
    tokens, labels = torch.cat([b["tokens"] for b in batches]), torch.cat([b["labels"] for b in batches])
    dw = CapturedWeightGrads() if name in ("torch-zbv", "torch-dualpipev") else None
    stages = [PipelineStage(TorchStage(c), s, stages_n, torch.device("cpu"), group=ps.pp_group, dw_builder=dw,
                            **static_io(c, config, tokens, shape.microbatches)) for s, c in zip(ids, chunks)]

    def loss_fn(logits, target):
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), target.flatten())
    schedule = cls(stages if vpp == 2 else stages[0], shape.microbatches, loss_fn=loss_fn)
    first, last = any(c.pre_process for c in chunks), any(c.post_process for c in chunks)

    def step() -> list[float]:
        losses = []
        with dw.capturing() if dw is not None else _null():
            schedule.step(*((tokens,) if first else ()), target=labels if last else None,
                          losses=losses if last else None)
        return [float(x) for x in losses]
    return chunks, step, []


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _DeepSpeedChunk(torch.nn.Module):
    """One pipeline stage of our LlamaModel as a DeepSpeed layer: tokens (b, s) in on the first stage, hidden
    (s, b, h) between stages, logits (b, s, v) out of the last."""

    def __init__(self, shape, layer_range: tuple, pre: bool, post: bool) -> None:
        super().__init__()
        from llamapipe.core.parallel_state import initialize_model_parallel
        from llamapipe.model.llama import LlamaModel
        ps = initialize_model_parallel(1, dist.get_world_size())
        self.chunk = LlamaModel(_our_config(shape), ps, layer_range=layer_range, pre_process=pre, post_process=post)

    def forward(self, x):
        x = x[0] if isinstance(x, (tuple, list)) else x
        if self.chunk.pre_process:
            return self.chunk(input_ids=x)
        self.chunk.set_input_tensor(x)
        return self.chunk()


def deepspeed_1f1b(shape, lr: float):
    """DeepSpeed's PipelineModule + TrainSchedule (1F1B), our layers split evenly over the stages."""
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule
    pp, half = dist.get_world_size(), shape.layers // dist.get_world_size()
    layers = [LayerSpec(_DeepSpeedChunk, shape, (s * half, (s + 1) * half), s == 0, s == pp - 1) for s in range(pp)]

    def loss_fn(logits, labels):
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
    module = PipelineModule(layers=layers, num_stages=pp, loss_fn=loss_fn, partition_method="uniform")
    optimizer = torch.optim.Adam(module.parameters(), lr=lr)
    config = {"train_micro_batch_size_per_gpu": shape.micro_batch, "gradient_accumulation_steps": shape.microbatches,
              "steps_per_print": 10 ** 9, "zero_optimization": {"stage": 0}, "wall_clock_breakdown": False}
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=config)
    batches = [((b["tokens"],), b["labels"]) for b in _batches(shape)]

    def step() -> list[float]:
        return [float(engine.train_batch(data_iter=iter(batches)))]
    return None, step, ["DS_ACCELERATOR=cpu", "deepspeed.init_distributed(dist_backend='gloo')"]


def megatron(shape, name: str):
    from benchmarks import peers_megatron
    chunks, patches = peers_megatron.build(shape, dist.get_world_size(), 2 if name in TWO_CHUNKS else 1)
    return chunks, peers_megatron.step_function(shape, chunks, _batches(shape)), patches


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--framework", choices=FRAMEWORKS + SYNTHETIC_ONLY, required=True)
    for flag, default in (("layers", 8), ("hidden", 256), ("ffn", 688), ("heads", 8), ("groups", 4), ("seq", 256),
                          ("micro-batch", 2), ("microbatches", 8), ("vocab", 256), ("iters", 6)):
        p.add_argument(f"--{flag}", type=int, default=default)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--sleep-ms", type=float, default=0.0,
                   help="synthetic stages: F = B = W sleep per layer and microbatch (0: the real model)")
    p.add_argument("--out-dir", required=True)
    shape = p.parse_args(argv)
    shape.sleep_s = shape.sleep_ms / 1e3
    if shape.framework in SYNTHETIC_ONLY and not shape.sleep_s:
        p.error(f"--framework {shape.framework} runs here only with --sleep-ms (ours' real runs are pretrain_llama.py)")
    torch.set_num_threads(1)
    torch.manual_seed(1234)
    if shape.framework.startswith("deepspeed"):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed
        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    if shape.sleep_s:
        from benchmarks import peers_synthetic
        chunks, step, patches = peers_synthetic.build(shape, shape.framework)
    elif shape.framework.startswith("torch"):
        chunks, step, patches = torch_pipelining(shape, shape.framework)
    elif shape.framework.startswith("megatron"):
        chunks, step, patches = megatron(shape, shape.framework)
    else:
        chunks, step, patches = deepspeed_1f1b(shape, shape.lr)
    optimizer = None if chunks is None else torch.optim.Adam([q for c in chunks for q in c.parameters()], lr=shape.lr)
    times, cpu, first_loss = [], [], None
    for it in range(shape.iters):
        start, start_cpu = time.perf_counter(), time.thread_time()
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        losses = step()
        if optimizer is not None:
            optimizer.step()
        times.append(time.perf_counter() - start)
        cpu.append(time.thread_time() - start_cpu)
        if it == 0 and losses:
            first_loss = sum(losses) / len(losses)
    dist.barrier()
    os.makedirs(shape.out_dir, exist_ok=True)
    with open(os.path.join(shape.out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump({"iter_s": times, "cpu_s": cpu, "first_loss": first_loss, "patches": patches}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
