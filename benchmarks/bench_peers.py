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

--timers adds where the time goes (benchmarks/peers_timers.py): ours' per-rank timers (--timing-log-level 2: F, B,
W, communication, idle) and what `auto` chose; each peer rank's main-thread CPU share. --pp 4 --synthetic runs every
framework's own schedule engine over SLEEPING stages (benchmarks/peers_synthetic.py, bench_schedules' synthetic
mode), so 4 ranks on 2 cores still measure the schedules; those rows are marked synthetic and compared with the
ideal m x (F + B + W) per rank, not with the real runs:

    /work/peers-venv/bin/python -m benchmarks.bench_peers --pp 4 --synthetic --sleep-ms 10 --rounds 2 --iters 5 \
        --warmup 3       # 12 launches a round, 20-37 s each: 12 min on a loaded 2-core machine (--rounds 1: half)
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

from benchmarks import peers_timers
from benchmarks.peers_report import markdown_table, section   # noqa: F401 (the docs section; tests use both)
from benchmarks.launch import ROOT, read_metrics, torchrun

SHAPE = {"layers": 8, "hidden": 256, "ffn": 688, "heads": 8, "groups": 4, "seq": 256, "mbs": 2, "m": 8}
VOCABS = {"balanced": 256, "vocab32": 8192}
AUTO = ["--pipeline-schedule", "auto", "--pipeline-model-parallel-layout", "auto", "--enable-optimizer-post-validation"]
TWO = ["--num-virtual-stages-per-pipeline-rank", "2"]
OURS = {"ours-1f1b": ["--pipeline-schedule", "1f1b"], "ours-interleaved": ["--pipeline-schedule", "interleaved"] + TWO,
        "ours-zbv": ["--pipeline-schedule", "zbv"] + TWO, "ours-auto": AUTO,
        "ours-auto-v": AUTO + TWO}      # auto over two chunks per rank: ZB-V is among its candidates
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


def _ours(case: str, vocab: int, iters: int, warmup: int, opts) -> dict:
    """Our pretrain_llama.py launch of `case`: mean iteration time after `warmup`, first loss, with --timers the
    per-rank timers and what `auto` chose."""
    with tempfile.TemporaryDirectory() as tmp:
        jsonl = os.path.join(tmp, "m.jsonl")
        flags = model_flags(vocab) + ["--pipeline-model-parallel-size", str(opts.pp)] + OURS[case] + [
            "--train-iters", str(iters), "--metrics-jsonl", jsonl] + (peers_timers.FLAGS if opts.timers else [])
        proc = torchrun(opts.pp, flags, timeout=1800)
        if proc.returncode != 0:
            return {"error": one_line(proc.stdout + proc.stderr)}
        records = read_metrics(jsonl)
    got = {"iter_s": statistics.fmean(r["elapsed_ms"] for r in records[warmup:]) / 1e3,
           "first_loss": records[0]["lm_loss"]}
    if opts.timers:
        out = proc.stdout + proc.stderr
        got.update(timers=peers_timers.per_rank(peers_timers.parse_blocks(out), warmup),
                   auto_choice=peers_timers.auto_choice(out))
    return got


def run_case(case: str, vocab: int, iters: int, warmup: int, opts=None) -> dict:
    """{"iter_s": mean seconds per iteration after `warmup` (max over ranks), "first_loss", ...} or {"error": one
    line}. `opts`: pp, synthetic (sleep_ms per layer), timers; None is the p = 2 real run."""
    opts = opts or argparse.Namespace(pp=2, synthetic=False, sleep_ms=0.0, timers=False)
    if case in OURS and not opts.synthetic:
        return _ours(case, vocab, iters, warmup, opts)
    with tempfile.TemporaryDirectory() as tmp:
        s = SHAPE
        args = ["--framework", case, "--vocab", str(vocab), "--iters", str(iters), "--out-dir", tmp]
        # no flag may be a prefix of one of torchrun's (it reads "--m" as its own, ambiguously)
        flags = {"layers": "layers", "hidden": "hidden", "ffn": "ffn", "heads": "heads", "groups": "groups",
                 "seq": "seq", "mbs": "micro-batch", "m": "microbatches"}
        args += [a for k, flag in flags.items() for a in (f"--{flag}", str(s[k]))]
        args += ["--sleep-ms", str(opts.sleep_ms)] if opts.synthetic else []
        proc = torchrun(opts.pp, args, script=os.path.join("benchmarks", "peers_worker.py"), timeout=1800)
        if proc.returncode != 0:
            return {"error": one_line(proc.stdout + proc.stderr)}
        ranks = [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(opts.pp)]
    losses = [r["first_loss"] for r in ranks if r["first_loss"] is not None]
    got = {"iter_s": max(statistics.fmean(r["iter_s"][warmup:]) for r in ranks),
           "first_loss": losses[0] if losses else None, "patches": ranks[0]["patches"]}
    if opts.timers or opts.synthetic:
        got["busy"] = [peers_timers.busy_share(r["cpu_s"], r["iter_s"], warmup) for r in ranks]
    return got


def synthetic_ideal_s(pp: int, sleep_ms: float, shape: dict = SHAPE) -> float:
    """The synthetic run's lower bound: each rank sleeps m x (F + B + W) of its L / p layers, nothing idle."""
    return shape["m"] * 3 * (shape["layers"] / pp) * sleep_ms / 1e3


def _row(case: str, vocab: int, got: list[dict], opts) -> dict:
    """The result row of a case that ran every round."""
    times = [r["iter_s"] for r in got]
    row = {"case": case, "vocab": vocab, "iter_s": statistics.median(times), "spread_s": [min(times), max(times)],
           "rounds_s": times, "first_loss": got[0]["first_loss"], "ln_vocab": math.log(vocab),
           "patches": got[0].get("patches", []), "launch_s": statistics.median(r["launch_s"] for r in got)}
    if opts is not None and opts.synthetic:
        row.update(pp=opts.pp, synthetic=True, sleep_ms=opts.sleep_ms,
                   ideal_s=synthetic_ideal_s(opts.pp, opts.sleep_ms))
    else:
        row.update(pp=opts.pp if opts else 2, gflops_per_iter=iteration_flops(vocab) / 1e9,
                   body=BODY[framework(case)])
    for key in ("timers", "auto_choice"):
        if key in got[-1]:
            row[key] = got[-1][key]           # the last round's, when the machine had settled most
    if "busy" in got[0]:
        row["busy"] = [statistics.median(r["busy"][k] for r in got) for k in range(len(got[0]["busy"]))]
    return row


def measure(cases: list[str], vocab: int, rounds: int, iters: int, warmup: int, opts=None) -> list[dict]:
    runnable = [c for c in cases if missing_reason(c) is None]
    runs: dict[str, list[dict]] = {c: [] for c in runnable}
    for k in range(rounds if runnable else 0):
        for case in runnable[k % len(runnable):] + runnable[:k % len(runnable)]:
            start = time.perf_counter()
            got = run_case(case, vocab, iters, warmup, opts)
            runs[case].append({**got, "launch_s": time.perf_counter() - start})
            print(f"  round {k + 1} V={vocab} {case}: {runs[case][-1]}", flush=True)
    rows = [{"case": c, "vocab": vocab, "error": missing_reason(c)} for c in cases if c not in runs]
    for case, got in runs.items():
        failed = [r["error"] for r in got if "error" in r]
        rows.append({"case": case, "vocab": vocab, "error": failed[0]} if failed else _row(case, vocab, got, opts))
    return rows


def _paired(rows: dict, ours: str, theirs: str) -> dict | None:
    if ours not in rows or theirs not in rows:
        return None
    ratios = [a / b for a, b in zip(rows[ours]["rounds_s"], rows[theirs]["rounds_s"])]
    return {"ours": ours, "peer": theirs, "ratio": statistics.median(ratios), "spread": [min(ratios), max(ratios)]}


def comparisons(rows: list[dict]) -> list[dict]:
    """The issue's two measures: ours automatic vs the fastest peer at vocab32, ours ZB-V vs the fastest peer's 1F1B
    at the balanced shape; and ours automatic (one chunk per rank, and two) vs the fastest peer there (paired by
    round: ours / peer, below 1 when ours is faster)."""
    out = []
    pairs = ((VOCABS["vocab32"], "ours-auto", ""), (VOCABS["balanced"], "ours-zbv", "-1f1b"),
             (VOCABS["balanced"], "ours-auto", ""), (VOCABS["balanced"], "ours-auto-v", ""))
    for vocab, ours, suffix in pairs:
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


def check_args(p: argparse.ArgumentParser, args) -> None:
    """One line for a combination that cannot be measured honestly."""
    if args.warmup >= args.iters:
        p.error(f"--warmup {args.warmup} leaves no timed iteration of --iters {args.iters}")
    cores = os.cpu_count() or 1
    if args.pp > cores and not args.synthetic:
        p.error(f"--pp {args.pp} on {cores} cores measures the machine's time-sharing, not the schedules: add "
                "--synthetic (sleeping stages)")
    if args.pp < 2 or SHAPE["layers"] % (2 * args.pp):
        p.error(f"--pp {args.pp}: the {SHAPE['layers']} layers must split into 2 chunks on each of p >= 2 ranks")
    if args.synthetic and args.sleep_ms <= 0:
        p.error(f"--sleep-ms {args.sleep_ms:g}: the synthetic stages need a positive sleep")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", choices=list(VOCABS), default=list(VOCABS))
    p.add_argument("--cases", nargs="+", choices=list(OURS) + PEERS, default=list(OURS) + PEERS)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--iters", type=int, default=6, help="iterations per launch (ours: --train-iters)")
    p.add_argument("--warmup", type=int, default=4, help="untimed first iterations (ours' auto profiles in them)")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "bench_peers.json"))
    p.add_argument("--section", metavar="RESULT_JSON", help="print the docs section of an earlier run and exit")
    p.add_argument("--pp", type=int, default=2, help="pipeline ranks (more than the cores: only with --synthetic)")
    p.add_argument("--synthetic", action="store_true", help="sleeping stages in every framework (the balanced "
                   "shape; vocabulary and model compute do not enter)")
    p.add_argument("--sleep-ms", type=float, default=10.0, help="--synthetic: F = B = W per layer and microbatch")
    p.add_argument("--timers", action="store_true", help="ours' per-rank timers and auto's choice; peers' CPU share")
    args = p.parse_args(argv)
    if args.section:
        print(section(json.load(open(args.section))), end="")
        return 0
    check_args(p, args)
    if args.synthetic and args.out == p.get_default("out"):
        args.out = os.path.join(ROOT, "benchmarks", "results", f"bench_peers_synthetic_p{args.pp}.json")
    shapes, load = ["balanced"] if args.synthetic else args.shapes, [os.getloadavg()[0]]
    rows = [row for shape in shapes for row in measure(args.cases, VOCABS[shape], args.rounds, args.iters,
                                                       args.warmup, args)]
    result = {"args": vars(args), "shape": SHAPE, "rows": rows, "comparisons": comparisons(rows),
              "loss_check": [] if args.synthetic else loss_check(rows),
              "load_average_1min": load + [os.getloadavg()[0]]}      # at the start and the end: was it quiet?
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
