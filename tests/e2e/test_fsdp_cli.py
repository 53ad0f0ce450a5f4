"""ZeRO-2/3 on FSDP2 through the CLI (fp32, CPU, gloo): every sharded layout reproduces the single-rank losses
(rel 1e-5) over 5 iterations, with dp 2 and 4, tp 2, pp 2 (1f1b and zbv with the B/W split; zb-h2 and auto, which
profile their first iterations), recompute and
--overlap-grad-reduce, --optimizer-cpu-offload; checkpoints resume bit-exact and reshard between strategies.
"""
import pytest
import torch

from tests.cli import TINY, torchrun, train

ITERS = ["--train-iters", "5", "--micro-batch-size", "2", "--global-batch-size", "8"]
LAUNCH = "pretrain_llama.py"
Z2 = ["--data-parallel-sharding-strategy", "optim_grads"]
Z3 = ["--data-parallel-sharding-strategy", "optim_grads_params"]
PP2 = ["--pipeline-model-parallel-size", "2"]
ZBV = PP2 + ["--pipeline-schedule", "zbv", "--num-virtual-stages-per-pipeline-rank", "2"]

LAYOUTS = {
    "dp2-zero2": (2, Z2),
    "dp2-zero3": (2, Z3),
    "dp4-zero2": (4, Z2),
    "dp4-zero3-fsdp2-alias": (4, ["--use-torch-fsdp2"]),
    "tp2-sp-dp2-zero3": (4, Z3 + ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "tp2-sp-dp2-zero2": (4, Z2 + ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "pp2-1f1b-dp2-zero3": (4, Z3 + PP2),
    "pp2-1f1b-dp2-zero2": (4, Z2 + PP2),
    "pp2-zbv-dp2-zero3": (4, Z3 + ZBV),
    "pp2-zbv-dp2-zero2-recompute-overlap": (4, Z2 + ZBV + ["--recompute-granularity", "full",
                                                          "--overlap-grad-reduce"]),
    "dp2-zero3-cpu-offload": (2, Z3 + ["--optimizer-cpu-offload"]),
    # the profiled schedules: their activation probe met storages FSDP had freed (a crash before this fix)
    "pp2-zb-h2-dp2-zero2-profiled": (4, Z2 + PP2 + ["--pipeline-schedule", "zb-h2", "--pipeline-profile-iters", "2"]),
    "pp2-auto-dp2-zero3-profiled": (4, Z3 + PP2 + ["--pipeline-schedule", "auto", "--pipeline-profile-iters", "2"]),
}


def _losses(records: list[dict]) -> torch.Tensor:
    return torch.tensor([r["lm_loss"] for r in records], dtype=torch.float64)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> torch.Tensor:
    records = train(1, ITERS, str(tmp_path_factory.mktemp("ref") / "m.jsonl"), script=LAUNCH)
    assert len(records) == 5
    return _losses(records)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sharded_layout_matches_single_rank(layout, reference, tmp_path):
    nproc, flags = LAYOUTS[layout]
    records = train(nproc, ITERS + flags, str(tmp_path / "m.jsonl"), script=LAUNCH)
    torch.testing.assert_close(_losses(records), reference, rtol=1e-5, atol=0)


def test_checkpoint_resumes_bit_exact_and_reshards(reference, tmp_path):
    """Save at iteration 3 under ZeRO-3 dp 2; resume under ZeRO-3 dp 2 (bit-exact), ZeRO-2 dp 4 and no_shard."""
    ckpt = str(tmp_path / "ckpt")
    train(2, ITERS + Z3 + ["--save", ckpt, "--save-interval", "3", "--exit-interval", "3"],
          str(tmp_path / "a.jsonl"), script=LAUNCH)
    same = train(2, ITERS + Z3 + ["--load", ckpt], str(tmp_path / "b.jsonl"), script=LAUNCH)
    assert [r["iteration"] for r in same] == [4, 5]
    assert _losses(same).tolist() == reference[3:].tolist()        # bit-exact resume, same layout
    for nproc, flags in ((4, Z2), (1, [])):
        other = train(nproc, ITERS + flags + ["--load", ckpt], str(tmp_path / f"c{nproc}.jsonl"), script=LAUNCH)
        torch.testing.assert_close(_losses(other), reference[3:], rtol=1e-5, atol=0)


@pytest.mark.parametrize("flags, words", [
    (["--use-torch-fsdp2", "--data-parallel-sharding-strategy", "optim_grads"], "--use-torch-fsdp2"),
    (Z3 + ["--use-distributed-optimizer"], "--use-distributed-optimizer"),
    (Z2 + ["--log-params-norm"], "--log-params-norm"),
])
def test_refused_combinations_say_one_line(flags, words):
    proc = torchrun(2, TINY + ITERS + flags, script=LAUNCH, timeout=120)
    assert proc.returncode != 0
    line = [l for l in proc.stderr.splitlines() if "error:" in l]
    assert line and words in line[0] and "--data-parallel-sharding-strategy" in line[0], proc.stderr[-2000:]
