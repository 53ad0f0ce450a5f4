"""The scripts under examples/ run as their headers say (issue 39, item 5): every command line a header shows is
run exactly as written, from the repository root, on this machine (no GPU: the script's CPU defaults, mock data,
nothing downloaded), and trains what it names; every script under examples/ has a test; and of their kind
elsewhere, the single-node launcher's CPU example and `llamapipe plan`'s top command run as printed."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.cli import ROOT, free_port

ZERO_BUBBLE = "examples/zero_bubble/pretrain_zero_bubble.sh"
# the schedule each header line of the zero-bubble script trains, in the header's order: ZB-V, V-Half, ZB-2p
ZERO_BUBBLE_SCHEDULES = ["zbv", "v-half", "auto"]
# what the scripts read from the environment: a test starts from none of it, as a new shell would
SCRIPT_VARIABLES = ("WORLD_SIZE", "RANK", "MASTER_ADDR", "GPUS_PER_NODE", "PIPELINE_SIZE", "TP_SIZE", "FP32",
                    "ZERO_BUBBLE_V_SCHEDULE", "ENABLE_ZERO_BUBBLE", "SYNC_OPTIMIZER", "EXTRA_OPTIONS", "DATASET_DIR",
                    "DOWNLOAD", "OMP_NUM_THREADS")


def header_commands(script: str) -> list[str]:
    """The command lines the script's header comment shows (`#   VAR=... path/to/script.sh ...`)."""
    lines = []
    with open(os.path.join(ROOT, script)) as f:
        for line in f:
            if not line.startswith("#"):
                break
            command = line[1:].strip()
            if re.search(rf"(^|\s){re.escape(script)}(\s|$)", command):
                lines.append(command)
    return lines


def run_as_written(command: str, tmp_path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in SCRIPT_VARIABLES}
    env.update(PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""), PYTHONPATH=ROOT,
               MASTER_PORT=str(free_port()), CUDA_VISIBLE_DEVICES="")
    env["DATASET_DIR"] = str(tmp_path / "no_dataset")     # the fork's /tmp default may exist on this machine
    return subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_the_zero_bubble_header_shows_its_three_settings():
    assert len(header_commands(ZERO_BUBBLE)) == len(ZERO_BUBBLE_SCHEDULES), header_commands(ZERO_BUBBLE)


@pytest.mark.parametrize("index", range(len(ZERO_BUBBLE_SCHEDULES)))
def test_zero_bubble_script_runs_as_its_header_shows(index, tmp_path):
    command = header_commands(ZERO_BUBBLE)[index]
    proc = run_as_written(command, tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-5000:]
    assert "training on mock data" in output and "wget" not in output
    schedule = [line.split("run: schedule ", 1)[1].split(",")[0] for line in output.splitlines()
                if "run: schedule " in line]
    assert schedule == [ZERO_BUBBLE_SCHEDULES[index]], (command, schedule)
    assert "run: precision fp32" in output        # the CPU default: fp16's loss scale would skip a short run
    done = [line for line in output.splitlines() if "training done: " in line]
    assert len(done) == 1 and "training done: 20 iterations in " in done[0], done


def test_every_example_script_has_a_test():
    scripts = sorted(os.path.relpath(os.path.join(d, f), ROOT)
                     for d, _, files in os.walk(os.path.join(ROOT, "examples")) for f in files
                     if f.endswith((".sh", ".py")))
    tests = []
    for d, _, files in os.walk(os.path.join(ROOT, "tests")):
        tests += [open(os.path.join(d, f)).read() for f in files if f.endswith(".py")]
    untested = [s for s in scripts if not any(s in text or os.path.basename(s) in text for text in tests)]
    assert scripts and not untested, untested


def test_the_single_node_launcher_runs_its_cpu_example_as_written(tmp_path):
    """scripts/launch_single_node.sh's header line for a machine without GPUs (the kind of item 5 elsewhere)."""
    script = "scripts/launch_single_node.sh"
    (command,) = [line for line in header_commands(script) if line.startswith("GPUS_PER_NODE=2 ")]
    proc = run_as_written(command, tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-5000:]
    assert "run: schedule zbv" in output and "training done: 5 iterations in " in output


def test_plans_top_command_runs_as_printed():
    """`llamapipe plan`'s top row is a command to run (item 7): as printed, from the repository root, with
    torchrun's port from its environment (PET_MASTER_PORT) so that concurrent tests do not collide."""
    plan = subprocess.run([sys.executable, "-m", "llamapipe", "plan", "--model", "tiny", "--gpus", "2",
                           "--global-batch-size", "4", "--seq-length", "64", "--top", "1"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
    assert plan.returncode == 0, plan.stderr
    lines = plan.stdout.splitlines()
    command = lines[lines.index(next(line for line in lines if line.endswith("Top row:"))) + 1].strip()
    assert command.startswith("torchrun ") and command.endswith("--mock-data")
    env = dict(os.environ, PYTHONPATH=ROOT, PET_MASTER_PORT=str(free_port()),
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    proc = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-5000:]
    assert "training done: 10 iterations in " in output


def test_the_fork_scripts_fp16_on_a_short_run_ends_with_the_hint(tmp_path):
    """FP32 left empty asks for the fork's fp16: 6 iterations from a loss scale of 2^32 skip every update, and
    the summary says so and what to give (before: 'training done: 0 iterations' and nothing more)."""
    proc = run_as_written(f"FP32= TRAIN_SAMPLES=24 ZERO_BUBBLE_V_SCHEDULE=1 {ZERO_BUBBLE}", tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-5000:]
    (done,) = [line for line in output.splitlines() if "training done: " in line]
    assert "training done: 0 iterations in " in done and "6 iteration(s) skipped their update" in done
    assert done.endswith("give --initial-loss-scale 65536, train longer, or use --bf16"), done
