"""What this machine charges a 2-rank pipeline before any schedule runs (issue 42's balanced model).

The balanced case of `bench_pipeline_gaps` (vocabulary 256, 8 layers, hidden 256, seq 256, micro-batch 2, 8
microbatches, fp32, one thread per rank) compares a 2-rank pipeline with half the iteration of one process. Two
costs sit between the two that no schedule can remove, and this benchmark measures each on the issue's shape:

  split     the B/W split itself: one 4-layer stage (a pipeline rank's half of the model) runs its 8 microbatches'
            forward and backward fused (backward as one autograd call, as 1F1B without zero bubble), and split
            (B with the weight gradients deferred into a `WeightGradStore`, then W: what ZB-H1/H2/ZB-V run).
  sharing   two processes on the two cores: the same fused stage step alone, and while a second process runs
            the same loop on the other core (memory bandwidth, caches, the clock the cores share).

Rounds alternate the variants (fused, split, then the paired run), each repeat timing `--steps` steps after a
warm-up; per variant the median over rounds and its spread, and the ratios paired by round.

    python -m benchmarks.bench_bw_split --rounds 5 --out benchmarks/results/bench_bw_split.json
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import torch

from benchmarks.results_io import write_json
from llamapipe.core.tensor_parallel.weight_grad_store import WeightGradStore
from llamapipe.model.llama import LlamaConfig, LlamaModel

CONFIG = LlamaConfig(num_layers=8, hidden_size=256, ffn_hidden_size=688, num_attention_heads=8, num_query_groups=8,
                     vocab_size=256, max_position_embeddings=256)
SEQ, BATCH, MICROBATCHES = 256, 2, 8


def _stage() -> LlamaModel:
    torch.manual_seed(0)
    return LlamaModel(CONFIG, None, layer_range=(0, 4), pre_process=False, post_process=False)


def step(chunk: LlamaModel, split: bool) -> None:
    """One stage step: 8 microbatches' F, then B (and W, after all B when split) as a pipeline rank runs them."""
    store = WeightGradStore()
    outs = []
    with store.active():
        for mb in range(MICROBATCHES):
            x = torch.randn(SEQ, BATCH, CONFIG.hidden_size, requires_grad=True)
            chunk.set_input_tensor(x)
            outs.append(chunk())
        for mb, out in enumerate(outs):
            grad = torch.ones_like(out)
            if split:
                with store.capture(mb):
                    out.backward(grad)
                store.run(mb)
            else:
                out.backward(grad)
    store.assert_empty()


def timed(split: bool, steps: int) -> float:
    """Seconds per step over `steps` steps after one warm-up step."""
    torch.set_num_threads(1)
    chunk = _stage()
    step(chunk, split)
    start = time.perf_counter()
    for _ in range(steps):
        step(chunk, split)
        chunk.zero_grad(set_to_none=True)
    return (time.perf_counter() - start) / steps


def _child(split: bool, steps: int) -> subprocess.Popen:
    code = f"from benchmarks.bench_bw_split import timed; print(timed({split}, {steps}))"
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def paired(steps: int) -> float:
    """Seconds per fused step of each of two processes running at once (their mean)."""
    procs = [_child(False, steps), _child(False, steps)]
    return statistics.fmean(float(p.communicate()[0].split()[-1]) for p in procs)


def alone(split: bool, steps: int) -> float:
    proc = _child(split, steps)
    return float(proc.communicate()[0].split()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", default="benchmarks/results/bench_bw_split.json")
    args = p.parse_args(argv)
    runs: dict[str, list[float]] = {"fused": [], "split": [], "fused-paired": []}
    for k in range(args.rounds):
        variants = list(runs)
        for name in variants[k % 3:] + variants[:k % 3]:
            runs[name].append(paired(args.steps) if name == "fused-paired" else alone(name == "split", args.steps))
    rows = {}
    for name, times in runs.items():
        ratios = [t / f for t, f in zip(times, runs["fused"])]
        rows[name] = {"step_s": statistics.median(times), "spread_s": [min(times), max(times)],
                      "ratio_to_fused": statistics.median(ratios), "ratio_spread": [min(ratios), max(ratios)]}
        print(f"{name:<13} {rows[name]['step_s']:.3f} s ({min(times):.3f}-{max(times):.3f})  "
              f"{rows[name]['ratio_to_fused']:.3f}x fused alone ({min(ratios):.3f}-{max(ratios):.3f})")
    write_json(args.out, {"config": {"layers": 4, "hidden": 256, "seq": SEQ, "micro_batch": BATCH,
                                     "microbatches": MICROBATCHES}, "rounds": args.rounds, "steps": args.steps,
                          "rows": rows}, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
