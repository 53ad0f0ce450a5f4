"""Checkpoint save benchmark on the CPU: how long a save stalls the training loop, with and without
--async-save, for a LLaMA model of ~134 M parameters with its AdamW state (single rank, fp32).

For each mode and round: the stall (the time `save_checkpoint` blocks the caller), the training steps run
while the background writer works (their time against steps with no save in flight), and the time until
the checkpoint is committed and verified. Prints a table and writes JSON.

    python benchmarks/bench_checkpoint.py --rounds 3 --out benchmarks/results/bench_checkpoint.json
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch

from llamapipe.core.config import OptimizerConfig
from llamapipe.core.optimizer import build_optimizer
from llamapipe.core.parallel_state import ParallelState
from llamapipe.model.llama import LlamaConfig, LlamaModel
from llamapipe.training.checkpointing.save_load import finalize_async_save, save_checkpoint
from llamapipe.training.config import Config
from benchmarks.results_io import write_json

CFG = LlamaConfig(num_layers=12, hidden_size=768, ffn_hidden_size=2048, num_attention_heads=12, num_query_groups=12,
                  vocab_size=32000, max_position_embeddings=256)


def build() -> tuple[list[LlamaModel], object]:
    ps = ParallelState()
    chunks = [LlamaModel(CFG, ps, seed=1)]
    optimizer = build_optimizer(chunks, OptimizerConfig(clip_grad=0.0), ps)
    return chunks, optimizer


def train_step(chunks: list[LlamaModel], optimizer, tokens: torch.Tensor) -> float:
    start = time.perf_counter()
    optimizer.zero_grad()
    chunks[0](input_ids=tokens[:, :-1], labels=tokens[:, 1:]).mean().backward()
    optimizer.step()
    return time.perf_counter() - start


def one_save(chunks, optimizer, save_dir: str, iteration: int, async_save: bool, tokens, steps: int) -> dict:
    start = time.perf_counter()
    save_checkpoint(save_dir, iteration, model_chunks=chunks, optimizer=optimizer, scheduler=None,
                    parallel_state=None, config=Config(model=CFG), consumed_samples=iteration,
                    keep_last_n=1, async_save=async_save)
    stall = time.perf_counter() - start
    step_times = [train_step(chunks, optimizer, tokens) for _ in range(steps)]
    finalize_async_save()
    return {"stall_s": stall, "committed_s": time.perf_counter() - start,
            "step_s_during_save": statistics.mean(step_times) if step_times else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=2, help="training steps run right after each save")
    p.add_argument("--dir", default=None, help="where to write checkpoints (default: a temp dir)")
    p.add_argument("--out", default="benchmarks/results/bench_checkpoint.json")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    chunks, optimizer = build()
    params = sum(q.numel() for q in chunks[0].parameters())
    tokens = torch.randint(0, CFG.vocab_size, (1, 65))
    train_step(chunks, optimizer, tokens)          # creates the AdamW state the checkpoint carries
    baseline = statistics.mean(train_step(chunks, optimizer, tokens) for _ in range(max(args.steps, 1)))
    root = args.dir or tempfile.mkdtemp(prefix="bench_ckpt_")
    rows, iteration = [], 0
    try:
        for round_ in range(args.rounds):
            for mode in ("sync", "async"):
                iteration += 1
                row = one_save(chunks, optimizer, root, iteration, mode == "async", tokens, args.steps)
                rows.append({"round": round_, "mode": mode, **row})
        size = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(root) for f in fs)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    summary = {mode: {key: statistics.median(r[key] for r in rows if r["mode"] == mode)
                      for key in ("stall_s", "committed_s", "step_s_during_save")} for mode in ("sync", "async")}
    result = {"parameters": params, "checkpoint_bytes": size, "rounds": args.rounds, "cpu_threads":
              torch.get_num_threads(), "step_s_no_save": baseline, "median": summary, "rows": rows}
    print(f"model {params / 1e6:.0f} M parameters, checkpoint {size / 2**30:.2f} GiB, {args.rounds} rounds, "
          f"training step {baseline:.2f} s without a save")
    print(f"{'mode':<6} {'stall s':>8} {'committed s':>12} {'step s during save':>19}")
    for mode, m in summary.items():
        print(f"{mode:<6} {m['stall_s']:>8.2f} {m['committed_s']:>12.2f} {m['step_s_during_save']:>19.2f}")
    write_json(args.out, result, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
