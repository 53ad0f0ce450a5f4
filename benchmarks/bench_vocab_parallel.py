"""Vocabulary parallelism (--enable-vocab-parallel, arXiv 2411.05288): does splitting the output layer and the
input embedding over the pipeline balance the ranks? Two measurements, each with and without the split, on gloo
ranks with one thread each:

  memory  p=4, a model whose vocabulary dominates (32,000 tokens, hidden 128, 8 layers), 1F1B, m=8: each rank's
          peak resident memory over what it held before building its chunks (weights, gradients, AdamW state,
          activations and logits of two training steps), read from ru_maxrss in fresh processes, median per
          rank over --mem-repeats; reported: the most loaded rank's peak over the mean rank's.
  time    p=2, m=4, the real-mode model of bench_schedules.py (8 layers, hidden 256, seq 256, batch 2, vocabulary
          1,024): whole training iterations (forward-backward, gradient finalisation, AdamW step) back to back
          (schedules_overlap.TrainIteration), synchronous ZB-V, ZB-V with post-validation and vocabulary
          parallelism, ZB-V with vocabulary parallelism alone, and torch's ScheduleZBVZeroBubble; steady-state
          seconds per iteration (MAX over ranks) and each rank's main-thread CPU seconds per iteration (busy),
          round-robin over rounds so background load hits all alike. Reported: the busiest rank's busy time over
          the mean rank's, and per-iteration time paired against synchronous ZB-V and torch's ZB-V.

Run: python -m benchmarks.bench_vocab_parallel [--modes memory,time]
(writes benchmarks/results/bench_vocab_parallel.json).
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import resource
import statistics

import torch
import torch.distributed as dist

from benchmarks.launch import run_distributed
from benchmarks.results_io import write_json


def vocab_loss_step(data_iterator, model):
    """`schedules_real.loss_step` for a vocabulary-parallel model: the last stage hands its targets to S/T."""
    from llamapipe.core.tensor_parallel.vocab_pipeline import VocabTargets
    batch = next(data_iterator) if data_iterator is not None else {}
    out = model(**batch)
    if not model.post_process:
        return out, None
    labels = batch["labels"]
    loss = lambda o: (o.float().sum(), torch.tensor(o.numel()), {})     # noqa: E731 (the token sum, as ours)
    return out, VocabTargets(labels, torch.ones(labels.shape), loss)


def model_chunks(config, ps, schedule: str, vpp: int, vocab: bool) -> list:
    """This rank's chunks placed as `schedule` places them, the output layer split over the pipeline if `vocab`."""
    from benchmarks.schedules_real import placement
    from llamapipe.core.pipeline_parallel.schedule_ir import stage_of
    from llamapipe.model.llama import LlamaModel
    stages, per = ps.pp_size * vpp, config.num_layers // (ps.pp_size * vpp)
    chunks = []
    for c in range(vpp):
        s = stage_of(ps.pp_rank, c, ps.pp_size, placement(schedule, vpp))
        chunks.append(LlamaModel(config, ps, layer_range=(s * per, (s + 1) * per), pre_process=s == 0,
                                 post_process=s == stages - 1, vocab_parallel=vocab, vocab_shard=vocab and c == 0))
    return chunks


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory_worker(rank: int, world: int, args, vocab: bool) -> dict:
    from benchmarks.schedules_overlap import TrainIteration
    from benchmarks.schedules_real import loss_step
    from llamapipe.core.parallel_state import initialize_model_parallel
    from llamapipe.core.pipeline_parallel.schedules import get_forward_backward_func
    from llamapipe.model.llama import LlamaConfig
    torch.set_num_threads(1)
    ps = initialize_model_parallel(1, world)
    config = LlamaConfig(num_layers=8, hidden_size=128, ffn_hidden_size=352, num_attention_heads=4,
                         num_query_groups=2, vocab_size=args.mem_vocab, max_position_embeddings=args.mem_seq)
    g = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, config.vocab_size, (1, args.mem_seq), generator=g),
                "labels": torch.randint(0, config.vocab_size, (1, args.mem_seq), generator=g)}
               for _ in range(args.mem_m)]
    before = _rss_bytes()
    chunks = model_chunks(config, ps, "1f1b", 1, vocab)
    fb = get_forward_backward_func(ps, "1f1b")
    step = vocab_loss_step if vocab else loss_step
    iterators = lambda: [iter(batches) for _ in range(1 + vocab)]    # noqa: E731 (vocab: the embedding shard's too)
    run = TrainIteration(chunks, ps, lambda: fb(forward_step_func=step, data_iterator=iterators(),
                                                model=chunks, num_microbatches=args.mem_m),
                         float(args.mem_m * args.mem_seq), False)
    for _ in range(2):
        run()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024     # KiB on Linux
    return {"rank": rank, "peak_bytes": max(peak - before, 0)}


def time_worker(rank: int, world: int, args) -> list[dict]:
    from benchmarks.schedules_overlap import TrainIteration, _torch_zbv, timed_iterations
    from benchmarks.schedules_real import llama_config, loss_step
    from llamapipe.core.parallel_state import initialize_model_parallel
    from llamapipe.core.pipeline_parallel.schedules import get_forward_backward_func
    torch.set_num_threads(1)
    if args.pin and len(os.sched_getaffinity(0)) >= world:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank]})
    ps0, config, m = initialize_model_parallel(1, world), llama_config(args), args.m
    ps = dataclasses.replace(ps0, vpp_size=2)
    g = torch.Generator().manual_seed(m)
    batches = [{"input_ids": torch.randint(0, 1024, (args.batch, args.seq), generator=g),
                "labels": torch.randint(0, 1024, (args.batch, args.seq), generator=g)} for _ in range(m)]
    tokens = float(m * args.batch * args.seq)

    def ours(vocab: bool, pv: bool) -> TrainIteration:
        chunks = model_chunks(config, ps, "zbv", 2, vocab)
        fb = get_forward_backward_func(ps, "zbv")
        step = vocab_loss_step if vocab else loss_step
        iterators = [itertools.cycle(batches) for _ in range(len(chunks) + vocab)]   # vocab: the embedding's too
        return TrainIteration(chunks, ps, lambda: fb(forward_step_func=step, model=chunks, num_microbatches=m,
                                                     data_iterator=iterators), tokens, pv)
    runs = {"zbv": ours(False, False), "zbv+vocab": ours(True, False), "zbv+pv+vocab": ours(True, True),
            "torch-zbv": _torch_zbv(config, ps0, m, batches, tokens)}
    for run in runs.values():
        for _ in range(2):
            run()
        run.drain()
    steady, busy = timed_iterations(ps0, runs, args.rounds, args.iters)
    dist.barrier()
    return [{"schedule": n, "m": m, "iter_s": statistics.median(s), "busy_s": busy[n], "rounds_s": s}
            for n, s in steady.items()]


def _paired(rows: dict, name: str, base: str) -> dict:
    ratios = [a / b for a, b in zip(rows[name]["rounds_s"], rows[base]["rounds_s"])]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def time_summary(rows: list[dict]) -> dict:
    by = {r["schedule"]: r for r in rows}
    out = {n: {"busiest_over_mean_busy": max(r["busy_s"]) / statistics.mean(r["busy_s"])} for n, r in by.items()}
    for n in ("zbv+vocab", "zbv+pv+vocab"):
        out[n]["iter_vs_zbv"] = _paired(by, n, "zbv")
        out[n]["iter_vs_torch_zbv"] = _paired(by, n, "torch-zbv")
    # a perfectly balanced, bubble-free iteration: every rank's mean work with the split, over the busiest rank's
    # work in synchronous ZB-V (what bounds its iteration) and over its measured iteration
    mean_busy = statistics.mean(by["zbv+vocab"]["busy_s"])
    out["balanced_bound_vs_zbv_busiest"] = mean_busy / max(by["zbv"]["busy_s"])
    out["balanced_bound_vs_zbv_iter"] = mean_busy / by["zbv"]["iter_s"]
    return out


def memory_mode(args) -> dict:
    """Fresh processes per repeat and setting (ru_maxrss only grows); per rank the median peak over repeats."""
    mem: dict = {"last_stage_head": [], "vocab_parallel": []}
    for _ in range(args.mem_repeats):
        for vocab in (False, True):
            peaks = [r["peak_bytes"] / 2 ** 20 for r in run_distributed(memory_worker, 4, args, vocab, timeout=900)]
            mem["vocab_parallel" if vocab else "last_stage_head"].append(peaks)
            print(f"memory, vocab parallel {vocab}: peaks {[round(x) for x in peaks]} MiB, "
                  f"max/mean {max(peaks) / statistics.mean(peaks):.3f}", flush=True)
    summary = {}
    for name, repeats in mem.items():
        median = [statistics.median(rank) for rank in zip(*repeats)]
        summary[name] = {"peak_mib_median": median, "max_over_mean": max(median) / statistics.mean(median),
                         "max_over_mean_each": [max(r) / statistics.mean(r) for r in repeats]}
    return {"repeats_peak_mib": mem, "summary": summary}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default="memory,time")
    p.add_argument("--mem-vocab", type=int, default=32000)
    p.add_argument("--mem-seq", type=int, default=256)
    p.add_argument("--mem-m", type=int, default=8)
    p.add_argument("--mem-repeats", type=int, default=3)
    p.add_argument("--m", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=4)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--no-pin", dest="pin", action="store_false")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "bench_vocab_parallel.json"))
    args = p.parse_args(argv)
    result: dict = {"args": vars(args), "loadavg_before": os.getloadavg()}
    if "memory" in args.modes:
        result["memory"] = memory_mode(args)
    if "time" in args.modes:
        rows = run_distributed(time_worker, 2, args, timeout=1800)[0]
        result["time"] = {"rows": rows, "summary": time_summary(rows)}
        for r in rows:
            print(f"{r['schedule']:<14} iter {1e3 * r['iter_s']:8.1f} ms  busy per rank "
                  f"{[round(1e3 * b, 1) for b in r['busy_s']]} ms", flush=True)
        print(result["time"]["summary"], flush=True)
    result["loadavg_after"] = os.getloadavg()
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
