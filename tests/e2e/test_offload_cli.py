"""The memory levers through the CLI: --cpu-offload (PipeOffload, the zero-bubble fork's flags), Megatron's
fine-grained offloading, --recompute-modules and the fork's --recompute-lgd: every schedule and layout with them
reproduces the single-process losses (fp32, rel 1e-5) over 5 iterations (with --offload-weight-grad-inputs on the
zero-bubble ones); a checkpoint saved with offload resumes in
another layout with the uninterrupted losses; auto under a tight cap offloads."""
import math

import pytest

from tests.cli import TINY, train

ITERS = ["--train-iters", "5", "--micro-batch-size", "1", "--global-batch-size", "8"]
PP2 = ["--pipeline-model-parallel-size", "2"]
V2 = ["--num-virtual-stages-per-pipeline-rank", "2"]
OFF = ["--cpu-offload"]

LAYOUTS = {
    "pp2-interleaved": (2, PP2 + V2 + OFF),
    "pp2-zbv-both-chunks": (2, PP2 + V2 + ["--pipeline-schedule", "zbv"] + OFF + ["--offload-chunk-num", "2"]),
    "pp2-zbh1-time-weight-grad-inputs": (2, PP2 + ["--pipeline-schedule", "zb-h1"] + OFF
                                         + ["--offload-time", "0.05", "--offload-weight-grad-inputs"]),
    "pp2-auto": (2, PP2 + ["--pipeline-schedule", "auto", "--pipeline-profile-iters", "2"] + OFF),
    "tp2-sp-pp2-zbv-weight-grad-inputs": (4, PP2 + V2 + ["--pipeline-schedule", "zbv", "--tensor-model-parallel-size",
                                                         "2", "--sequence-parallel"] + OFF
                                          + ["--offload-weight-grad-inputs"]),
    "cp2-pp2-interleaved": (4, PP2 + V2 + ["--context-parallel-size", "2"] + OFF),
    "pp2-dp2-zero3-zbv": (4, PP2 + V2 + ["--pipeline-schedule", "zbv", "--data-parallel-sharding-strategy",
                                         "optim_grads_params"] + OFF + ["--offload-weight-grad-inputs"]),
    "pp2-zbv-megatron-fine-grained": (2, PP2 + V2 + ["--pipeline-schedule", "zbv",
                                                     "--fine-grained-activation-offloading", "--offload-modules",
                                                     "core_attn", "attn_proj", "mlp_norm", "--min-offloaded-tensor-size",
                                                     "0", "--activation-offload-fraction", "0.5",
                                                     "--delta-offload-bytes-across-pp-ranks", "1024"]),
    "pp2-zbh1-offload-with-recompute-lgd": (2, PP2 + ["--pipeline-schedule", "zb-h1", "--recompute-lgd"] + OFF),
    "pp2-zbv-recompute-lgd": (2, PP2 + V2 + ["--pipeline-schedule", "zbv", "--recompute-lgd"]),
    "tp2-sp-pp2-zbv-recompute-modules": (4, PP2 + V2 + ["--pipeline-schedule", "zbv", "--tensor-model-parallel-size",
                                                        "2", "--sequence-parallel", "--recompute-granularity",
                                                        "selective", "--recompute-modules", "core_attn", "mlp",
                                                        "layernorm"]),
    "cp2-pp2-interleaved-recompute-mlp": (4, PP2 + V2 + ["--context-parallel-size", "2", "--recompute-activations",
                                                         "--recompute-modules", "mlp", "layernorm"]),
    "pp2-dp2-zero3-zbv-recompute-lgd": (4, PP2 + V2 + ["--pipeline-schedule", "zbv", "--recompute-lgd",
                                                       "--data-parallel-sharding-strategy", "optim_grads_params"]),
    "pp4-interleaved-auto-time": (4, ["--pipeline-model-parallel-size", "4", "--num-layers-per-virtual-pipeline-stage",
                                      "1"] + OFF + ["--auto-offload-time"]),
}


def _losses(records: list[dict]) -> list[float]:
    return [r["lm_loss"] for r in records]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[float]:
    return _losses(train(1, ITERS, str(tmp_path_factory.mktemp("ref") / "m.jsonl")))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_offload_layout_matches_single_process(name, reference, tmp_path):
    nproc, flags = LAYOUTS[name]
    got = _losses(train(nproc, ITERS + flags + ["--use-distributed-optimizer"] * (name == "pp2-interleaved"),
                        str(tmp_path / "m.jsonl")))
    assert len(got) == len(reference) == 5
    for it, (g, w) in enumerate(zip(got, reference), 1):
        assert math.isclose(g, w, rel_tol=1e-5), f"{name} iteration {it}: {g} vs single-process {w}"


def test_auto_under_a_tight_memory_limit_offloads_and_keeps_the_losses(reference, tmp_path):
    """--pipeline-schedule auto at pp 4 with --pipeline-memory-limit 2 (units) takes its offload plan (the log says
    so) and trains the single-process losses."""
    from tests.cli import torchrun, read_metrics
    jsonl = str(tmp_path / "m.jsonl")
    proc = torchrun(4, TINY + ITERS + ["--pipeline-model-parallel-size", "4", "--pipeline-schedule", "auto",
                                       "--pipeline-profile-iters", "2", "--pipeline-memory-limit", "2",
                                       "--metrics-jsonl", jsonl])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "-> auto+offload: simulated bubble" in proc.stdout + proc.stderr
    for it, (g, w) in enumerate(zip(_losses(read_metrics(jsonl)), reference), 1):
        assert math.isclose(g, w, rel_tol=1e-5), f"iteration {it}: {g} vs single-process {w}"


def test_offload_checkpoint_resumes_in_another_layout(reference, tmp_path):
    """Saved at iteration 3 by pp 2 ZB-V with offload, resumed by pp 2 interleaved without it: iterations 4-5
    equal the uninterrupted single-process run's."""
    ckpt = str(tmp_path / "ckpt")
    zbv = PP2 + V2 + ["--pipeline-schedule", "zbv"] + OFF
    first = train(2, ITERS + zbv + ["--save", ckpt, "--save-interval", "3", "--exit-interval", "3"],
                  str(tmp_path / "a.jsonl"))
    assert len(first) == 3
    rest = train(2, ITERS + PP2 + V2 + ["--load", ckpt], str(tmp_path / "b.jsonl"))
    assert [r["iteration"] for r in rest] == [4, 5]
    for it, (g, w) in enumerate(zip(_losses(first) + _losses(rest), reference), 1):
        assert math.isclose(g, w, rel_tol=1e-5), f"iteration {it}: {g} vs single-process {w}"
