"""Seq1F1B on CPU: peak activation bytes, step time and measured bubble with K sequence pieces per microbatch
against the same schedule on whole microbatches (issue 45's benchmark).

Two gloo ranks (one core each), LlamaModel with 8 layers, hidden 256, sequence 4096, micro-batch 1, 8
microbatches, fp32. Variants 1F1B and ZB-V, each with K = 1 and K = 4 (--num-seq-splits; ZB-V's K = 4 also with
pieces of equal length), run one step each in
alternating rounds (the first round is warm-up); per variant the medians and spread over the timed rounds of:
the step's wall time (slowest rank), each rank's peak saved activation bytes between actions (`ActivationProbe`:
forwards not yet backward; what a deferred W keeps after its B is not in it), and the per-rank timers'
compute / communication / idle split (`StepTimers`, idle share = measured bubble). Not a timed test.

    python -m benchmarks.bench_seq1f1b --rounds 3
    python -m benchmarks.bench_seq1f1b --rounds 3 --variants zbv-k1,zbv-k4 --out PATH    # some variants
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import torch

from benchmarks.launch import run_distributed
from benchmarks.results_io import write_json

# (schedule, chunks per rank, K, --seq1f1b-balance-method); ZB-V's pieces also by equal length: its order is
# list-scheduled at unit costs, and FLOPs-equal pieces need not take equal time on this CPU
VARIANTS = (("1f1b", 1, 1, "flops"), ("1f1b", 1, 4, "flops"), ("zbv", 2, 1, "flops"), ("zbv", 2, 4, "flops"),
            ("zbv", 2, 4, "length"))


def _name(schedule: str, k: int, method: str) -> str:
    return f"{schedule}-k{k}" + ("-length" if method == "length" else "")


def _config(layers: int, hidden: int, seq: int):
    from llamapipe.model.llama import LlamaConfig
    return LlamaConfig(num_layers=layers, hidden_size=hidden, ffn_hidden_size=int(hidden * 8 / 3) // 64 * 64,
                       num_attention_heads=hidden // 64, num_query_groups=hidden // 64, vocab_size=1024,
                       max_position_embeddings=seq)


def _forward_step(data_iterator, model):
    batch = next(data_iterator) if data_iterator is not None else None
    out = model(input_ids=batch["tokens"] if model.pre_process else None,
                labels=batch["labels"] if model.post_process else None)
    return out, lambda per_token: (per_token.float().sum(), torch.tensor(per_token.numel()), {})


def _chunks(ps, config, schedule: str, vpp: int) -> list:
    from llamapipe.core.pipeline_parallel.schedule_ir import stage_of
    from llamapipe.core.pipeline_parallel.schedule_specs import SPECS
    from llamapipe.model.llama import LlamaModel
    placement, stages = SPECS[schedule].placement(vpp), ps.pp_size * vpp
    per = config.num_layers // stages
    return [LlamaModel(config, ps, layer_range=(s * per, (s + 1) * per), pre_process=s == 0,
                       post_process=s == stages - 1)
            for s in (stage_of(ps.pp_rank, c, ps.pp_size, placement) for c in range(vpp))]


def _selected(names: tuple[str, ...]) -> tuple:
    """The VARIANTS named in `names` (all when empty), in VARIANTS' order."""
    return tuple(v for v in VARIANTS if not names or _name(v[0], v[2], v[3]) in names)


def worker(rank: int, world: int, layers: int, hidden: int, seq: int, m: int, rounds: int,
           names: tuple[str, ...] = ()) -> dict:
    import torch.distributed as dist
    from llamapipe.core.parallel_state import destroy_model_parallel, initialize_model_parallel
    from llamapipe.core.pipeline_parallel.activation_memory import ActivationProbe
    from llamapipe.core.pipeline_parallel.runtime import RuntimeOptions
    from llamapipe.core.pipeline_parallel.schedules import get_forward_backward_func
    from llamapipe.core.pipeline_parallel.seq_split import SeqSplits
    from llamapipe.core.pipeline_parallel.step_timers import StepTimers
    torch.set_num_threads(1)
    config = _config(layers, hidden, seq)
    ps0 = initialize_model_parallel(1, world)
    setups = {}
    for schedule, vpp, k, method in _selected(names):
        ps = dataclasses.replace(ps0, vpp_size=vpp)
        chunks = _chunks(ps, config, schedule, vpp)
        probe, timers = ActivationProbe(chunks), StepTimers(level=2)
        splits = SeqSplits.for_model(k, method, hidden, config.ffn_hidden_size, config.num_attention_heads,
                                     config.head_dim, config.num_query_groups) if k > 1 else None
        fb = get_forward_backward_func(ps, schedule, options=RuntimeOptions(observers=(probe, timers),
                                                                            seq_splits=splits))
        setups[(schedule, vpp, k, method)] = (chunks, fb, probe, timers)
    out = {_name(s, k, method): {"step_s": [], "peak_bytes": [], "timers": []}
           for s, _, k, method in _selected(names)}
    g = torch.Generator().manual_seed(1)
    try:
        for r in range(rounds + 1):
            for (schedule, vpp, k, method), (chunks, fb, probe, timers) in setups.items():
                batches = [{"tokens": torch.randint(0, 1024, (1, seq), generator=g),
                            "labels": torch.randint(0, 1024, (1, seq), generator=g)} for _ in range(m)]
                dist.barrier()
                timers.restart()
                start = time.perf_counter()
                fb(forward_step_func=_forward_step, data_iterator=[iter(batches) for _ in chunks], model=chunks,
                   num_microbatches=m)
                timers.mark()
                took = torch.tensor([time.perf_counter() - start])
                dist.all_reduce(took, op=dist.ReduceOp.MAX)
                for c in chunks:
                    c.zero_grad(set_to_none=True)
                if r == 0:
                    timers.interval()
                    continue
                row = out[_name(schedule, k, method)]
                row["step_s"].append(float(took))
                row["peak_bytes"].append(probe.peaks[-1])
                row["timers"].append(timers.interval())
    finally:
        destroy_model_parallel()
    return out


def _median_spread(values: list[float]) -> tuple[float, float]:
    return statistics.median(values), (max(values) - min(values)) if values else 0.0


def summarize(results: list[dict]) -> dict:
    rows = {}
    for name in results[0]:
        step, spread = _median_spread(results[0][name]["step_s"])
        ranks = []
        for rank, r in enumerate(results):
            t = {key: statistics.median(step_t[key] for step_t in r[name]["timers"]) for key in r[name]["timers"][0]}
            ranks.append({"rank": rank, "peak_bytes": statistics.median(r[name]["peak_bytes"]),
                          "bubble": t["idle"] / t["iteration"] if t["iteration"] else 0.0,
                          "compute_s": t["compute"], "communication_s": t["communication"], "idle_s": t["idle"],
                          "forward_s": t.get("forward-compute", 0.0), "backward_s": t.get("backward-compute", 0.0),
                          "weight_s": t.get("backward-weight-compute", 0.0)})
        rows[name] = {"step_s": step, "step_spread_s": spread, "ranks": ranks}
    for schedule, name in (("1f1b", "1f1b-k4"), ("zbv", "zbv-k4"), ("zbv", "zbv-k4-length")):
        if name not in rows or f"{schedule}-k1" not in rows:
            continue
        base, split = rows[f"{schedule}-k1"], rows[name]
        split["peak_ratio"] = max(r["peak_bytes"] for r in split["ranks"]) / max(r["peak_bytes"] for r in base["ranks"])
        split["step_ratio"] = split["step_s"] / base["step_s"]
    return rows


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3, help="timed rounds after one warm-up round")
    p.add_argument("--variants", default="", help="comma-separated variants to run (default all): "
                   + ", ".join(_name(s, k, method) for s, _, k, method in VARIANTS))
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "bench_seq1f1b.json"))
    args = p.parse_args(argv)
    names = tuple(n for n in args.variants.split(",") if n)
    known = [_name(s, k, method) for s, _, k, method in VARIANTS]
    if any(n not in known for n in names):
        p.error(f"--variants {args.variants}: each must be one of {', '.join(known)}")
    results = run_distributed(worker, 2, args.layers, args.hidden, args.seq, args.microbatches, args.rounds,
                              names, timeout=3600)
    rows = summarize(results)
    print(f"{'variant':<13} {'step s':>8} {'spread':>7} {'vs K=1':>7} {'peak MB r0/r1':>15} {'vs K=1':>7} "
          f"{'bubble r0/r1':>13}  compute/comm/idle s (r0; r1)")
    for name, row in rows.items():
        ranks = row["ranks"]
        peaks = "/".join(f"{r['peak_bytes'] / 2**20:.0f}" for r in ranks)
        bubbles = "/".join(f"{r['bubble']:.3f}" for r in ranks)
        split = "; ".join(f"{r['compute_s']:.1f}/{r['communication_s']:.1f}/{r['idle_s']:.1f}" for r in ranks)
        print(f"{name:<13} {row['step_s']:>8.2f} {row['step_spread_s']:>7.2f} {row.get('step_ratio', 1.0):>7.3f} "
              f"{peaks:>15} {row.get('peak_ratio', 1.0):>7.3f} {bubbles:>13}  {split}")
    write_json(args.out, {"args": vars(args), "rows": rows}, indent=1)
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
