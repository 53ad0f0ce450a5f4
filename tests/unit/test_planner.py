"""`llamapipe plan` (tools/plan_parallelism.py, tools/parallel_estimate.py): its memory model against Megatron-LM's
published theoretical-memory formula, its ranking, and its top row as a command line the trainer accepts."""
import shlex

import pytest

from llamapipe.model.config import PRESETS, LlamaConfig
from llamapipe.tools.parallel_estimate import DEVICES, GIB, Layout, estimate
from llamapipe.tools.plan_parallelism import main
from llamapipe.training.arguments.parser import build_parser, config_from_args

# Megatron-LM megatron/training/theoretical_memory_usage.py (report_theoretical_memory: sequence parallelism and
# selective recompute, 1F1B, untied embeddings; Korthikanti et al., arXiv 2205.05198, Table 2), evaluated by hand
# for LLaMA2-7B (L 32, h 4096, a = g = 32, vocab 32000 padded to 128 x tp), seq 4096, micro-batch 1, 64
# microbatches: weights and optimizer = params of the most loaded shard x (18, or 6 + 12/dp with the distributed
# optimizer); activations = (34 s b h L + 8 s b pp + s b h pp [+ 4 s b h (1 + V/h) when pp = 1]) / tp.
MEGATRON_BYTES = {  # (tp, pp, dp, distributed optimizer): weights + optimizer, activations
    (8, 1, 1, False): (15_100_692_480, 2_359_300_096),
    (4, 2, 1, False): (15_091_255_296, 4_571_807_744),
    (2, 2, 2, True): (20_115_382_272, 9_143_615_488),
}


@pytest.mark.parametrize("layout", list(MEGATRON_BYTES))
def test_llama2_7b_on_8_gpus_within_10_percent_of_megatrons_formula(layout):
    tp, pp, dp, dist_opt = layout
    model = LlamaConfig(**PRESETS["llama2-7b"])
    est = estimate(model, Layout(tp, pp, 1, dp, "1f1b", 1, "selective", dist_opt), 4096, 64 * dp, DEVICES["h100"])
    weights, activations = MEGATRON_BYTES[layout]
    assert abs(est.params + est.grads + est.optimizer - weights) <= 0.02 * weights
    assert abs(est.total - (weights + activations)) <= 0.10 * (weights + activations)


def test_v_schedules_plan_less_activation_memory_than_1f1b():
    model = LlamaConfig(**PRESETS["llama2-7b"])
    act = {s: estimate(model, Layout(1, 8, v, 1, s, 1, "selective", False), 4096, 64, DEVICES["h100"]).activations
           for s, v in (("1f1b", 1), ("v-half", 2), ("v-min", 2))}
    assert act["v-half"] <= 0.7 * act["1f1b"] and act["v-min"] <= 0.5 * act["1f1b"], act


def test_plan_prints_a_ranked_table_and_a_command_the_trainer_accepts(capsys):
    assert main(["--model", "llama2-7b", "--gpus", "8", "--gpu-memory-gb", "80", "--seq-length", "4096",
                 "--global-batch-size", "64", "--top", "5"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line[:3].strip().isdigit() and "%" in line]
    assert len(rows) == 5
    steps = [float(line.split()[-2]) for line in rows]
    assert steps == sorted(steps)
    assert all(float(line.split()[-3]) <= 0.9 * 80 for line in rows)            # total GiB under the headroom
    cmd = shlex.split(out.split("Top row:")[1].strip())
    assert cmd[:3] == ["torchrun", "--nproc-per-node", "8"] and cmd[3] == "pretrain_llama.py"
    config = config_from_args(build_parser().parse_args(cmd[4:] + ["--mock-data"]), 8)
    assert config.parallel.tp_size * config.parallel.pp_size * config.parallel.dp_size == 8


def test_explain_and_nothing_fits(capsys):
    assert main(["--model", "llama2-7b", "--gpus", "8", "--global-batch-size", "64", "--explain", "1"]) == 0
    out = capsys.readouterr().out
    assert "total on the most loaded rank" in out and "optimizer" in out
    assert main(["--model", "llama2-70b", "--gpus", "1", "--gpu-memory-gb", "24", "--global-batch-size", "8"]) == 1
    assert "no layout fits 1 GPUs of 24 GiB" in capsys.readouterr().err
    assert GIB == 2 ** 30
