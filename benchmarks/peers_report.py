"""The docs/benchmarks.md "Beside the peers" section of a benchmarks/bench_peers.py result file: the table of the
real runs (with --timers, where the time goes), or the synthetic run's table, marked synthetic throughout."""
from __future__ import annotations

import os

from benchmarks import peers_timers


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


def synthetic_table(rows: list[dict]) -> str:
    lines = ["| p | case (synthetic: sleeping stages) | ms / iteration (median, min-max) | / ideal | busy per rank |",
             "|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r.get('pp', '')} | {r['case']} | not run: {r['error']} | | |")
            continue
        lo, hi = r["spread_s"]
        busy = " / ".join(f"{b:.0%}" for b in r.get("busy", []))
        lines.append(f"| {r['pp']} | {r['case']} | {1e3 * r['iter_s']:,.0f} ({1e3 * lo:,.0f}-{1e3 * hi:,.0f}) | "
                     f"{r['iter_s'] / r['ideal_s']:.3f} | {busy} |")
    return "\n".join(lines)


def _command(a: dict) -> str:
    extra = "".join([" --timers" if a.get("timers") else "",
                     f" --pp {a['pp']} --synthetic --sleep-ms {a['sleep_ms']:g}" if a.get("synthetic") else ""])
    return (f"/work/peers-venv/bin/python -m benchmarks.bench_peers{extra} --rounds {a['rounds']} --iters "
            f"{a['iters']} --warmup {a['warmup']}")


def synthetic_section(result: dict) -> str:
    """The docs paragraph of a --synthetic run: every row is sleeps, said in the heading and the table."""
    a, rows = result["args"], result["rows"]
    ideal = next((r["ideal_s"] for r in rows if "ideal_s" in r), None)
    shape = result["shape"]
    parts = [f"### p = {a['pp']}, synthetic stages (SLEEPS, not the model)", "",
             f"Every framework's own schedule engine over stages that sleep F = B = W = {a['sleep_ms']:g} ms per "
             f"layer and microbatch ({shape['layers']} layers, {shape['m']} microbatches, activations of the real "
             f"shape crossing gloo), {a['pp']} ranks on {os.cpu_count()} cores (benchmarks/peers_synthetic.py). "
             + (f"Ideal (each rank busy m x (F + B + W), no bubble): {1e3 * ideal:,.0f} ms. " if ideal else "")
             + "These numbers measure schedules and per-action overhead, not model compute:", "",
             f"    {_command(a)}", "", synthetic_table(rows), ""]
    for c in result.get("comparisons", []):
        parts.append(f"- synthetic p={a['pp']}: {c['ours']} / {c['peer']} = {c['ratio']:.3f} "
                     f"(rounds {c['spread'][0]:.3f}-{c['spread'][1]:.3f}).")
    return "\n".join(parts) + "\n"


def section(result: dict) -> str:
    """The "Beside the peers" section of docs/benchmarks.md from a result file."""
    a = result["args"]
    if a.get("synthetic"):
        return synthetic_section(result)
    cmd = _command(a)
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
    if any("timers" in r or "busy" in r for r in result["rows"]):
        parts += ["", "Where the time goes (--timers; ours: ms per iteration from its per-rank timers, F/B/W are "
                  "the compute of forward, input backward and weight backward; peers: main-thread CPU / wall):", "",
                  peers_timers.breakdown_table(result["rows"])]
        parts += [f"- {r['case']} V={r['vocab']}: " + " / ".join(r["auto_choice"]) for r in result["rows"]
                  if r.get("auto_choice")]
    return "\n".join(parts) + "\n"
