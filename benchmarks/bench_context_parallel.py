"""Context parallelism (--context-parallel-size, issue 30): activation memory and step time by CP size.

A tiny LLaMA (2 layers, hidden 128, 4 heads, 2 query groups, vocabulary 1,024) at a long sequence (8,192 tokens,
one sample), fp32, on gloo ranks with one thread each; every rank of the CP group holds two of 2 cp chunks.

  memory  the bytes autograd saves for the backward during one forward (saved_tensors_hooks, each storage
          counted once: activation memory, exact and independent of load), the most loaded rank's, for cp 1, 2
          and 4 and each comm type; reported as a ratio to cp 1's, and the planner's prediction of the same
          bytes (llamapipe.tools.parallel_estimate.activation_peaks, fp32, no recompute) over the measured.
  time    forward + backward of the whole model, cp 1 (one process) against cp 2 (two processes) at the same
          sequence length, p2p (ring) and allgather; --rounds rounds, the configurations round-robin inside a
          round so background load hits all alike; per step the slowest rank's wall time; the communication
          share is the wall time the attention spent blocked in communication (waiting for the ring's
          transfers, the all-gathers, the reduce-scatter) over the step. Reported: medians and the spread
          (min-max) over rounds, and cp 2's step time over cp 1's paired per round.
  a2a     the same step at cp 2 with a2a (Ulysses: all-to-alls swap the sequence split for a head split around
          attention) against the ring (p2p), at --a2a-seq tokens (8,192), alternating inside each round;
          medians, spreads and a2a's step over the ring's paired per round, and each one's communication share
          (the a2a's: the wall time in its all-to-alls).

Run: python -m benchmarks.bench_context_parallel [--modes memory,time,a2a] [--seq 8192] [--rounds 5]
(writes benchmarks/results/bench_context_parallel.json).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

import torch
import torch.distributed as dist

from benchmarks.launch import run_distributed
from benchmarks.results_io import write_json

MODEL = dict(num_layers=2, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4, num_query_groups=2,
             vocab_size=1024)


def _model(cp: int, comm: str, seq: int):
    from llamapipe.core.parallel_state import ParallelState
    from llamapipe.model.llama import LlamaConfig, LlamaModel
    rank = dist.get_rank() if dist.is_initialized() else 0
    group = dist.group.WORLD if cp > 1 else None
    ps = ParallelState(rank=rank, world_size=cp, cp_size=cp, cp_rank=rank, cp_group=group)
    config = LlamaConfig(**MODEL, max_position_embeddings=seq)
    return LlamaModel(config, ps, cp_comm_type=comm), ps


def _batch(seq: int) -> dict:
    """One sequence; each CP rank's model keeps its share of it."""
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, MODEL["vocab_size"], (1, seq + 1), generator=g)
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}


class SavedBytes:
    """Bytes autograd keeps for the backward, each storage once (parameters are weights, not activations)."""

    def __init__(self) -> None:
        self.total, self._seen = 0, set()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point() and not isinstance(t, torch.nn.Parameter):
            storage = t.untyped_storage()
            if storage.data_ptr() not in self._seen:
                self._seen.add(storage.data_ptr())
                self.total += storage.nbytes()
        return t


def _memory_rank(rank: int, world: int, comm: str, seq: int) -> int:
    torch.set_num_threads(1)
    model, _ = _model(world, comm, seq)
    batch = _batch(seq)
    tracker = SavedBytes()
    with torch.autograd.graph.saved_tensors_hooks(tracker.pack, lambda t: t):
        losses = model(input_ids=batch["tokens"], labels=batch["labels"])
    losses.sum().backward()
    return tracker.total


class CommTimer:
    """Wall time spent in the attention's blocking communication (patched into core.context_parallel)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    @contextlib.contextmanager
    def patched(self):
        from llamapipe.core.context_parallel import attention, ulysses
        targets = [(attention, n) for n in ("_wait", "gather_kv", "reduce_scatter")] + [(ulysses, "_exchange")]
        originals = {(module, n): getattr(module, n) for module, n in targets}

        def timed(fn):
            def wrapper(*args, **kwargs):
                start = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.seconds += time.perf_counter() - start
            return wrapper
        for (module, n), fn in originals.items():
            setattr(module, n, timed(fn))
        try:
            yield self
        finally:
            for (module, n), fn in originals.items():
                setattr(module, n, fn)


def _time_rank(rank: int, world: int, comm: str, seq: int, steps: int) -> list[tuple[float, float]]:
    torch.set_num_threads(1)
    model, _ = _model(world, comm, seq)
    batch = _batch(seq)
    out = []
    timer = CommTimer()
    with timer.patched():
        for step in range(steps + 1):       # the first step warms up
            if world > 1:
                dist.barrier()
            timer.seconds, start = 0.0, time.perf_counter()
            model(input_ids=batch["tokens"], labels=batch["labels"]).sum().backward()
            if step:
                out.append((time.perf_counter() - start, timer.seconds))
    return out


def memory(seq: int) -> dict:
    rows = {}
    for comm in ("p2p", "allgather"):
        for cp in (1, 2, 4):
            if cp == 1 and comm != "p2p":
                continue
            per_rank = run_distributed(_memory_rank, cp, comm, seq)
            rows[f"cp{cp}" + ("" if cp == 1 else f"-{comm}")] = max(per_rank)
    base, predicted = rows["cp1"], _predicted(seq)
    return {"seq": seq, "saved_bytes": rows, "ratio_to_cp1": {k: v / base for k, v in rows.items()},
            "predicted_bytes": predicted,
            "predicted_over_measured": {k: predicted[k.split("-")[0]] / v for k, v in rows.items()}}


def _predicted(seq: int) -> dict:
    """The planner's activation bytes per rank (llamapipe.tools.parallel_estimate, fp32, no recompute, pp 1)."""
    from llamapipe.model.llama import LlamaConfig
    from llamapipe.tools.parallel_estimate import Layout, activation_peaks
    config = LlamaConfig(**MODEL, max_position_embeddings=seq)
    out = {}
    for cp in (1, 2, 4):
        lay = Layout(tp=1, pp=1, vpp=1, dp=1, schedule="1f1b", micro_batch=1, recompute="none", dist_opt=False,
                     precision="fp32", cp=cp)
        out[f"cp{cp}"] = activation_peaks(config, lay, seq, 1)[0]
    return out


def timing(seq: int, rounds: int, steps: int, configs: tuple = (("cp1", 1, "p2p"), ("cp2-p2p", 2, "p2p"),
                                                              ("cp2-allgather", 2, "allgather"))) -> dict:
    samples = {name: [] for name, _, _ in configs}
    shares = {name: [] for name, _, _ in configs}
    for _ in range(rounds):
        for name, cp, comm in configs:
            per_rank = run_distributed(_time_rank, cp, comm, seq, steps)
            step = [max(r[i][0] for r in per_rank) for i in range(steps)]
            comm_s = [max(r[i][1] for r in per_rank) for i in range(steps)]
            samples[name].append(statistics.median(step))
            shares[name].append(statistics.median(c / s for c, s in zip(comm_s, step)))
    out = {"seq": seq, "rounds": rounds, "steps_per_round": steps, "configs": {}}
    for name in samples:
        paired = [s / b for s, b in zip(samples[name], samples[configs[0][0]])]
        out["configs"][name] = {"step_s_median": statistics.median(samples[name]),
                                "step_s_spread": [min(samples[name]), max(samples[name])],
                                "over_cp1_median": statistics.median(paired),
                                "over_cp1_spread": [min(paired), max(paired)],
                                "comm_share_median": statistics.median(shares[name])}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="memory,time")
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--time-seq", type=int, default=4096, help="sequence length of the time mode")
    parser.add_argument("--a2a-seq", type=int, default=8192, help="sequence length of the a2a mode")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                      "bench_context_parallel.json"))
    args = parser.parse_args()
    result = {}
    if "memory" in args.modes:
        result["memory"] = memory(args.seq)
        print("memory (saved activation bytes, most loaded rank):")
        for name, ratio in result["memory"]["ratio_to_cp1"].items():
            mib = result["memory"]["saved_bytes"][name] / 2 ** 20
            print(f"  {name:14s} {mib:8.1f} MiB  {ratio:.3f}x cp1   planner's prediction "
                  f"{result['memory']['predicted_over_measured'][name]:.3f}x the measured")
    if "time" in args.modes:
        result["time"] = timing(args.time_seq, args.rounds, args.steps)
        print(f"time (seq {args.time_seq}, {args.rounds} rounds x {args.steps} steps, forward+backward):")
        for name, row in result["time"]["configs"].items():
            print(f"  {name:14s} {row['step_s_median'] * 1e3:8.1f} ms  {row['over_cp1_median']:.3f}x cp1 "
                  f"(spread {row['over_cp1_spread'][0]:.3f}-{row['over_cp1_spread'][1]:.3f})  "
                  f"communication {row['comm_share_median']:.1%}")
    if "a2a" in args.modes:
        result["a2a"] = timing(args.a2a_seq, args.rounds, args.steps, (("cp2-p2p", 2, "p2p"), ("cp2-a2a", 2, "a2a")))
        print(f"a2a against the ring (cp 2, seq {args.a2a_seq}, {args.rounds} rounds x {args.steps} steps):")
        for name, row in result["a2a"]["configs"].items():
            print(f"  {name:14s} {row['step_s_median'] * 1e3:8.1f} ms (spread {row['step_s_spread'][0] * 1e3:.1f}-"
                  f"{row['step_s_spread'][1] * 1e3:.1f})  {row['over_cp1_median']:.3f}x the ring (spread "
                  f"{row['over_cp1_spread'][0]:.3f}-{row['over_cp1_spread'][1]:.3f})  communication "
                  f"{row['comm_share_median']:.1%}")
    write_json(args.out, result)


if __name__ == "__main__":
    main()
