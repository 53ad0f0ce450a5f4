"""What a run says at start and what it refuses up front (issues 32 and 33): "did you mean" for a mistyped flag
with one usage line, sizes that cannot fit in memory, flags that do nothing for the layout, the "run:" block,
and the progress lines of a long validation."""
import os
import subprocess
import sys

import pytest
import torch

from llamapipe.core.config import ArgumentError
from llamapipe.core.parallel_state import ParallelState
from llamapipe.model.llama import LlamaConfig
from llamapipe.training.arguments import parser as parser_module
from llamapipe.training.arguments.memory import check_fits_memory, model_parameters
from llamapipe.training.flag_parser import unrecognized
from llamapipe.training.arguments.parser import build_parser, config_from_args, parse_args
from llamapipe.training.startup import startup_lines
from llamapipe.training.validation_progress import ValidationProgress
from tests.harness import ROOT

GIB = 2 ** 30
USAGE = "usage: pretrain_llama.py [flags]   (--help lists every flag)"


def cfg(argv, world=1):
    return config_from_args(build_parser().parse_args(["--mock-data", "--model", "tiny"] + argv), world)


# --- a mistyped flag -------------------------------------------------------------------------------------

def test_unknown_flag_gets_the_closest_known_one():
    known = build_parser().option_strings()
    assert unrecognized(["--pipeline-parallel-size", "2"], known) == \
        "unrecognized argument --pipeline-parallel-size; did you mean --pipeline-model-parallel-size?"
    assert unrecognized(["--sequence-paralel", "--qqqqqq", "3"], known) == \
        "unrecognized arguments --sequence-paralel (did you mean --sequence-parallel?), --qqqqqq"
    assert unrecognized(["--lr-warmup=5"], known) == \
        "unrecognized argument --lr-warmup=5; did you mean --lr-warmup-iters?"
    assert unrecognized(["stray"], known) == "unrecognized argument stray"


def test_unknown_flag_prints_the_usage_line_and_the_error_on_rank_0_only(capsys, monkeypatch):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["--mock-data", "--pipeline-parallel-size", "2"])
    assert info.value.code == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.splitlines() == [
        USAGE, "pretrain_llama.py: error: unrecognized argument --pipeline-parallel-size; "
               "did you mean --pipeline-model-parallel-size?"]
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--pipeline-parallel-size", "2"])
    assert capsys.readouterr().err == ""


def test_cli_mistyped_flag_is_exactly_two_lines():
    env = dict(os.environ, RANK="0", WORLD_SIZE="1")
    proc = subprocess.run([sys.executable, "pretrain_llama.py", "--mock-data", "--pipeline-parallel-size", "2"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        USAGE, "pretrain_llama.py: error: unrecognized argument --pipeline-parallel-size; "
               "did you mean --pipeline-model-parallel-size?"]


# --- sizes that cannot fit -------------------------------------------------------------------------------

def test_parameter_count_matches_the_built_model_and_llama2_7b():
    from llamapipe.model.llama import LlamaModel
    for tie in (False, True):
        m = LlamaConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                        vocab_size=250, max_position_embeddings=16, tie_word_embeddings=tie)
        built = sum(p.numel() for p in LlamaModel(m, ParallelState(), seed=1).parameters())
        assert model_parameters(m, tp=1) == built
    assert model_parameters(LlamaConfig.from_name("llama2-7b"), tp=1) == 6_738_415_616   # Meta's published count


def test_weights_that_cannot_fit_are_refused_with_the_numbers():
    c = cfg(["--model", "llama2-7b"])                                # 6.74e9 fp32 parameters: 25.1 GiB
    check_fits_memory(c.model, c.parallel, c.training, False, 26 * GIB)
    with pytest.raises(ArgumentError) as info:
        check_fits_memory(c.model, c.parallel, c.training, False, 24 * GIB)
    assert str(info.value).startswith("the weights alone need 25.1 GiB per rank (6.74 billion parameters in fp32 / "
                                      "(tp 1 x pp 1)), more than this machine's 24.0 GiB of memory")
    check_fits_memory(c.model, c.parallel, c.training, True, 13 * GIB)   # bf16: 12.6 GiB
    with pytest.raises(ArgumentError, match=r"x 2 ranks on this machine"):   # CPU ranks share the host
        check_fits_memory(c.model, c.parallel, c.training, True, 13 * GIB, local_ranks=2)
    sharded = cfg(["--model", "llama2-7b", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size",
                   "2", "--global-batch-size", "4"], world=4)
    check_fits_memory(sharded.model, sharded.parallel, sharded.training, False, 7 * GIB)   # 6.3 GiB per rank
    check_fits_memory(c.model, c.parallel, c.training, False, None)                        # unknown: no check


def test_a_microbatch_whose_logits_cannot_fit_is_refused():
    c = cfg(["--micro-batch-size", "100000", "--seq-length", "256", "--max-position-embeddings", "256"])
    logits = 100000 * 256 * c.model.padded_vocab_size(1) * 4
    check_fits_memory(c.model, c.parallel, c.training, False, logits + 1)
    with pytest.raises(ArgumentError, match=r"one microbatch's logits need 97.7 GiB \(--micro-batch-size 100000 x "
                                            r"--seq-length 256 x vocabulary 1024 / tp 1 in fp32\)"):
        check_fits_memory(c.model, c.parallel, c.training, False, logits - 1)


def test_parse_args_checks_the_machine_memory(monkeypatch, capsys):
    monkeypatch.setattr(parser_module, "machine_memory_bytes", lambda backend: GIB)
    with pytest.raises(SystemExit) as info:
        parse_args(["--mock-data", "--model", "llama2-7b"], world_size=1)
    assert info.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "than this machine's 1.0 GiB of memory" in err[0]
    assert parse_args(["--mock-data", "--model", "tiny"], world_size=1).model.num_layers == 8


def test_the_microbatch_cap_is_inclusive():
    assert cfg(["--global-batch-size", "2000000", "--micro-batch-size", "2"]).training.num_microbatches == 10 ** 6


# --- flags that do nothing for this layout ---------------------------------------------------------------

DP1 = "at data-parallel size 1 (world size 2 = tp 1 x pp 2): there is no other data-parallel rank"
PP2 = ["--pipeline-model-parallel-size", "2", "--global-batch-size", "4"]
NOOPS = [
    (PP2 + ["--use-torch-fsdp2"], 2, [f"--use-torch-fsdp2 has no effect {DP1} to shard with; every rank keeps its "
                                      "whole optimizer state, gradients and parameters"]),
    (PP2 + ["--data-parallel-sharding-strategy", "optim_grads_params", "--overlap-grad-reduce"], 2,
     [f"--data-parallel-sharding-strategy optim_grads_params has no effect {DP1} to shard with; every rank keeps "
      "its whole optimizer state, gradients and parameters",
      f"--overlap-grad-reduce has no effect {DP1} to reduce gradients with"]),
    (PP2 + ["--use-distributed-optimizer", "--ddp-bucket-size", "1000"], 2,
     [f"--use-distributed-optimizer has no effect {DP1} to shard with; every rank keeps its whole optimizer "
      "state, gradients and parameters", f"--ddp-bucket-size 1000 has no effect {DP1} to reduce gradients with"]),
    (["--data-parallel-sharding-strategy", "optim_grads", "--overlap-grad-reduce", "--global-batch-size", "2"], 2,
     ["--overlap-grad-reduce has no effect with --data-parallel-sharding-strategy optim_grads: FSDP "
      "reduce-scatters the gradients once, after the step's last weight-gradient pass"]),
    (PP2 + ["--num-virtual-stages-per-pipeline-rank", "1"], 2,
     ["--num-virtual-stages-per-pipeline-rank 1 has no effect: it gives one model chunk per pipeline rank, the "
      "layout without it"]),
    (PP2 + ["--num-layers-per-virtual-pipeline-stage", "4"], 2,
     ["--num-layers-per-virtual-pipeline-stage 4 has no effect: it gives one model chunk per pipeline rank, the "
      "layout without it"]),
    (["--pipeline-schedule", "zb-h2"], 1, ["--pipeline-schedule zb-h2 has no effect with "
                                           "--pipeline-model-parallel-size 1: the one stage runs its microbatches "
                                           "one after another"]),
    (PP2 + ["--pipeline-profile-iters", "5"], 2,
     ["--pipeline-profile-iters 5 has no effect: only the auto and zb-h2 schedules at --pipeline-model-parallel-size "
      "> 1 profile (this run: 1f1b, pp 2)"]),
    (["--save-interval", "5", "--keep-last-n", "2", "--async-save", "--ckpt-format", "torch_dist"], 1,
     [f"{flag} has no effect without --save: no checkpoint is written"
      for flag in ("--save-interval 5", "--keep-last-n 2", "--async-save", "--ckpt-format torch_dist")]),
    # the same flags where they act: no notice
    (["--use-distributed-optimizer", "--overlap-grad-reduce", "--global-batch-size", "2"], 2, []),
    (PP2 + ["--pipeline-schedule", "zb-h2", "--pipeline-profile-iters", "5"], 2, []),
    (PP2 + ["--num-virtual-stages-per-pipeline-rank", "2"], 2, []),
    (["--save", "/tmp/ckpt", "--save-interval", "5"], 1, []),
]


@pytest.mark.parametrize("argv,world,want", NOOPS, ids=[" ".join(n[0]) for n in NOOPS])
def test_a_flag_with_no_effect_for_this_layout_gets_a_notice(argv, world, want, llamapipe_log):
    cfg(argv, world)
    assert [line for line in llamapipe_log if line.startswith("notice:")] == ["notice: " + w for w in want]


# --- the "run:" block ------------------------------------------------------------------------------------

def test_startup_block_names_layout_schedule_sharding_numerics_and_validation():
    c = cfg(["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--sequence-parallel",
             "--num-virtual-stages-per-pipeline-rank", "2", "--pipeline-schedule", "zbv", "--global-batch-size", "8",
             "--micro-batch-size", "2", "--use-distributed-optimizer", "--bf16", "--recompute-granularity", "full",
             "--eval-iters", "7", "--eval-interval", "50", "--distributed-backend", "gloo"], world=8)
    assert startup_lines(c) == [
        "run: 8 ranks = tp 2 x pp 2 x dp 2 (order tp-cp-dp-pp), 2 model chunks per pipeline rank (vpp), sequence "
        "parallel on, gloo",
        "run: schedule zbv, 2 microbatches per step (global batch 8 / (micro-batch 2 x dp 2))",
        "run: data-parallel sharding optim (distributed optimizer, ZeRO-1: optimizer state sharded over "
        "data-parallel ranks); gradients reduced after the backward",
        "run: precision bf16 with fp32 master weights, recompute full (every layer), compile off, optimizer "
        "post-validation off",
        "run: validation over 7 global batches every 50 iterations and after training (--eval-iters 7; 0 turns it "
        "off)"]


@pytest.mark.parametrize("schedule", ["zb-h2", "auto"])
def test_startup_block_says_the_first_iterations_are_profiled_1f1b(schedule):
    c = cfg(["--pipeline-model-parallel-size", "2", "--pipeline-schedule", schedule, "--global-batch-size", "4",
             "--pipeline-profile-iters", "4"], world=2)
    assert startup_lines(c)[1] == (f"run: schedule {schedule}, 4 microbatches per step (global batch 4 / "
                                   f"(micro-batch 1 x dp 1)); the first 4 iterations run profiled 1F1B "
                                   f"(--pipeline-profile-iters), then the {schedule} plan fitted to the measured "
                                   "costs")


def test_startup_block_at_dp1_says_a_sharding_strategy_is_inactive_and_megatrons_default_validation():
    lines = startup_lines(cfg(["--use-torch-fsdp2", "--fp16"]))
    assert lines[2] == ("run: data-parallel sharding optim_grads_params (FSDP2, ZeRO-3: optimizer state, gradients "
                        "and parameters sharded), inactive at dp 1; no gradient reduction")
    assert lines[3].startswith("run: precision fp16 with fp32 master weights and dynamic loss scaling")
    assert lines[4] == "run: validation over 100 global batches after training (--eval-iters 100; 0 turns it off)"


def test_main_logs_the_block_once_after_the_notices(monkeypatch, llamapipe_log):
    import llamapipe.train
    import llamapipe.training.pretrain
    monkeypatch.setattr(llamapipe.training.pretrain, "pretrain", lambda config: 0)
    assert llamapipe.train.main(["--mock-data", "--model", "tiny", "--overlap-grad-reduce"]) == 0
    start = [line for line in llamapipe_log if line.startswith(("notice:", "run:"))]
    assert start[0].startswith("notice: --overlap-grad-reduce has no effect at data-parallel size 1")
    assert [line.split(" ")[1] for line in start[1:]] == ["1", "no", "data-parallel", "precision", "validation"]


# --- validation progress ---------------------------------------------------------------------------------

class _Clock:
    """A clock the test sets: `now` seconds."""
    now = 0.0

    def __call__(self) -> float:
        return self.now


def _run(total: int, seconds_per_iteration: float, min_seconds: float = 5.0) -> tuple[list, ValidationProgress]:
    """The progress lines of a pass whose iterations each take `seconds_per_iteration` (None where silent)."""
    clock = _Clock()
    progress = ValidationProgress(total, min_seconds=min_seconds, clock=clock)
    lines = []
    for done in range(1, total + 1):
        clock.now = done * seconds_per_iteration
        lines.append(progress.line(done))
    return lines, progress


def test_a_slow_validation_reports_every_tenth_once_it_has_run_min_seconds():
    lines, progress = _run(100, 0.48)                  # issue 33: 100 iterations in 48 s
    said = [line for line in lines if line is not None]
    assert said == [f"validation: {done}/100 iterations, {done * 0.48:.1f} s" for done in range(20, 100, 10)]
    assert progress.summary() == "100 iterations in 48.0 s"
    lines, _ = _run(100, 0.5)                          # 5.0 s at the first tenth: it counts
    assert lines[9] == "validation: 10/100 iterations, 5.0 s" and lines[99] is None


def test_a_quick_or_short_validation_prints_only_its_result():
    lines, progress = _run(100, 0.01)
    assert lines == [None] * 100 and progress.summary() == "100 iterations in 1.0 s"
    lines, _ = _run(3, 10.0)
    assert lines == ["validation: 1/3 iterations, 10.0 s", "validation: 2/3 iterations, 20.0 s", None]
    assert _run(1, 0.0)[1].summary() == "1 iteration in 0.0 s"
