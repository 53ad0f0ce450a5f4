"""Training-step throughput of our LlamaModel, eager and under --compile, against HF transformers'
LlamaForCausalLM (single process).

One step is forward + backward of the same small LLaMA with identical weights (converted with from_hf),
HF with attn_implementation="sdpa". The compiled model is ours after `llamapipe.model.compile.compile_chunks`
(the --compile path: each decoder layer and the final norm compiled, linear layers eager); its compile time
is reported. Runs with 1 thread and with all threads. Each repeat times one step of every model back to
back, so a repeat's ratios compare models under the same background load; the table gives the median of
those per-repeat (paired) ratios with their min-max spread, the median tokens/s, and the 1-minute load
average before and after. Process CPU time per step is reported as well: on a shared, loaded machine the
1-thread CPU-time ratio is the trustworthy comparison. Prints a table and writes JSON.

    python -m benchmarks.bench_model --out benchmarks/results/bench_model.json
"""
from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import time
from functools import partial

import torch


from llamapipe.model.llama.hf import from_hf
from llamapipe.model.llama import LlamaModel
from benchmarks.results_io import write_json


def build_models(args: argparse.Namespace):
    import transformers
    hf_config = transformers.LlamaConfig(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size, intermediate_size=args.ffn_hidden_size,
        num_hidden_layers=args.num_layers, num_attention_heads=args.num_heads, num_key_value_heads=args.num_groups,
        max_position_embeddings=args.seq_length, attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_config).train()
    config, state_dict = from_hf(hf.state_dict(), hf_config)
    ours = LlamaModel(config)
    ours.load_state_dict(state_dict)
    return ours, hf


def time_steps(step, steps: int) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) per step."""
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step()
    return (time.perf_counter() - wall) / steps, (time.process_time() - cpu) / steps


def measure(models: dict, args: argparse.Namespace, threads: int) -> dict:
    """Median step times of every model and paired ratios against HF, over `args.repeats` rounds."""
    torch.set_num_threads(threads)
    ids = torch.randint(0, args.vocab_size, (args.batch_size, args.seq_length + 1))
    inputs, labels = ids[:, :-1], ids[:, 1:]

    def ours_step(model) -> None:
        model.zero_grad(set_to_none=True)
        model(inputs, labels=labels).mean().backward()

    def hf_step(model) -> None:
        model.zero_grad(set_to_none=True)
        model(input_ids=inputs, labels=inputs).loss.backward()

    steps = {name: partial(hf_step if name == "hf" else ours_step, model) for name, model in models.items()}
    for step in steps.values():
        time_steps(step, args.warmup)
    load_before = os.getloadavg()[0]
    times = {name: [] for name in steps}
    names = list(steps)
    for r in range(args.repeats):  # one step of each per round, in a rotating order: the same load for all
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(time_steps(steps[name], args.steps))
    tokens = args.batch_size * args.seq_length
    row = {"threads": threads, "loadavg_1min_before": load_before, "loadavg_1min_after": os.getloadavg()[0]}
    for name, runs in times.items():
        row[f"{name}_tokens_per_s"] = tokens / statistics.median(t[0] for t in runs)
        row[f"{name}_cpu_s"] = statistics.median(t[1] for t in runs)
        row[f"{name}_rounds_s"] = [t[0] for t in runs]
    for name in (n for n in times if n != "hf"):
        ratios = [h[0] / o[0] for h, o in zip(times["hf"], times[name])]
        row[f"{name}_vs_hf"] = statistics.median(ratios)
        row[f"{name}_vs_hf_spread"] = [min(ratios), max(ratios)]
        row[f"{name}_vs_hf_cpu_time"] = row["hf_cpu_s"] / row[f"{name}_cpu_s"]
    if "compiled" in times:
        ratios = [e[0] / c[0] for e, c in zip(times["eager"], times["compiled"])]
        row["compiled_vs_eager"] = statistics.median(ratios)
        row["compiled_vs_eager_spread"] = [min(ratios), max(ratios)]
    return row


def add_model_shape_args(p: argparse.ArgumentParser, num_layers: int) -> None:
    """The benchmark model's shape (also benchmarks/bench_compile.py's)."""
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--ffn-hidden-size", type=int, default=688)
    p.add_argument("--num-layers", type=int, default=num_layers)
    p.add_argument("--num-heads", type=int, default=8)
    p.add_argument("--num-groups", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--seq-length", type=int, default=256)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_shape_args(p, num_layers=4)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--no-compile", action="store_true", help="leave out the --compile rows")
    p.add_argument("--out", default="benchmarks/results/bench_model.json")
    return p.parse_args()


def print_table(rows: list[dict], names: list[str]) -> None:
    print(f"{'threads':>7} {'model':>9} {'tok/s':>7} {'vs HF (paired median, min-max)':>31} {'CPU-time':>8} "
          f"{'load before/after':>17}")
    for r in rows:
        for name in names:
            vs = (f"{r[name + '_vs_hf']:.2f} ({r[name + '_vs_hf_spread'][0]:.2f}-{r[name + '_vs_hf_spread'][1]:.2f})"
                  if name != "hf" else "1.00")
            cpu = f"{r[name + '_vs_hf_cpu_time']:.2f}" if name != "hf" else "1.00"
            print(f"{r['threads']:>7} {name:>9} {r[name + '_tokens_per_s']:>7.0f} {vs:>31} {cpu:>8} "
                  f"{r['loadavg_1min_before']:>8.1f}/{r['loadavg_1min_after']:<8.1f}")
        if "compiled_vs_eager" in r:
            lo, hi = r["compiled_vs_eager_spread"]
            print(f"{r['threads']:>7} compiled / eager: {r['compiled_vs_eager']:.2f} (min-max {lo:.2f}-{hi:.2f})")


def main() -> None:
    args = parse_args()
    eager, hf = build_models(args)
    models = {"eager": eager}
    compile_s = None
    if not args.no_compile:
        from llamapipe.model.compile import compile_chunks
        compiled = copy.deepcopy(eager)
        compile_s = compile_chunks([compiled], micro_batch_size=args.batch_size, seq_length=args.seq_length)
        models["compiled"] = compiled
    models["hf"] = hf
    all_threads = torch.get_num_threads()
    rows = [measure(models, args, t) for t in sorted({1, all_threads})]
    print_table(rows, list(models))
    if compile_s is not None:
        print(f"compile time: {compile_s:.1f} s (inductor; a warm on-disk cache makes it seconds)")
    result = {"benchmark": "model_train_step", "config": vars(args), "torch": torch.__version__,
              "platform": platform.platform(), "compile_s": compile_s, "results": rows}
    write_json(args.out, result)


if __name__ == "__main__":
    main()
