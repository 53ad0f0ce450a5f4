"""Mistakes a real run refuses or fails on, found by the dry run with the real run's one line (issue 41).

Each case runs `llamapipe dry-run` in this process and reads its last stderr line. Where the real run refuses
while parsing, the same flags go through the real `parse_args` (world size from the flag) and its line must be
the dry run's; where it refuses while loading a checkpoint, the real `load_checkpoint` runs on real CPU chunks
and its error must be the dry run's line. A rank over the device's memory (the real run would fail out of
memory, after queueing and building) is the dry run's own line, naming the ranks."""
import dataclasses
import json
import os
import shutil

import pytest
import torch

from llamapipe.core.optimizer import build_optimizer
from llamapipe.core.parallel_state import ParallelState
from llamapipe.training.schedule_file import write_schedule_file
from llamapipe.core.pipeline_parallel.schedule_ir import Action
from llamapipe.core.pipeline_parallel.schedule_specs import build
from llamapipe.training.arguments.parser import parse_args
from llamapipe.training.checkpointing.save_load import finalize_async_save, load_checkpoint, save_checkpoint
from llamapipe.training.dry_run.main import build_parser, dry_run_config, main, resume_source, run
from llamapipe.training.setup import build_model_chunks
from tests.cli import TINY

BASE = TINY + ["--train-iters", "4", "--global-batch-size", "16", "--micro-batch-size", "2"]


def dry_run_error(world: int, flags: list[str], capsys) -> tuple[int, str]:
    try:
        code = main(["--world-size", str(world)] + flags)
    except SystemExit as exit_:             # refused by a flag's own parsing, as argparse does
        code = exit_.code
    return code, capsys.readouterr().err.strip().splitlines()[-1]


def real_parse_error(world: int, flags: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(flags, world_size=world)
    assert exit_info.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    return line.replace("pretrain_llama.py: error: ", "llamapipe dry-run: error: ", 1)   # the same words, our name


def deadlocking_schedule(path: str) -> str:
    """1F1B on 2 ranks, but rank 1 takes microbatch 1 before microbatch 0, which rank 0 sends first."""
    plan = build("1f1b", 2, 1, 8)
    late = tuple(Action(a.kind, 0, 1 - a.microbatch if a.microbatch < 2 else a.microbatch) for a in plan.actions[1])
    write_schedule_file(dataclasses.replace(plan, actions=(plan.actions[0], late)), path)
    return path


PARSE_MISTAKES = {   # name: (world size, flags, words of the real line)
    "world size not divisible": (6, ["--tensor-model-parallel-size", "4"], "world size 6 is not divisible by"),
    "global batch not divisible": (4, ["--global-batch-size", "10"], "--global-batch-size 10 is not divisible by "
                                   "--micro-batch-size (2) x data-parallel size (4)"),
    "layers do not split into the chunks": (4, ["--pipeline-model-parallel-size", "2",
                                                "--num-virtual-stages-per-pipeline-rank", "3"],
                                            "--num-layers 8 is not divisible by --pipeline-model-parallel-size 2 x "
                                            "--num-virtual-stages-per-pipeline-rank 3 (6 virtual stages)"),
    "heads do not split over tp": (8, ["--tensor-model-parallel-size", "8"],
                                   "--num-attention-heads 4 is not divisible by --tensor-model-parallel-size (8)"),
    "sequence does not split over cp": (8, ["--context-parallel-size", "8", "--seq-length", "40"],
                                        "--seq-length 40 is not divisible by 2 x --context-parallel-size (8)"),
    "missing tokenizer": (1, ["--tokenizer-model", "/nonexistent/tokenizer.model"],
                          "--tokenizer-model /nonexistent/tokenizer.model does not exist"),
}


@pytest.mark.parametrize("name", list(PARSE_MISTAKES))
def test_a_mistake_the_real_run_refuses_while_parsing(name, capsys):
    world, flags, words = PARSE_MISTAKES[name]
    code, line = dry_run_error(world, BASE + flags, capsys)
    assert code == 2 and words in line
    assert line == real_parse_error(world, BASE + flags, capsys)


def test_missing_data_files(capsys):
    flags = [f for f in BASE if f != "--mock-data"] + ["--data-path", "/nonexistent/corpus",
                                                       "--tokenizer-type", "NullTokenizer"]
    code, line = dry_run_error(2, flags, capsys)
    assert code == 2 and "file /nonexistent/corpus.bin does not exist" in line
    assert line == real_parse_error(2, flags, capsys)


def test_a_plan_that_deadlocks(tmp_path, capsys):
    flags = BASE + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule-file",
                    deadlocking_schedule(str(tmp_path / "late.csv"))]
    code, line = dry_run_error(4, flags, capsys)
    assert code == 2 and "receives microbatch 1 but rank 0 sends microbatch 0 first on that stream" in line
    assert line.split(": error: ")[1] == real_parse_error(4, flags, capsys).split(": error: ")[1]


def test_a_rank_over_the_device_memory_is_named(capsys):
    """The first stage (the embedding, and 1F1B's deepest activations) needs about 5.0 MiB, the second 4.2."""
    code, line = dry_run_error(4, BASE + ["--pipeline-model-parallel-size", "2", "--gpu-memory-gb", "0.0045"], capsys)
    assert code == 1
    assert line.startswith("llamapipe dry-run: error: ranks 0-1 would not fit in --gpu-memory-gb 0.0045: rank 0 "
                           "(tp 0, cp 0, pp 0) needs 5.")


def test_weights_that_cannot_fit_any_gpu(capsys):
    code, line = dry_run_error(8, ["--model", "llama2-70b", "--mock-data", "--train-iters", "1",
                                   "--global-batch-size", "8", "--gpu-memory-gb", "80"], capsys)
    assert code == 2
    assert line.startswith("llamapipe dry-run: error: the weights alone need ") \
        and "more than its GPU's 80.0 GiB of memory" in line


def real_checkpoint(save: str, flags: list[str]) -> str:
    """A checkpoint written by the real save (one rank) of the model `flags` give; returns its directory."""
    config = dry_run_config(build_parser().parse_args(["--world-size", "1"] + flags))
    chunks, _ = build_model_chunks(config, config.model, ParallelState(), torch.device("cpu"))
    save_checkpoint(save, 1, model_chunks=chunks, optimizer=build_optimizer(chunks, config.optimizer, ParallelState()),
                    scheduler=None, parallel_state=None, config=config, consumed_samples=0)
    finalize_async_save()
    return os.path.join(save, "iter_0000001")


def real_load_error(flags: list[str]) -> str:
    config = dry_run_config(build_parser().parse_args(["--world-size", "1"] + flags))
    chunks, _ = build_model_chunks(config, config.model, ParallelState(), torch.device("cpu"))
    with pytest.raises(ValueError) as err:
        load_checkpoint(config.checkpoint.load, model_chunks=chunks, optimizer=build_optimizer(
            chunks, config.optimizer, ParallelState()), scheduler=None, parallel_state=None, config=config)
    return f"llamapipe dry-run: error: {err.value}"


def test_a_checkpoint_of_another_model(tmp_path, capsys):
    real_checkpoint(str(tmp_path), BASE)
    flags = [f if f != "64" else "128" for f in BASE] + ["--load", str(tmp_path)]      # --hidden-size 128
    code, line = dry_run_error(1, flags, capsys)
    assert code == 2 and "was saved with hidden_size 64 but this run has 128; set --hidden-size 64" in line
    assert line == real_load_error(flags)


def test_a_checkpoint_without_optimizer_state(tmp_path, capsys):
    from llamapipe.training.checkpointing.resharding import model_specs
    from llamapipe.training.checkpointing.io import write_layout
    config = dry_run_config(build_parser().parse_args(["--world-size", "1"] + BASE))
    chunks, _ = build_model_chunks(config, config.model, ParallelState(), torch.device("cpu"))
    state = {name: p.detach() for name, p in chunks[0].named_parameters()}
    write_layout(str(tmp_path), 3, state, model_specs(config.model, 1), dataclasses.asdict(config.model), tp=1, pp=1)
    flags = BASE + ["--load", str(tmp_path)]
    code, line = dry_run_error(1, flags, capsys)
    assert code == 2 and line.endswith("has no optimizer state; pass --no-load-optim to load the model weights only")
    assert line == real_load_error(flags)
    assert main(["--world-size", "2", "--tensor-model-parallel-size", "2", "--no-load-optim"] + flags) == 0


def test_a_resume_in_another_layout_reads_the_whole_tensors_and_keeps_its_shards(tmp_path, capsys):
    ckpt = real_checkpoint(str(tmp_path / "save"), BASE)
    assert main(["--world-size", "2"] + BASE + ["--load", str(tmp_path / "save")]) == 0
    same = capsys.readouterr().out
    assert "resume: the heaviest rank" in same and "(0.00 MiB resharded away)" in same
    layout = str(tmp_path / "metadata.json")
    shutil.copy(os.path.join(ckpt, "metadata.json"), layout)
    tp2 = ["--world-size", "2", "--tensor-model-parallel-size", "2"] + BASE + ["--dry-run-checkpoint-layout", layout]
    args = build_parser().parse_args(tp2)
    config = dry_run_config(args)
    reports = run(config, resume_source(args, config)).reports
    for report in reports:    # the split tensors whole, the norms once: over half of the reads are resharded away
        assert report.resume.files == 2 and report.resume.read > 1.9 * report.resume.kept
        assert report.resume.kept == report.params + report.optimizer     # its fp32 weights and Adam's moments
    with open(layout) as fh:
        meta = json.load(fh)
    meta["model_config"]["num_layers"] = 6
    with open(layout, "w") as fh:
        json.dump(meta, fh)
    code, line = dry_run_error(2, tp2[2:], capsys)
    assert code == 2 and "was saved with num_layers 6 but this run has 8; set --num-layers 6" in line


def test_errors_name_the_dry_run_and_its_world_size_flag(capsys):
    """Issue 50.5/51.12: the line names `llamapipe dry-run` and --world-size, not pretrain_llama.py and WORLD_SIZE."""
    code, line = dry_run_error(0, BASE, capsys)
    assert code == 2
    assert line == "llamapipe dry-run: error: --world-size 0 must be positive"


def test_a_model_too_deep_to_check_is_refused_in_one_line(capsys):
    """Before: --num-layers 1000000 ran silently for minutes at 12 GB."""
    from llamapipe.training.dry_run.main import main as dry_main
    from tests.cli import TINY
    flags = list(TINY)
    flags[flags.index("--num-layers") + 1] = "1000000"
    assert dry_main(["--world-size", "2", *flags, "--train-iters", "2", "--global-batch-size", "4",
                     "--pipeline-model-parallel-size", "2"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("more than the dry run checks (4,096: it builds every layer of a stage on meta tensors, "
                            "about 40 ms each, and the largest published models have 126)"), err


def test_receive_order_walks_each_plans_actions_once():
    """Every rank's receive order from one pass over the plan (was: each rank walked every peer, quadratic in pp),
    and the same orders as a walk per rank."""
    from unittest import mock
    from llamapipe.core.pipeline_parallel import p2p_communication as p2p
    from llamapipe.core.pipeline_parallel.schedule_specs import build
    plan = build("interleaved", 8, 2, 16)
    with mock.patch.object(p2p, "needs_and_sends", wraps=p2p.needs_and_sends) as counted:
        orders = [p2p.receive_order(plan, r) for r in range(8)]
    assert counted.call_count == sum(len(acts) for acts in plan.actions)
    for r in range(8):
        walked = p2p.receive_order(plan, r, actions_of=lambda peer: plan.actions[peer])
        assert orders[r] == walked


def test_a_world_too_large_to_check_is_refused_in_one_line(capsys):
    """Before: --world-size 10^9 took the machine's 24 GB (10^5 raised MemoryError)."""
    from llamapipe.training.dry_run.main import main as dry_main
    from tests.cli import TINY
    assert dry_main(["--world-size", "1000000000", *TINY, "--train-iters", "2"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert "--world-size 1,000,000,000 is more than the dry run checks (131,072 ranks" in err[-1], err
