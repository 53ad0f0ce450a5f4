"""Packed documents (--reset-attention-mask, issue 38): the step time with the block-causal mask against the plain
causal one, at 4,096 tokens per sample.

A small LLaMA (2 layers, hidden 256, 4 heads of 64, 2 query groups, vocabulary 1,024), one sample of --seq tokens,
fp32, one process with --threads threads. One step is the forward and backward of the whole model. Document
layouts of the sample (lengths drawn once from an exponential distribution with the given mean, seeded):

  causal       no document ids: causal SDPA over the sample (the baseline)
  1 document   the document path with one document: positions and ids given, one causal call
  mean 1024    documents of 1,024 tokens on average (a few per sample, the tail cut by the sample's end)
  mean 256     documents of 256 tokens on average
  mean 32      many short documents, attended in masked tiles of about 256 tokens

--rounds rounds, the layouts round-robin inside a round so background load hits all alike; per layout the
median step time and its ratio to causal's, paired per round (median, min-max). A second table times the
attention alone (forward + backward, same shapes) for the kernel the model runs (tiles of SDPA) against
SDPA with a boolean (s, s) mask over the whole sample, the kernel one would otherwise reach for.

Run: python -m benchmarks.bench_packed_documents [--seq 4096] [--rounds 5] [--threads 1]
(writes benchmarks/results/bench_packed_documents.json).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Optional

import torch
import torch.nn.functional as F

from benchmarks.results_io import write_json

MODEL = dict(num_layers=2, hidden_size=256, ffn_hidden_size=512, num_attention_heads=4, num_query_groups=2,
             vocab_size=1024)
LAYOUTS = {"causal": None, "1 document": 0, "mean 1024": 1024, "mean 256": 256, "mean 32": 32}


def document_ids(seq: int, mean: Optional[int]) -> Optional[torch.Tensor]:
    """(1, seq) document ids of one sample: exponential lengths of `mean` tokens (at least 1), or one document."""
    if mean is None:
        return None
    if mean == 0:
        return torch.zeros(1, seq, dtype=torch.long)
    g = torch.Generator().manual_seed(mean)
    lengths = []
    while sum(lengths) < seq:
        lengths.append(max(1, int(torch.empty(1).exponential_(1.0 / mean, generator=g))))
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:seq]
    return ids[None]


def positions(docs: torch.Tensor) -> torch.Tensor:
    """Each token's offset in its document (--reset-position-ids)."""
    index = torch.arange(docs.shape[1])
    starts = torch.zeros_like(index)
    new = torch.ones_like(index, dtype=torch.bool)
    new[1:] = docs[0, 1:] != docs[0, :-1]
    starts[new] = index[new]
    return (index - starts.cummax(0).values)[None]


def _step_time(model, tokens: torch.Tensor, docs: Optional[torch.Tensor]) -> float:
    extra = {} if docs is None else dict(document_ids=docs, position_ids=positions(docs))
    start = time.perf_counter()
    model(input_ids=tokens[:, :-1], labels=tokens[:, 1:], **extra).sum().backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def model_steps(seq: int, rounds: int) -> dict:
    from llamapipe.model.llama import LlamaConfig, LlamaModel
    model = LlamaModel(LlamaConfig(**MODEL, max_position_embeddings=seq))
    tokens = torch.randint(0, MODEL["vocab_size"], (1, seq + 1), generator=torch.Generator().manual_seed(1))
    docs = {name: document_ids(seq, mean) for name, mean in LAYOUTS.items()}
    for name in LAYOUTS:                     # warm up every path once
        _step_time(model, tokens, docs[name])
    times = {name: [] for name in LAYOUTS}
    for _ in range(rounds):
        for name in LAYOUTS:
            times[name].append(_step_time(model, tokens, docs[name]))
    return _summary(times, "causal") | {"documents": {n: None if d is None else int(d.max()) + 1
                                                        for n, d in docs.items()}}


def _attention_time(q, k, v, docs: Optional[torch.Tensor], kernel: str) -> float:
    from llamapipe.core.document_attention import document_attention, same_document
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    start = time.perf_counter()
    if kernel == "tiles":
        out = document_attention(q, k, v, docs)
    elif kernel == "dense mask":
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=same_document(docs, docs, True), enable_gqa=True)
    else:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out.sum().backward()
    return time.perf_counter() - start


def attention_only(seq: int, rounds: int) -> dict:
    g = torch.Generator().manual_seed(2)
    d = MODEL["hidden_size"] // MODEL["num_attention_heads"]
    q = torch.randn(1, MODEL["num_attention_heads"], seq, d, generator=g)
    k, v = (torch.randn(1, MODEL["num_query_groups"], seq, d, generator=g) for _ in range(2))
    cases = {"causal": (None, "causal")}
    for name, mean in LAYOUTS.items():
        if mean:
            docs = document_ids(seq, mean)
            cases[f"{name} tiles"], cases[f"{name} dense mask"] = (docs, "tiles"), (docs, "dense mask")
    times = {name: [] for name in cases}
    for _ in range(rounds):
        for name, (docs, kernel) in cases.items():
            times[name].append(_attention_time(q, k, v, docs, kernel))
    return _summary(times, "causal")


def _summary(times: dict, base: str) -> dict:
    rows = {}
    for name, samples in times.items():
        paired = [t / b for t, b in zip(samples, times[base])]
        rows[name] = {"step_s_median": statistics.median(samples), "step_s_spread": [min(samples), max(samples)],
                      "over_causal_median": statistics.median(paired), "over_causal_spread": [min(paired), max(paired)]}
    return {"rows": rows}


def _print(title: str, rows: dict) -> None:
    print(title)
    for name, row in rows.items():
        low, high = row["over_causal_spread"]
        print(f"  {name:22s} {row['step_s_median'] * 1e3:9.1f} ms  {row['over_causal_median']:.3f}x causal "
              f"(per round {low:.3f}-{high:.3f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                      "bench_packed_documents.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result = {"seq": args.seq, "rounds": args.rounds, "threads": args.threads, "model": MODEL,
              "load_before": os.getloadavg()[0]}
    result["model_step"] = model_steps(args.seq, args.rounds)
    _print(f"model step (seq {args.seq}, forward + backward, {args.rounds} rounds, {args.threads} thread(s)):",
           result["model_step"]["rows"])
    result["attention"] = attention_only(args.seq, args.rounds)
    _print("attention alone (forward + backward):", result["attention"]["rows"])
    write_json(args.out, result)


if __name__ == "__main__":
    main()
