"""`llamapipe dry-run` on 1,024-rank jobs as a user runs it (a subprocess).

LLaMA-3-70B at tp 8 x pp 8 x dp 16 under ZB-V and LLaMA-3.1-405B at tp 8 x pp 16 x cp 2 x dp 4 each check every
role and must report the model's exact parameter count, with the process's peak memory under 2 GiB (measured by
the process itself, as the kernel counts it). Their durations are measured by pytest --durations, not asserted:
about 13 s and 24 s here (2 cores shared with other work). `plan`'s layouts against their dry runs are in
tests/unit/test_dry_run_plan.py, in process."""
from __future__ import annotations

import subprocess
import sys

import pytest

from llamapipe.model.llama import LlamaConfig
from llamapipe.model.families import PRESETS, model_parameters
from tests.cli import ROOT

TWO_GIB = 2 * 2 ** 30
COMMON = ["--seq-length", "8192", "--micro-batch-size", "1", "--bf16", "--sequence-parallel",
          "--use-distributed-optimizer", "--mock-data", "--train-iters", "1000", "--gpu-memory-gb", "80"]
JOBS = {
    "llama3-70b": ["--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "8",
                   "--num-virtual-stages-per-pipeline-rank", "2", "--pipeline-schedule", "zbv",
                   "--global-batch-size", "256"],
    "llama3.1-405b": ["--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "16",
                      "--context-parallel-size", "2", "--decoder-first-pipeline-num-layers", "7",
                      "--decoder-last-pipeline-num-layers", "7", "--global-batch-size", "64"],
}
# runs the dry run and prints the process's own peak resident memory (ru_maxrss: KiB on Linux) after it
RUN = ("import resource, sys\nfrom llamapipe.cli import main\ncode = main(sys.argv[1:])\n"
       "print('maxrss', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)\nsys.exit(code)")


def dry_run(argv: list[str]) -> tuple[int, str, int]:
    proc = subprocess.run([sys.executable, "-c", RUN, "dry-run", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    maxrss = int(proc.stdout.split("maxrss ")[-1])
    return proc.returncode, proc.stdout + proc.stderr, maxrss


@pytest.mark.parametrize("model", list(JOBS))
def test_a_1024_rank_job_checks_in_one_process_under_2_gib(model):
    code, out, maxrss = dry_run(["--world-size", "1024", "--model", model] + JOBS[model] + COMMON)
    assert code == 0, out[-3000:]
    tp = int(JOBS[model][1])
    expected = model_parameters(LlamaConfig(**PRESETS[model]), tp)
    assert f"parameters: {expected:,} summed over the shards = the model's" in out
    assert "dry run: 1024 ranks in " in out and maxrss < TWO_GIB, maxrss

