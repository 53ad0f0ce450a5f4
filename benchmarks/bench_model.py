"""Training-step throughput of our LlamaModel against HF transformers' LlamaForCausalLM (single process).

One step is forward + backward of the same small LLaMA with identical weights (converted with from_hf),
HF with attn_implementation="sdpa". Runs with 1 thread and with all threads; steps of the two models are
interleaved, so both see the same background load, and the median of `--repeats` timings is compared (the
best-of ratio is reported too). Process CPU time per step is reported as well: on a shared, loaded machine
the 1-thread CPU-time ratio is the trustworthy comparison.
Prints a table of tokens/s and the ratio, and writes JSON.

    python benchmarks/bench_model.py --out benchmarks/results/bench_model.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch


from llamapipe.model.hf_checkpoint import from_hf
from llamapipe.model.llama import LlamaModel


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


def measure(ours, hf, args: argparse.Namespace, threads: int) -> dict:
    torch.set_num_threads(threads)
    ids = torch.randint(0, args.vocab_size, (args.batch_size, args.seq_length + 1))
    inputs, labels = ids[:, :-1], ids[:, 1:]

    def ours_step() -> None:
        ours.zero_grad(set_to_none=True)
        ours(inputs, labels=labels).mean().backward()

    def hf_step() -> None:
        hf.zero_grad(set_to_none=True)
        hf(input_ids=inputs, labels=inputs).loss.backward()

    for step in (ours_step, hf_step):
        time_steps(step, args.warmup)
    ours_times, hf_times = [], []
    for _ in range(args.repeats):  # alternate so both models see the same background load
        ours_times.append(time_steps(ours_step, args.steps))
        hf_times.append(time_steps(hf_step, args.steps))
    tokens = args.batch_size * args.seq_length
    ours_wall, hf_wall = (statistics.median(t[0] for t in times) for times in (ours_times, hf_times))
    ours_cpu, hf_cpu = (statistics.median(t[1] for t in times) for times in (ours_times, hf_times))
    best_ratio = min(t[0] for t in hf_times) / min(t[0] for t in ours_times)
    return {"threads": threads, "ours_tokens_per_s": tokens / ours_wall, "hf_tokens_per_s": tokens / hf_wall,
            "ratio": hf_wall / ours_wall, "best_ratio": best_ratio, "cpu_time_ratio": hf_cpu / ours_cpu,
            "ours_step_s": ours_wall, "hf_step_s": hf_wall, "ours_cpu_s": ours_cpu, "hf_cpu_s": hf_cpu,
            "loadavg_1min": os.getloadavg()[0]}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--ffn-hidden-size", type=int, default=688)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--num-heads", type=int, default=8)
    p.add_argument("--num-groups", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", default="benchmarks/results/bench_model.json")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    ours, hf = build_models(args)
    all_threads = torch.get_num_threads()
    rows = [measure(ours, hf, args, t) for t in sorted({1, all_threads})]
    print(f"{'threads':>7} {'ours tok/s':>11} {'HF tok/s':>10} {'ours/HF':>8} {'best-of':>8} {'CPU-time ratio':>15} "
          f"{'load':>5}")
    for r in rows:
        print(f"{r['threads']:>7} {r['ours_tokens_per_s']:>11.0f} {r['hf_tokens_per_s']:>10.0f} "
              f"{r['ratio']:>8.2f} {r['best_ratio']:>8.2f} {r['cpu_time_ratio']:>15.2f} {r['loadavg_1min']:>5.1f}")
    result = {"benchmark": "model_train_step", "config": vars(args), "torch": torch.__version__,
              "platform": platform.platform(), "results": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
