"""Beside the peers: DeepSpeed's, megatron-core's and torch.distributed.pipelining's pipeline engines and ours, one
LLaMA-like model, the same machine, alternating rounds (issue 48).

Shape (the issue's): 8 layers, hidden 256, FFN 688, 8 heads with 4 key/value groups, sequence 256, micro-batch 2,
8 microbatches, fp32, p = 2 (torchrun, gloo, one thread per rank), at vocabulary 256 ("balanced": the head is
negligible) and 8192 ("vocab32": LLaMA 3's vocabulary-to-hidden ratio). Cases:
  ours        pretrain_llama.py --mock-data with 1f1b, interleaved (2 chunks), zbv, and the automatic configuration
              (--pipeline-schedule auto --pipeline-model-parallel-layout auto --enable-optimizer-post-validation);
              --clip-grad 100 (the norm is computed, clipping never triggers: the peers do not clip);
  peers       benchmarks/peers_worker.py: DeepSpeed's PipelineModule + TrainSchedule (1F1B), megatron-core 0.16.1's
              forward_backward_pipelining_without_interleaving / _with_interleaving (CPU-patched GPTModel,
              benchmarks/peers_megatron.py), torch's Schedule1F1B / ScheduleInterleaved1F1B /
              ScheduleZBVZeroBubble / ScheduleDualPipeV; each iteration ends with an Adam step.
Each case is one torchrun launch a round; the case order rotates every round so a drift of the machine hits all
alike. Per case: the median over rounds of the mean iteration time after the warm-up iterations, its spread (min-max
over rounds), the model FLOPs of one iteration, the first iteration's loss against ln(V). A peer that cannot be
imported or fails is a row with its one-line reason. Peers are the `[peers]` extra (DeepSpeed in a venv that sees
the global torch; see docs/benchmarks.md):

    /work/peers-venv/bin/python -m benchmarks.bench_peers --rounds 2 --iters 6 --warmup 4   # ~16 min on 2 cores
    python -m benchmarks.bench_peers --section benchmarks/results/bench_peers.json   # the docs section, printed
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import sys
import tempfile
import time

from benchmarks.launch import ROOT, read_metrics, torchrun

SHAPE = {"layers": 8, "hidden": 256, "ffn": 688, "heads": 8, "groups": 4, "seq": 256, "mbs": 2, "m": 8}
VOCABS = {"balanced": 256, "vocab32": 8192}
PP2 = ["--pipeline-model-parallel-size", "2"]
OURS = {"ours-1f1b": PP2 + ["--pipeline-schedule", "1f1b"],
        "ours-interleaved": PP2 + ["--pipeline-schedule", "interleaved", "--num-virtual-stages-per-pipeline-rank", "2"],
        "ours-zbv": PP2 + ["--pipeline-schedule", "zbv", "--num-virtual-stages-per-pipeline-rank", "2"],
        "ours-auto": PP2 + ["--pipeline-schedule", "auto", "--pipeline-model-parallel-layout", "auto",
                            "--enable-optimizer-post-validation"]}
PEERS = ["deepspeed-1f1b", "megatron-1f1b", "megatron-interleaved", "torch-1f1b", "torch-interleaved", "torch-zbv",
         "torch-dualpipev"]
# What each case's model body is and how it computes attention (the FLOPs below count the same dense maths for
# all: the bodies agree on RMSNorm, RoPE, SwiGLU, GQA, untied embeddings, no biases and the token cross-entropy).
BODY = {"ours": "llamapipe LlamaModel (SDPA, causal)", "torch": "llamapipe LlamaModel chunks (SDPA, causal)",
        "deepspeed": "llamapipe LlamaModel chunks (SDPA, causal)",
        "megatron": "megatron GPTModel, local spec (full s x s scores, masked)"}
PEER_MODULES = {"deepspeed": "deepspeed", "megatron": "megatron.core", "torch": "torch.distributed.pipelining"}


def model_flags(vocab: int) -> list[str]:
    s = SHAPE
    return ["--mock-data", "--num-layers", str(s["layers"]), "--hidden-size", str(s["hidden"]), "--ffn-hidden-size",
            str(s["ffn"]), "--num-attention-heads", str(s["heads"]), "--group-query-attention", "--num-query-groups",
            str(s["groups"]), "--seq-length", str(s["seq"]), "--max-position-embeddings", str(s["seq"]),
            "--micro-batch-size", str(s["mbs"]), "--global-batch-size", str(s["mbs"] * s["m"]), "--vocab-size",
            str(vocab), "--seed", "1234", "--lr", "1e-4", "--lr-warmup-iters", "1", "--log-interval", "1",
            "--eval-iters", "0", "--num-workers", "0", "--clip-grad", "100"]


def iteration_flops(vocab: int, shape: dict = SHAPE) -> float:
    """Model FLOPs of one training iteration (forward + backward = 3 x forward): the decoder's matmuls (QKV with
    `groups` key/value heads, output projection, SwiGLU's three), attention's two s x s products counted whole,
    and the output layer; norms, RoPE, softmax and the embedding lookup left out."""
    h, f, s, kv = shape["hidden"], shape["ffn"], shape["seq"], shape["groups"] * shape["hidden"] // shape["heads"]
    per_token_layer = 2 * h * (h + 2 * kv) + 2 * h * h + 2 * 3 * h * f + 2 * 2 * s * h
    tokens = shape["mbs"] * shape["m"] * s
    return 3.0 * tokens * (shape["layers"] * per_token_layer + 2 * h * vocab)


def framework(case: str) -> str:
    return case.split("-", 1)[0]


def missing_reason(case: str, find_spec=importlib.util.find_spec) -> str | None:
    """One line saying why a peer cannot run in this Python, or None when its module is importable."""
    name = PEER_MODULES.get(framework(case))
    if name is None:
        return None
    try:
        found = find_spec(name) is not None
    except (ImportError, ValueError):
        found = False
    if found:
        return None
    return (f"{case}: {name} is not importable from {sys.executable} (pip install '.[peers]'; DeepSpeed with "
            "DS_BUILD_OPS=0 into a venv made with --system-site-packages)")


def one_line(output: str) -> str:
    """The last line that names an error in a failed run's output, else its last non-empty line."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "Error" in ln or "error:" in ln]
    return (errors or lines or ["no output"])[-1][:300]


def run_case(case: str, vocab: int, iters: int, warmup: int) -> dict:
    """{"iter_s": mean seconds per iteration after `warmup` (max over ranks), "first_loss"} or {"error": one line}."""
    with tempfile.TemporaryDirectory() as tmp:
        if case in OURS:
            jsonl = os.path.join(tmp, "m.jsonl")
            proc = torchrun(2, model_flags(vocab) + OURS[case] + ["--train-iters", str(iters), "--metrics-jsonl",
                                                                   jsonl], timeout=1800)
            if proc.returncode != 0:
                return {"error": one_line(proc.stdout + proc.stderr)}
            records = read_metrics(jsonl)
            return {"iter_s": statistics.fmean(r["elapsed_ms"] for r in records[warmup:]) / 1e3,
                    "first_loss": records[0]["lm_loss"]}
        s = SHAPE
        args = ["--framework", case, "--vocab", str(vocab), "--iters", str(iters), "--out-dir", tmp]
        # no flag may be a prefix of one of torchrun's (it reads "--m" as its own, ambiguously)
        flags = {"layers": "layers", "hidden": "hidden", "ffn": "ffn", "heads": "heads", "groups": "groups",
                 "seq": "seq", "mbs": "micro-batch", "m": "microbatches"}
        args += [a for k, flag in flags.items() for a in (f"--{flag}", str(s[k]))]
        proc = torchrun(2, args, script=os.path.join("benchmarks", "peers_worker.py"), timeout=1800)
        if proc.returncode != 0:
            return {"error": one_line(proc.stdout + proc.stderr)}
        ranks = [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(2)]
    losses = [r["first_loss"] for r in ranks if r["first_loss"] is not None]
    return {"iter_s": max(statistics.fmean(r["iter_s"][warmup:]) for r in ranks),
            "first_loss": losses[0] if losses else None, "patches": ranks[0]["patches"]}


def measure(cases: list[str], vocab: int, rounds: int, iters: int, warmup: int) -> list[dict]:
    runnable = [c for c in cases if missing_reason(c) is None]
    runs: dict[str, list[dict]] = {c: [] for c in runnable}
    for k in range(rounds if runnable else 0):
        for case in runnable[k % len(runnable):] + runnable[:k % len(runnable)]:
            start = time.perf_counter()
            runs[case].append({**run_case(case, vocab, iters, warmup), "launch_s": time.perf_counter() - start})
            print(f"  round {k + 1} V={vocab} {case}: {runs[case][-1]}", flush=True)
    rows = [{"case": c, "vocab": vocab, "error": missing_reason(c)} for c in cases if c not in runs]
    for case, got in runs.items():
        failed = [r["error"] for r in got if "error" in r]
        if failed:
            rows.append({"case": case, "vocab": vocab, "error": failed[0]})
            continue
        times = [r["iter_s"] for r in got]
        rows.append({"case": case, "vocab": vocab, "iter_s": statistics.median(times),
                     "spread_s": [min(times), max(times)],
                     "rounds_s": times, "gflops_per_iter": iteration_flops(vocab) / 1e9,
                     "first_loss": got[0]["first_loss"], "ln_vocab": math.log(vocab), "body": BODY[framework(case)],
                     "patches": got[0].get("patches", []), "launch_s": statistics.median(r["launch_s"] for r in got)})
    return rows


def _paired(rows: dict, ours: str, theirs: str) -> dict | None:
    if ours not in rows or theirs not in rows:
        return None
    ratios = [a / b for a, b in zip(rows[ours]["rounds_s"], rows[theirs]["rounds_s"])]
    return {"ours": ours, "peer": theirs, "ratio": statistics.median(ratios), "spread": [min(ratios), max(ratios)]}


def comparisons(rows: list[dict]) -> list[dict]:
    """The issue's two measures: ours automatic vs the fastest peer at vocab32, ours ZB-V vs the fastest peer's 1F1B
    at the balanced shape (paired by round: ours / peer, below 1 when ours is faster)."""
    out = []
    for vocab, ours, suffix in ((VOCABS["vocab32"], "ours-auto", ""), (VOCABS["balanced"], "ours-zbv", "-1f1b")):
        ok = {r["case"]: r for r in rows if r["vocab"] == vocab and "iter_s" in r}
        peers = [c for c in ok if framework(c) != "ours" and c.endswith(suffix)]
        if peers:
            got = _paired(ok, ours, min(peers, key=lambda c: ok[c]["iter_s"]))
            if got:
                out.append({"vocab": vocab, **got})
    return out


def loss_check(rows: list[dict], tol: float = 0.01) -> list[str]:
    """One line per case whose first-iteration loss is more than `tol` (relative) from ours-1f1b's at its vocab."""
    bad = []
    for vocab in sorted({r["vocab"] for r in rows}):
        ok = {r["case"]: r for r in rows if r["vocab"] == vocab and r.get("first_loss") is not None}
        ref = ok.get("ours-1f1b")
        for case, r in ok.items():
            if ref and abs(r["first_loss"] - ref["first_loss"]) > tol * ref["first_loss"]:
                bad.append(f"V={vocab} {case}: first loss {r['first_loss']:.4f} vs ours-1f1b {ref['first_loss']:.4f}")
    return bad


def markdown_table(rows: list[dict]) -> str:
    lines = ["| V | case | ms / iteration (median, min-max) | GFLOP / iteration | GFLOP/s | first loss (ln V) | body |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['vocab']} | {r['case']} | not run: {r['error']} | | | | |")
            continue
        lo, hi = r["spread_s"]
        loss = "n/a" if r["first_loss"] is None else f"{r['first_loss']:.3f}"
        lines.append(f"| {r['vocab']} | {r['case']} | {1e3 * r['iter_s']:,.0f} ({1e3 * lo:,.0f}-{1e3 * hi:,.0f}) | "
                     f"{r['gflops_per_iter']:.1f} | {r['gflops_per_iter'] / r['iter_s']:.2f} | {loss} "
                     f"({r['ln_vocab']:.3f}) | {r['body']} |")
    return "\n".join(lines)


def section(result: dict) -> str:
    """The "Beside the peers" section of docs/benchmarks.md from a result file."""
    a = result["args"]
    cmd = (f"/work/peers-venv/bin/python -m benchmarks.bench_peers --rounds {a['rounds']} --iters {a['iters']} "
           f"--warmup {a['warmup']}")
    parts = ["## Beside the peers", "",
             "The issue-48 shape (8 layers, hidden 256, FFN 688, 8 heads / 4 KV groups, sequence 256, micro-batch 2, "
             "8 microbatches, fp32, p = 2, gloo, one thread per rank) through DeepSpeed, megatron-core, "
             "torch.distributed.pipelining and ours, cases alternating by round (benchmarks/bench_peers.py). "
             "Reproduce (peers are the `[peers]` extra; DeepSpeed in a venv that sees the global torch: "
             "`python -m venv --system-site-packages /work/peers-venv && DS_BUILD_OPS=0 /work/peers-venv/bin/pip "
             "install deepspeed`):", "", f"    {cmd}", "", markdown_table(result["rows"]), ""]
    for c in result.get("comparisons", []):
        parts.append(f"- V={c['vocab']}: {c['ours']} / {c['peer']} = {c['ratio']:.3f} "
                     f"(rounds {c['spread'][0]:.3f}-{c['spread'][1]:.3f}).")
    bad = result.get("loss_check", [])
    parts.append("- First-iteration losses within 1% of ours-1f1b: " + ("all." if not bad else "; ".join(bad)))
    parts.append("- Model bodies: torch and DeepSpeed run our LlamaModel's layers (even split), megatron-core its own "
                 "GPTModel (local spec) whose attention computes the full s x s scores and masks them, where SDPA's "
                 "causal kernel may skip the masked half; the FLOPs column counts attention whole for all.")
    patches = next((r["patches"] for r in result["rows"] if r["case"].startswith("megatron") and r.get("patches")), [])
    if patches:
        parts.append("- megatron-core CPU patches (benchmarks/peers_megatron.py): " + "; ".join(patches) + ".")
    return "\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", choices=list(VOCABS), default=list(VOCABS))
    p.add_argument("--cases", nargs="+", choices=list(OURS) + PEERS, default=list(OURS) + PEERS)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--iters", type=int, default=6, help="iterations per launch (ours: --train-iters)")
    p.add_argument("--warmup", type=int, default=4, help="untimed first iterations (ours' auto profiles in them)")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "bench_peers.json"))
    p.add_argument("--section", metavar="RESULT_JSON", help="print the docs section of an earlier run and exit")
    args = p.parse_args(argv)
    if args.section:
        print(section(json.load(open(args.section))), end="")
        return 0
    if args.warmup >= args.iters:
        p.error(f"--warmup {args.warmup} leaves no timed iteration of --iters {args.iters}")
    rows = [row for shape in args.shapes for row in measure(args.cases, VOCABS[shape], args.rounds, args.iters,
                                                             args.warmup)]
    result = {"args": vars(args), "shape": SHAPE, "rows": rows, "comparisons": comparisons(rows),
              "loss_check": loss_check(rows)}
    from benchmarks.results_io import write_json
    write_json(args.out, result, indent=1)
    md = os.path.splitext(args.out)[0] + ".md"
    with open(md, "w") as f:
        f.write(section(result))
    print(section(result))
    print(f"wrote {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
