"""End to end through the CLI: every layout and schedule reproduces the single-process losses.

fp32 on CPU with gloo. The reference is the same command on one process (tp=pp=dp=1).
"""
import json
import math
import os
import re
import subprocess
import sys

import pytest

from tests.cli import ROOT, TINY, free_port, read_metrics, torchrun, train

ITERS = ["--train-iters", "5", "--micro-batch-size", "1", "--global-batch-size", "8"]

LAYOUTS = {
    "tp2": (2, ["--tensor-model-parallel-size", "2"]),
    "tp2-sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "dp2": (2, []),
    "pp2-1f1b": (2, ["--pipeline-model-parallel-size", "2"]),
    "pp2-gpipe": (2, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "gpipe"]),
    "pp2-vpp2-interleaved": (2, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2"]),
    "pp2-zbh1": (2, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1"]),
    "pp2-zbh2": (2, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h2"]),
    "pp2-zbv": (2, ["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
                    "--pipeline-schedule", "zbv"]),       # newer Megatron's flag for the chunks per rank
    "pp2-dualpipev": (2, ["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
                          "--pipeline-schedule", "dualpipev"]),
    "pp2-auto": (2, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "auto",
                     "--pipeline-profile-iters", "2"]),
    "tp2-pp2-zbv": (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                        "--num-layers-per-virtual-pipeline-stage", "2", "--pipeline-schedule", "zbv"]),
    "pp2-dp2-zbh1": (4, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1"]),
    "pp4-interleaved": (4, ["--pipeline-model-parallel-size", "4", "--num-layers-per-virtual-pipeline-stage", "1"]),
    "pp2-vpp2-interleaved-group4": (2, ["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank",
                                        "2", "--microbatch-group-size-per-virtual-pipeline-stage", "4"]),
    "pp2-vpp2-group-interleaved": (2, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage",
                                       "2", "--interleave-group-size", "1"]),     # the fork's flags
    "pp2-1f1bv": (2, ["--pipeline-model-parallel-size", "2", "--enable-1f1b-v"]),
    "pp4-1f1bv": (4, ["--pipeline-model-parallel-size", "4", "--pipeline-schedule", "1f1b-v"]),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ref") / "m.jsonl")
    return [r["lm_loss"] for r in train(1, ITERS, path)]


def test_reference_loss_falls(reference):
    assert len(reference) == 5
    assert reference[-1] < reference[0]


@pytest.mark.parametrize("nproc,flags,split", [
    (2, ["--decoder-last-pipeline-num-layers", "3", "--pipeline-schedule", "zb-h2"], "5, 3"),
    (4, ["--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers", "3"], "1, 2, 2, 3"),
], ids=["pp2-last3-zbh2", "pp4-first1-last3-1f1b"])
def test_uneven_pipeline_split_matches_single_process(reference, tmp_path, nproc, flags, split):
    jsonl = str(tmp_path / "m.jsonl")
    proc = torchrun(nproc, TINY + ITERS + ["--pipeline-model-parallel-size", str(nproc), *flags,
                                           "--metrics-jsonl", jsonl])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"layers per pipeline stage: {split}" in proc.stdout + proc.stderr
    losses = [r["lm_loss"] for r in read_metrics(jsonl)]
    assert len(losses) == 5
    for it, (got, want) in enumerate(zip(losses, reference), 1):
        assert math.isclose(got, want, rel_tol=1e-5), f"uneven split iteration {it}: {got} vs {want}"


def test_embedding_and_loss_counted_as_layers_under_zbv_match_single_process(tmp_path):
    """--account-for-embedding/loss-in-pipeline-split with 6 layers over ZB-V's 4 stages: 1, 2, 2, 1 layers,
    so rank 0 (stages 0 and 3, with the embedding and the head) builds 2 layers and rank 1 builds 4."""
    six = list(TINY)
    six[six.index("--num-layers") + 1] = "6"
    ref = [r["lm_loss"] for r in train(1, ITERS, str(tmp_path / "ref.jsonl"), tiny=six)]
    jsonl = str(tmp_path / "m.jsonl")
    proc = torchrun(2, six + ITERS + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv",
                                      "--num-layers-per-virtual-pipeline-stage", "2",
                                      "--account-for-embedding-in-pipeline-split",
                                      "--account-for-loss-in-pipeline-split", "--metrics-jsonl", jsonl])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "layers per pipeline stage: 1, 2, 2, 1" in proc.stdout + proc.stderr
    losses = [r["lm_loss"] for r in read_metrics(jsonl)]
    assert len(losses) == len(ref) == 5
    for it, (got, want) in enumerate(zip(losses, ref), 1):
        assert math.isclose(got, want, rel_tol=1e-5), f"accounted split iteration {it}: {got} vs {want}"


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(name, reference, tmp_path):
    nproc, flags = LAYOUTS[name]
    losses = [r["lm_loss"] for r in train(nproc, ITERS + flags, str(tmp_path / "m.jsonl"))]
    assert len(losses) == 5
    for it, (got, want) in enumerate(zip(losses, reference), 1):
        assert math.isclose(got, want, rel_tol=1e-5), f"{name} iteration {it}: {got} vs single-process {want}"


def test_distributed_optimizer_matches_plain(tmp_path):
    plain = train(2, ITERS, str(tmp_path / "plain.jsonl"))
    zero1 = train(2, ITERS + ["--use-distributed-optimizer"], str(tmp_path / "zero1.jsonl"))
    for a, b in zip(plain, zero1):
        assert math.isclose(a["lm_loss"], b["lm_loss"], rel_tol=1e-5)
        assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-4)


AUTO = ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "auto", "--pipeline-profile-iters", "2"]
MEASURED = r"activations ([0-9.e+-]+) MiB per unit \(W keeps (\d+)%\), memory limit ([0-9.e+-]+) units \(64 MiB\)"


def test_auto_memory_limit_in_bytes_is_measured_and_converted(reference, tmp_path):
    """--pipeline-memory-limit 64MiB: the first profiling iteration measures a unit's bytes and W's share,
    the cap becomes 64 MiB / unit units, and the losses stay the single-process ones."""
    jsonl = str(tmp_path / "m.jsonl")
    proc = torchrun(2, TINY + ITERS + AUTO + ["--pipeline-memory-limit", "64MiB", "--metrics-jsonl", jsonl])
    assert proc.returncode == 0, proc.stderr[-3000:]
    measured = re.search(MEASURED, proc.stdout + proc.stderr)
    assert measured, proc.stdout[-2000:]
    unit_mib, share, units = float(measured[1]), int(measured[2]), float(measured[3])
    assert 0.01 < unit_mib < 64 and 5 <= share <= 95
    assert math.isclose(units, 64 / unit_mib, rel_tol=0.01)
    for it, (got, want) in enumerate(zip([r["lm_loss"] for r in read_metrics(jsonl)], reference), 1):
        assert math.isclose(got, want, rel_tol=1e-5), f"auto with a byte cap, iteration {it}: {got} vs {want}"


def test_auto_memory_limit_below_one_microbatch_stops_with_one_line(tmp_path):
    proc = torchrun(2, TINY + ITERS + AUTO + ["--pipeline-memory-limit", "16KiB",
                                              "--metrics-jsonl", str(tmp_path / "m.jsonl")])
    # torchrun reports the failed worker (exit 2) itself; the workers print one line and no traceback of ours
    assert proc.returncode != 0 and "auto_schedule.py" not in proc.stderr, proc.stderr[-3000:]
    assert "exitcode  : 2" in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("pretrain_llama.py: error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "--pipeline-memory-limit 0.0156 MiB holds" in errors[0] and "needs 1" in errors[0]


OVERLAP = ["--overlap-grad-reduce", "--ddp-bucket-size", "20000"]
PHASES = r"of this rank's (\d+) gradient buckets, (\d+) started .* before its last backward action, (\d+) during it"


@pytest.mark.parametrize("nproc,flags,min_before", [
    (4, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2",
         "--pipeline-schedule", "zbv"], 1),
    (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--use-distributed-optimizer"], 0),
], ids=["pp2-dp2-zbv", "tp2-sp-dp2-zero1"])
def test_overlapped_grad_reduce_matches_single_process(reference, tmp_path, nproc, flags, min_before):
    """DP all-reduces started during the backward (deferred W, sequence-parallel norms, ZeRO-1) change no loss.
    ZB-V finishes one chunk early (its buckets start before the last action); hooks start buckets within it."""
    jsonl = str(tmp_path / "m.jsonl")
    proc = torchrun(nproc, TINY + ITERS + flags + OVERLAP + ["--metrics-jsonl", jsonl])
    assert proc.returncode == 0, proc.stderr[-3000:]
    phases = re.search(PHASES, proc.stdout + proc.stderr)
    assert phases, proc.stdout[-2000:]
    total, before, during = map(int, phases.groups())
    assert total >= 2 and before >= min_before and during >= 1, phases[0]
    losses = [r["lm_loss"] for r in read_metrics(jsonl)]
    assert len(losses) == 5
    for it, (got, want) in enumerate(zip(losses, reference), 1):
        assert math.isclose(got, want, rel_tol=1e-5), f"overlap iteration {it}: {got} vs {want}"


@pytest.mark.parametrize("nproc,flags", [
    (2, ["--tie-embeddings-and-output-weights", "--recompute-granularity", "full", "--recompute-method", "block",
         "--recompute-num-layers", "4"]),
    (4, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h2", "--pipeline-profile-iters", "2"]),
], ids=["dp2-tied-recompute", "pp2-dp2-zbh2-profiled"])
def test_overlapped_grad_reduce_is_bit_exact(tmp_path, nproc, flags):
    """Two DP ranks: overlap changes no bit, also with a weight used twice and recomputed layers, and across
    the zb-h2 switch from profiled 1F1B (B and W split) to the fitted plan."""
    plain = train(nproc, ITERS + flags, str(tmp_path / "plain.jsonl"))
    overlapped = train(nproc, ITERS + flags + OVERLAP, str(tmp_path / "overlap.jsonl"))
    assert [r["lm_loss"] for r in overlapped] == [r["lm_loss"] for r in plain]
    assert [r["grad_norm"] for r in overlapped] == [r["grad_norm"] for r in plain]


@pytest.mark.parametrize("precision", ["--bf16", "--fp16"])
def test_mixed_precision_trains(precision, tmp_path):
    args = ["--train-iters", "12", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "3e-3",
            "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1", precision,
            "--initial-loss-scale", "4096"]
    rows = train(2, args, str(tmp_path / "m.jsonl"))
    losses = [r["lm_loss"] for r in rows]
    assert all(math.isfinite(x) for x in losses)
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3, losses


def test_fp16_injected_inf_is_skipped_and_logged(tmp_path):
    """tests/scripts/inject_inf.py makes iteration 3's loss gradient infinite; fp16 scaling must skip it."""
    args = ["--train-iters", "6", "--micro-batch-size", "1", "--global-batch-size", "4", "--fp16",
            "--initial-loss-scale", "1024", "--hysteresis", "1", "--pipeline-model-parallel-size", "2"]
    proc = torchrun(2, ["--inject-inf-iteration", "3", "--"] + TINY + args +
                    ["--metrics-jsonl", str(tmp_path / "m.jsonl")], script="tests/scripts/inject_inf.py")
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout + proc.stderr
    assert "skipped iteration 3" in out
    rows = read_metrics(str(tmp_path / "m.jsonl"))
    assert [r["iteration"] for r in rows] == [1, 2, 4, 5, 6]
    assert rows[-1]["skipped_iterations"] == 1
    assert rows[2]["loss_scale"] == rows[1]["loss_scale"] / 2   # backed off after the overflow


def test_two_node_rendezvous_on_localhost(tmp_path):
    """Two torchrun launchers (--nnodes 2, c10d) form one 2-process job with pp=2."""
    port = free_port()
    jsonl = str(tmp_path / "m.jsonl")
    procs = []
    for node in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
               "--nproc_per_node", "1", "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}",
               "--rdzv_id", "two-node-test", "pretrain_llama.py", *TINY, *ITERS,
               "--pipeline-model-parallel-size", "2", "--metrics-jsonl", jsonl]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
    assert len(read_metrics(jsonl)) == 5


def _valid_losses(path: str) -> list[float]:
    with open(path) as f:
        return [json.loads(line)["valid_lm_loss"] for line in f if '"valid_lm_loss"' in line]


EVAL = ["--train-iters", "2", "--micro-batch-size", "1", "--global-batch-size", "8", "--eval-iters", "1",
        "--eval-interval", "2"]


@pytest.mark.parametrize("name", ["pp2-zbv", "pp4-1f1b"])
def test_evaluation_with_data_free_middle_ranks_matches_single_process(name, tmp_path):
    """ZB-V's rank 1 and pp=4's ranks 1-2 read no data but must still join evaluation (they used to hang)."""
    nproc, flags = {"pp2-zbv": LAYOUTS["pp2-zbv"], "pp4-1f1b": (4, ["--pipeline-model-parallel-size", "4"])}[name]
    train(1, EVAL, str(tmp_path / "ref.jsonl"))
    train(nproc, EVAL + flags, str(tmp_path / "m.jsonl"), timeout=240)
    want, got = _valid_losses(str(tmp_path / "ref.jsonl")), _valid_losses(str(tmp_path / "m.jsonl"))
    assert len(want) >= 1 and len(got) == len(want)
    for a, b in zip(got, want):
        assert math.isclose(a, b, rel_tol=1e-5), f"{name}: validation loss {a} vs single-process {b}"
