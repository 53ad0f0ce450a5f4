"""Issue 49: a GPTModel saved by megatron-core (torch_dist), imported with convert-megatron, trains at pp 2
under ZB-V with the single-process losses (--use-checkpoint-args takes the shape, RoPE base and vocabulary)."""
from __future__ import annotations

import math

import pytest

from tests import megatron_cpu as mc
from tests.cli import train

BASE = ["--mock-data", "--seed", "1234", "--lr", "1e-3", "--lr-warmup-iters", "1", "--clip-grad", "1.0",
        "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0", "--train-iters", "4",
        "--micro-batch-size", "1", "--global-batch-size", "4", "--use-checkpoint-args", "--finetune"]
SHAPE = dict(num_layers=4)


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    mc.require()
    import torch.distributed as dist
    from megatron.core import parallel_state
    from llamapipe.tools.convert_megatron import import_megatron
    root = tmp_path_factory.mktemp("megatron")
    mc.init_parallel()
    try:
        mc.save_megatron(mc.build_model(SHAPE, seed=5), str(root / "meg"), 20, mc.megatron_args(SHAPE))
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    import_megatron(str(root / "meg"), str(root / "ours"))
    return str(root / "ours")


def test_an_imported_megatron_model_trains_at_pp2_zbv_with_the_single_process_losses(imported, tmp_path):
    flags = ["--load", imported]
    single = [r["lm_loss"] for r in train(1, flags, str(tmp_path / "one.jsonl"), tiny=BASE)]
    zbv = [r["lm_loss"] for r in train(2, flags + ["--pipeline-model-parallel-size", "2",
                                                   "--num-virtual-stages-per-pipeline-rank", "2",
                                                   "--pipeline-schedule", "zbv"], str(tmp_path / "zbv.jsonl"),
                                       tiny=BASE)]
    print(f"single-process {single}, pp2 zbv {zbv}")
    assert len(single) == 4 and single[-1] < single[0]
    for it, (got, want) in enumerate(zip(zbv, single), 1):
        assert math.isclose(got, want, rel_tol=1e-5), f"iteration {it}: pp2 zbv {got} vs single-process {want}"
