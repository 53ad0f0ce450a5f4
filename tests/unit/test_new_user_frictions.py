"""A new user's small frictions (issue 39, item 7), each as the user meets it: every refused flag in one line,
the V schedules without a chunk flag, `plan`'s memory unit and a top command that runs as printed, what a
resumed run says it trains, Megatron flags that do nothing saying so, and the README's word on the suite."""
from __future__ import annotations

import os
import shlex

import pytest

from llamapipe.core.config import ArgumentError
from llamapipe.tools import plan_parallelism
from llamapipe.training.arguments.parser import build_parser, config_from_args
from llamapipe.training.progress import start_line
from tests.harness import ROOT

PP2 = ["--mock-data", "--pipeline-model-parallel-size", "2", "--global-batch-size", "4"]


def parse(argv: list[str], world: int = 2):
    return config_from_args(build_parser().parse_args(argv), world)


def test_every_refused_flag_is_in_the_one_line():
    with pytest.raises(ArgumentError) as info:
        parse(["--mock-data", "--num-experts", "8", "--fp8-format", "hybrid", "--vocab-file", "v.json"], 1)
    said = str(info.value)
    assert said.startswith("3 flags are not supported: --num-experts 8 (LLaMA is a dense model")
    assert "--fp8-format hybrid (FP8 training needs Transformer Engine" in said and "--vocab-file v.json (" in said
    assert "\n" not in said
    with pytest.raises(ArgumentError, match=r"^--num-experts 8 is not supported: LLaMA is a dense model"):
        parse(["--mock-data", "--num-experts", "8"], 1)       # one alone reads as before


@pytest.mark.parametrize("schedule", ["zbv", "v-half", "v-min", "dualpipev"])
def test_v_schedules_take_their_two_chunks_without_a_flag(schedule):
    config = parse(PP2 + ["--pipeline-schedule", schedule])
    assert (config.parallel.pipeline_schedule, config.parallel.vpp_size) == (schedule, 2)


def test_a_chunk_count_that_cannot_be_is_still_refused():
    with pytest.raises(ArgumentError, match="interleaved needs 2 or more model chunks per pipeline rank, got 1"):
        parse(PP2 + ["--pipeline-schedule", "interleaved"])       # 2 or more: the count is the user's choice
    with pytest.raises(ArgumentError, match="got 1, and --num-layers 6 is not divisible by the 2 x"):
        parse(PP2 + ["--model", "tiny", "--num-layers", "6", "--pipeline-schedule", "zbv"])   # 6 layers, 4 stages


def test_plan_says_its_memory_unit_and_its_top_command_runs_as_printed(capsys):
    assert plan_parallelism.main(["--model", "tiny", "--gpus", "2", "--global-batch-size", "8", "--seq-length",
                                  "128", "--top", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    head = next(i for i, line in enumerate(out) if line.lstrip().startswith("#  tp"))
    unit = out[head - 1]
    assert unit.strip() == "GiB on the most loaded GPU"
    assert out[head].index("params") <= unit.index("GiB") < out[head].index("step s")
    command = shlex.split(out[out.index(next(line for line in out if line.endswith("Top row:"))) + 1])
    assert command[:4] == ["torchrun", "--nproc-per-node", "2", "pretrain_llama.py"]
    config = parse(command[4:])       # as printed: nothing added
    assert config.data.mock_data and config.parallel.pp_size * config.parallel.tp_size == 2
    note = next(i for i, line in enumerate(out) if "--data-path PREFIX --tokenizer-model TOKENIZER" in line)
    assert out[note + 1].endswith("docs/dry_run.md):") and out[-2].endswith("Top row:")


@pytest.mark.parametrize("train_iters, start, said", [
    (10, 0, "training 10 iterations (--train-iters 10)"),
    (1, 0, "training 1 iteration (--train-iters 1)"),
    (100, 80, "training 20 iterations, 81 to 100 (resumed at iteration 80; --train-iters is the last iteration)"),
    (80, 80, "nothing to train: resumed at iteration 80, and --train-iters 80 is the last iteration"),
])
def test_the_start_line_says_how_many_iterations_this_run_trains(train_iters, start, said):
    assert start_line(train_iters, start) == said


@pytest.mark.parametrize("flag, why", [("--overlap-param-gather", "gathers the parameters right after its step"),
                                       ("--grad-reduce-in-bf16", "reduced in fp32")])
def test_inert_megatron_flags_say_so(flag, why, llamapipe_log):
    parse(["--mock-data", flag], 1)
    assert any(line.startswith(f"notice: {flag} has no effect here: ") and why in line for line in llamapipe_log)


def test_readme_says_how_long_the_suite_takes_and_where_the_fast_tier_is():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    assert ("run the whole suite: ~35-42 min on 2 cores in 2 workers (what CI runs; TEST_WORKERS=0: one process); "
            "-m \"not slow\": the fast tier, ~1 min") in readme
