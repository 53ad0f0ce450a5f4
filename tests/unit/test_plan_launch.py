"""`llamapipe plan`'s top row as a launch a user can run (issue 50, item 3): past one node it goes through
scripts/launch_multi_node.sh, whose rendezvous and node rank torchrun's one-node form lacks, with the SLURM script
named; and the output names the run-length and learning-rate flags whose defaults (10 iterations at 3e-4) the
printed command would otherwise train."""
import os
import pathlib
import shlex
import stat
import subprocess

from llamapipe.tools import launch_line
from llamapipe.tools.plan_parallelism import main
from llamapipe.training.arguments.parser import build_parser, config_from_args
from llamapipe.training.arguments.training_args import DEFAULT_TRAIN_ITERS

ROOT = pathlib.Path(__file__).resolve().parents[2]
LLAMA3_16 = ["--model", "llama3-8b", "--gpus", "16", "--seq-length", "8192", "--global-batch-size", "512",
             "--top", "1"]


def _top_row(out: str) -> str:
    return out.split("Top row:\n")[1].splitlines()[0].strip()


def test_a_two_node_top_row_runs_through_the_multi_node_script_as_printed(capsys, tmp_path):
    """The printed line, its placeholders filled in, runs scripts/launch_multi_node.sh, which hands torchrun
    (a stub python3 that records its arguments) the rendezvous, this node's rank and the trainer's flags."""
    assert main(LLAMA3_16) == 0
    out = capsys.readouterr().out
    line = _top_row(out)
    assert line.startswith("MASTER_ADDR=FIRST_NODE NNODES=2 NODE_RANK=K GPUS_PER_NODE=8 bash "
                           "scripts/launch_multi_node.sh ") and (ROOT / launch_line.MULTI_NODE_SCRIPT).is_file()
    assert "K the node's rank, 0 to 1" in out and "`sbatch --nodes 2 scripts/launch_slurm.sbatch`" in out
    stub = tmp_path / "python3"
    stub.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {tmp_path / "argv"}\n')
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    filled = line.replace("FIRST_NODE", "10.0.0.1").replace("NODE_RANK=K", "NODE_RANK=1")
    env = dict(os.environ, PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    proc = subprocess.run(["bash", "-c", filled], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    argv = (tmp_path / "argv").read_text().splitlines()
    assert argv[:2] == ["-m", "torch.distributed.run"]
    for flag, value in (("--nnodes", "2"), ("--node_rank", "1"), ("--nproc_per_node", "8"),
                        ("--rdzv_endpoint", "10.0.0.1:29500")):
        assert argv[argv.index(flag) + 1] == value, (flag, argv)
    flags = argv[argv.index("pretrain_llama.py") + 1:]
    assert flags == shlex.split(line)[6:]
    assert config_from_args(build_parser().parse_args(flags), 16).parallel.world_size == 16


def test_the_slurm_script_takes_the_trainers_flags_and_the_gpus_per_node():
    """What the SLURM note tells a user to do works: the script hands its arguments to pretrain_llama.py and
    reads GPUS_PER_NODE, which the note sets when a node holds fewer than 8 of the job's GPUs."""
    text = (ROOT / launch_line.SLURM_SCRIPT).read_text()
    assert 'pretrain_llama.py "$@"' in text and "${GPUS_PER_NODE:-8}" in text
    assert launch_line.nodes_of(12) == (2, 6) and launch_line.nodes_of(8) == (1, 8)
    note = launch_line.top_row(12, "CMD")
    assert "`GPUS_PER_NODE=6 sbatch --nodes 2 --gpus-per-node 6 scripts/launch_slurm.sbatch`" in note


def test_one_node_keeps_torchrun_and_every_plan_names_the_run_length_and_lr_flags(capsys):
    assert main(["--model", "tiny", "--gpus", "2", "--global-batch-size", "8", "--seq-length", "128",
                 "--top", "1"]) == 0
    single = capsys.readouterr().out
    assert _top_row(single).startswith("torchrun --nproc-per-node 2 pretrain_llama.py ")
    assert "spans" not in single and "launch_multi_node" not in single
    assert main(LLAMA3_16) == 0
    multi = capsys.readouterr().out
    defaults = build_parser().parse_args(["--mock-data"])
    assert DEFAULT_TRAIN_ITERS == 10 and defaults.lr == 3e-4 and defaults.min_lr == 0.0    # what the note says
    assert defaults.lr_decay_style == "linear" and defaults.lr_warmup_iters == 0
    for out in (single, multi):
        assert "10 iterations at --lr 3e-4 (linear decay to --min-lr 0, no warmup)" in out
        for flag in ("--train-iters N", "--train-samples N", "--lr,", "--min-lr", "--lr-decay-style",
                     "--lr-warmup-iters"):
            assert flag in out, flag
