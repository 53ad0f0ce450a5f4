"""Model FLOPs utilisation of a ~1.1B LLaMA (TinyLlama-1.1B shape) training step on one GPU in bf16.

    python benchmarks/bench_mfu.py [--seq-length 2048] [--micro-batch-size 4] [--iters 10]

Prints tokens/s, TFLOP/s and MFU (FLOPs counted as in training/log.py, peak from the device name)
and writes JSON. Needs CUDA; on a CPU-only machine it says so and exits 0 without numbers.
"""
from __future__ import annotations

import argparse
import sys
import time


import torch

from llamapipe.training.log import device_peak_tflops, flops_per_token
from llamapipe.model.llama import LlamaConfig, LlamaModel
from benchmarks.results_io import write_json

TINYLLAMA_1B = LlamaConfig(num_layers=22, hidden_size=2048, ffn_hidden_size=5632, num_attention_heads=32,
                           num_query_groups=4, vocab_size=32000, max_position_embeddings=4096)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default="benchmarks/results/bench_mfu.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_mfu: CUDA is not available on this machine; nothing measured")
        return 0
    model = LlamaModel(TINYLLAMA_1B, params_dtype=torch.bfloat16).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = torch.randint(0, TINYLLAMA_1B.vocab_size, (args.micro_batch_size, args.seq_length), device="cuda")
    labels = torch.roll(tokens, -1, dims=1)

    def step() -> None:
        loss = model(tokens, labels=labels).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.iters):
        step()
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / args.iters
    tokens_per_sec = args.micro_batch_size * args.seq_length / seconds
    tflops = flops_per_token(TINYLLAMA_1B, args.seq_length) * tokens_per_sec / 1e12
    peak = device_peak_tflops()
    result = {"device": torch.cuda.get_device_name(), "params": sum(q.numel() for q in model.parameters()),
              "seq_length": args.seq_length, "micro_batch_size": args.micro_batch_size,
              "step_ms": seconds * 1e3, "tokens_per_sec": tokens_per_sec, "tflops": tflops,
              "peak_tflops": peak, "mfu": tflops / peak if peak else None,
              "max_memory_gib": torch.cuda.max_memory_allocated() / 2 ** 30}
    for key, value in result.items():
        print(f"{key:>18}: {value}")
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
