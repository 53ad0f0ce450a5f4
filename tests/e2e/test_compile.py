"""--compile through the CLI: compiled runs reproduce the eager single-process losses (fp32, CPU, gloo) under
no pipelining, tensor + sequence parallelism with selective recompute, ZB-V, and ZB-H2 with full recompute.

Each layout's eager losses equal the single-process ones (tests/e2e/test_e2e_training.py), so one eager run
is the reference. The runs share one inductor cache directory: the first compiles (about half a minute on two
cores), later runs with the same shapes reuse its kernels.
"""
import math
import re

import pytest

from tests.cli import TINY, read_metrics, torchrun, train

ITERS = ["--train-iters", "5", "--micro-batch-size", "1", "--global-batch-size", "4"]

LAYOUTS = {
    "pp1": (1, []),
    "tp2-sp-selective": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                             "--recompute-activations"]),
    "pp2-zbv": (2, ["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
                    "--pipeline-schedule", "zbv"]),
    "pp2-zbh2-full-recompute": (2, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h2",
                                    "--recompute-granularity", "full", "--recompute-method", "uniform",
                                    "--recompute-num-layers", "1"]),
}


@pytest.fixture(scope="module")
def inductor_env(tmp_path_factory):
    return {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path_factory.mktemp("inductor"))}


@pytest.fixture(scope="module")
def eager_losses(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("eager") / "m.jsonl")
    return [r["lm_loss"] for r in train(1, ITERS, path)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_compiled_losses_equal_eager(eager_losses, inductor_env, tmp_path, layout):
    nproc, flags = LAYOUTS[layout]
    jsonl = str(tmp_path / "m.jsonl")
    proc = torchrun(nproc, TINY + ITERS + flags + ["--compile", "--metrics-jsonl", jsonl], env=inductor_env)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    log = proc.stdout + proc.stderr
    assert re.search(r"--compile: compiled \d+ decoder layers \(inductor, microbatch 1 x 32\) in [\d.]+ s", log)
    records = read_metrics(jsonl)
    assert len(records) == len(eager_losses) == 5
    assert records[0]["tokens_per_sec"] is None, "the first iteration is left out of throughput"
    for it, (record, want) in enumerate(zip(records, eager_losses), 1):
        got = record["lm_loss"]
        assert math.isclose(got, want, rel_tol=1e-5), f"{layout} iteration {it}: compiled {got} vs eager {want}"
