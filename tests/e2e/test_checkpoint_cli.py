"""Checkpoints you can trust, through pretrain_llama.py: a flipped byte in a model, optimizer or RNG file is
detected and the previous checkpoint resumes the uninterrupted losses; every checkpoint damaged stops the
run (exit 2, one line naming each, nothing trained, nothing pruned); an LR-schedule mismatch is one error
line unless an override flag says which schedule wins; --async-save writes the same bytes as a sync save
and resumes bit for bit; a worker SIGKILLed during an async save, or a full disk during a save, leaves the
previous checkpoint as the one that loads; a second run on a --save directory in use is refused in one line
naming the first, which then finishes and resumes as usual, and a dead run's lock is taken over."""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import pytest

from llamapipe.training.checkpointing import catalog, save_lock
from llamapipe.training.checkpointing.selection import scan
from llamapipe.tools import verify_checkpoint
from tests.cli import ROOT, TINY, read_metrics, torchrun, train

FLAGS = ["--micro-batch-size", "1", "--global-batch-size", "4", "--lr-decay-style", "cosine"]
FILES = ["model_tp00_pp000.safetensors", "optim_tp00_pp000.safetensors", "rng_rank00000.pt"]




@pytest.fixture(scope="module")
def run4(tmp_path_factory):
    """4 iterations on one rank, saved at 2 and 4, and their per-iteration records."""
    root = tmp_path_factory.mktemp("run4")
    rows = train(1, FLAGS + ["--train-iters", "4", "--save", str(root / "ckpt"), "--save-interval", "2"],
                 str(root / "full.jsonl"))
    return root / "ckpt", rows


def copy_of(src, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def flip_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def single(args: list[str], script: str = "pretrain_llama.py"):
    """One rank without torchrun, so the exit status is the process's own (torchrun turns 2 into 1)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, script, *TINY, *FLAGS, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def fails(proc, code: int = 2) -> str:
    """The run failed with `code` and said why in one line, without a traceback; returns that line."""
    assert proc.returncode == code, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("pretrain_llama.py: error: ")]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize("fname", FILES, ids=["model", "optimizer", "rng"])
def test_flipped_byte_resumes_from_the_previous_checkpoint(run4, tmp_path, fname):
    ckpt, full = run4
    ckpt = copy_of(ckpt, tmp_path)
    flip_byte(ckpt / "iter_0000004" / fname)
    jsonl = str(tmp_path / "resumed.jsonl")
    proc = torchrun(1, TINY + FLAGS + ["--train-iters", "4", "--load", str(ckpt), "--metrics-jsonl", jsonl])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"iter_0000004 ({fname} fails its sha256 checksum" in proc.stderr + proc.stdout
    resumed = read_metrics(jsonl)
    assert [r["iteration"] for r in resumed] == [3, 4]
    for got, want in zip(resumed, full[2:]):
        assert (got["lm_loss"], got["lr"]) == (want["lm_loss"], want["lr"]), got["iteration"]


def test_every_checkpoint_damaged_stops_before_training_and_prunes_nothing(run4, tmp_path):
    ckpt = copy_of(run4[0], tmp_path)
    flip_byte(ckpt / "iter_0000004" / FILES[0])
    (ckpt / "iter_0000002" / FILES[1]).write_bytes(b"short")
    before = {p: p.read_bytes() for p in ckpt.rglob("*") if p.is_file()}
    jsonl = tmp_path / "m.jsonl"
    proc = single(["--train-iters", "6", "--load", str(ckpt), "--save", str(ckpt), "--save-interval", "1",
                   "--keep-last-n", "1", "--metrics-jsonl", str(jsonl)])
    line = fails(proc)
    assert f"--load {ckpt} holds checkpoints but none is usable: iter_0000004 ({FILES[0]} fails" in line, line
    assert f"iter_0000002 ({FILES[1]} has 5 bytes" in line, line
    assert not jsonl.exists() or not read_metrics(str(jsonl)), "it trained"
    assert {p: p.read_bytes() for p in ckpt.rglob("*") if p.is_file()} == before, "the directory changed"


def test_schedule_mismatch_is_one_line_naming_the_flag_and_both_values(run4):
    proc = single(["--train-iters", "6", "--load", str(run4[0])])
    line = fails(proc)
    assert "--train-iters gives the decay length in iters 6 but the checkpoint's schedule has 4" in line, line


@pytest.mark.parametrize("flag,lr_after", [("--override-opt_param-scheduler", "positive"),
                                           ("--use-checkpoint-opt_param-scheduler", "min-lr")])
def test_schedule_override_flags_pick_a_schedule(run4, tmp_path, flag, lr_after):
    rows = train(1, FLAGS + ["--train-iters", "6", "--load", str(run4[0]), flag], str(tmp_path / "m.jsonl"))
    assert [r["iteration"] for r in rows] == [5, 6]
    if lr_after == "min-lr":    # the checkpoint's 4-iteration cosine has ended
        assert rows[0]["lr"] == 0.0, rows
    else:                       # the command line's 6-iteration cosine ends only after iteration 6
        assert rows[0]["lr"] > 0.0, rows


def test_async_save_writes_the_sync_bytes_and_resumes_bit_for_bit(run4, tmp_path):
    sync_dir, full = run4
    train(1, FLAGS + ["--train-iters", "4", "--save", str(tmp_path / "async"), "--save-interval", "2",
                      "--async-save"], str(tmp_path / "a.jsonl"))
    for iteration in (2, 4):
        metas = [catalog.read_metadata(catalog.iter_dir(str(d), iteration)) for d in (sync_dir, tmp_path / "async")]
        for fname in FILES[:2]:
            assert metas[0]["files"][fname]["sha256"] == metas[1]["files"][fname]["sha256"], (iteration, fname)
    shutil.rmtree(tmp_path / "async" / "iter_0000004")
    resumed = train(1, FLAGS + ["--train-iters", "4", "--load", str(tmp_path / "async")], str(tmp_path / "r.jsonl"))
    for got, want in zip(resumed, full[2:]):
        assert (got["lm_loss"], got["grad_norm"], got["lr"]) == (want["lm_loss"], want["grad_norm"], want["lr"])


_WRAPPER = """
import errno, os, signal, sys
sys.path.insert(0, {root!r})
from llamapipe.training.checkpointing import integrity
real = integrity.HashingFile.write
def write(self, data):
    if "iter_0000004.tmp" in self.path and os.environ.get("RANK", "0") == "{rank}":
        {action}
    real(self, data)
integrity.HashingFile.write = write
from llamapipe.train import main
sys.exit(main())
"""


def wrapped(tmp_path, rank: int, action: str) -> str:
    script = tmp_path / "wrapped_pretrain.py"
    script.write_text(_WRAPPER.format(root=ROOT, rank=rank, action=action))
    return str(script)


def test_worker_killed_during_async_save_keeps_the_previous_checkpoint(run4, tmp_path):
    pp2 = ["--pipeline-model-parallel-size", "2"]
    script = wrapped(tmp_path, 1, "os.kill(os.getpid(), signal.SIGKILL)")
    save = tmp_path / "ckpt"
    proc = torchrun(2, TINY + FLAGS + pp2 + ["--train-iters", "4", "--save", str(save), "--save-interval", "2",
                                             "--async-save"], script=script)
    assert proc.returncode != 0
    assert catalog.list_iterations(str(save)) == [2] and catalog.read_tracker(str(save)) == 2
    assert [i for i, defect in scan(str(save)) if defect is None] == [2]
    resumed = train(2, FLAGS + pp2 + ["--train-iters", "4", "--load", str(save)], str(tmp_path / "r.jsonl"))
    assert [r["iteration"] for r in resumed] == [3, 4]
    for got, want in zip(resumed, run4[1][2:]):
        assert got["lm_loss"] == pytest.approx(want["lm_loss"], rel=1e-5)


@pytest.mark.parametrize("async_save", [[], ["--async-save"]], ids=["sync", "async"])
def test_full_disk_during_save_is_one_line_and_keeps_the_previous_checkpoint(tmp_path, async_save):
    script = wrapped(tmp_path, 0, "raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))")
    save = tmp_path / "ckpt"
    proc = single(["--train-iters", "4", "--save", str(save), "--save-interval", "2", *async_save], script=script)
    line = fails(proc, code=1)
    assert "No space left on device (ENOSPC); iteration 2 is still the checkpoint that loads" in line, line
    assert sorted(os.listdir(save)) == ["iter_0000002", catalog.TRACKER]
    assert verify_checkpoint.main([str(save)]) == 0


def test_verify_checkpoint_command(run4, tmp_path):
    ckpt = copy_of(run4[0], tmp_path)
    flip_byte(ckpt / "iter_0000002" / FILES[2])
    proc = subprocess.run([sys.executable, "-m", "llamapipe", "verify-checkpoint", str(ckpt)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert f"iter_0000002: {FILES[2]} fails its sha256 checksum" in proc.stdout
    assert "iter_0000004: ok" in proc.stdout


_GATED = """
import os, sys, time
sys.path.insert(0, {root!r})
from llamapipe.training import loop
real = loop.Trainer.train
def train(self):
    deadline = time.time() + 120     # holds the --save lock until the test lets it train
    while not os.path.exists({go!r}) and time.time() < deadline:
        time.sleep(0.05)
    return real(self)
loop.Trainer.train = train
from llamapipe.train import main
sys.exit(main())
"""


def test_second_run_on_one_save_directory_is_refused_and_the_first_resumes(run4, tmp_path):
    save, go = tmp_path / "ckpt", tmp_path / "go"
    script = tmp_path / "gated_pretrain.py"
    script.write_text(_GATED.format(root=ROOT, go=str(go)))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    first = subprocess.Popen([sys.executable, str(script), *TINY, *FLAGS, "--train-iters", "4", "--save", str(save),
                              "--save-interval", "2", "--exit-interval", "2"], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lock = save / save_lock.LOCK_FILE
        for _ in range(1200):
            if lock.exists() and lock.read_text().strip() or first.poll() is not None:
                break
            time.sleep(0.1)
        assert first.poll() is None and lock.exists(), "the first run did not take the lock"
        line = fails(single(["--train-iters", "4", "--save", str(save)]))
        assert f"--save {save} is in use by another run (host {socket.gethostname()}, pid {first.pid}, since " \
               in line, line
    finally:
        go.touch()
        out, _ = first.communicate(timeout=300)
    assert first.returncode == 0, out[-3000:]
    assert not lock.exists(), "the lock outlived its run"
    assert catalog.list_iterations(str(save)) == [2]
    resumed = train(1, FLAGS + ["--train-iters", "4", "--load", str(save), "--save", str(save)],
                    str(tmp_path / "r.jsonl"))
    assert [r["iteration"] for r in resumed] == [3, 4]
    for got, want in zip(resumed, run4[1][2:]):
        assert (got["lm_loss"], got["lr"]) == (want["lm_loss"], want["lr"]), got["iteration"]
    assert catalog.list_iterations(str(save)) == [2, 4] and not lock.exists()
    assert verify_checkpoint.main([str(save)]) == 0


def test_stale_lock_of_a_dead_run_is_taken_over(tmp_path):
    save = tmp_path / "ckpt"
    save.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    (save / save_lock.LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid,
                                                        "since": "2020-01-01 00:00:00 UTC"}))
    proc = single(["--train-iters", "1", "--save", str(save)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"taking over the lock on --save {save} left by a run that is gone (host {socket.gethostname()}, " \
           f"pid {dead.pid}" in proc.stdout + proc.stderr
    assert catalog.list_iterations(str(save)) == [1] and not (save / save_lock.LOCK_FILE).exists()


def test_a_fresh_run_on_a_used_save_directory_is_refused_and_overwrite_save_starts_a_new_history(tmp_path):
    """Issue 51: a fresh run on a --save of an earlier run overwrote its iteration 1 and left its iteration 2, which
    a later --load resumed. Now one line; --load of it resumes; --overwrite-save leaves only the new run's."""
    save = tmp_path / "ckpt"
    assert single(["--train-iters", "2", "--save", str(save), "--save-interval", "1"]).returncode == 0
    line = fails(single(["--train-iters", "1", "--save", str(save)]))
    assert line == f"pretrain_llama.py: error: --save {save} already holds 2 checkpoint(s) of an earlier run, the " \
                   f"newest iteration 2; give --load {save} to resume it, another --save, or --overwrite-save to " \
                   "delete them first (mixing two runs' checkpoints would make a later --load resume the wrong one)"
    assert catalog.list_iterations(str(save)) == [1, 2]
    proc = single(["--train-iters", "1", "--save", str(save), "--overwrite-save"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert catalog.list_iterations(str(save)) == [1] and catalog.read_tracker(str(save)) == 1


PLANTED = {"symlink": "a symbolic link", "fifo": "a FIFO (named pipe)", "directory": "a directory"}


def _plant(path, kind: str, victim) -> None:
    {"symlink": lambda: path.symlink_to(victim), "fifo": lambda: os.mkfifo(path), "directory": path.mkdir}[kind]()


@pytest.mark.parametrize("kind", list(PLANTED))
def test_a_link_fifo_or_directory_at_the_lock_file_is_refused_and_its_target_untouched(tmp_path, kind):
    """Issue 40: `ln -s ~/victim.txt CK/llamapipe.lock` made a run write its lock record into victim.txt (exit 0,
    no message); a FIFO there would block the open."""
    save, victim = tmp_path / "ckpt", tmp_path / "victim.txt"
    save.mkdir()
    victim.write_text("precious")
    _plant(save / save_lock.LOCK_FILE, kind, victim)
    line = fails(single(["--train-iters", "1", "--save", str(save)]))
    assert line == f"pretrain_llama.py: error: --save {save}: its lock file {save / save_lock.LOCK_FILE} is " \
                   f"{PLANTED[kind]}; llamapipe writes only regular files, never through a link (remove it or " \
                   "choose another path)"
    assert victim.read_text() == "precious" and catalog.list_iterations(str(save)) == []


def test_links_at_the_metrics_file_and_the_trackers_side_file_touch_no_target(tmp_path):
    """A link at --metrics-jsonl is refused with one warning (metrics never cost the run); one at the tracker's
    temporary name (left by a crashed save, or planted) is removed, not written through; the run saves."""
    save, victim = tmp_path / "ckpt", tmp_path / "victim.txt"
    save.mkdir()
    victim.write_text("precious")
    jsonl = tmp_path / "m.jsonl"
    jsonl.symlink_to(victim)
    (save / (catalog.TRACKER + ".tmp")).symlink_to(victim)
    proc = single(["--train-iters", "1", "--save", str(save), "--metrics-jsonl", str(jsonl)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"--metrics-jsonl {jsonl}: cannot write (UnsafePathError: {jsonl} is a symbolic link; " in proc.stdout
    assert victim.read_text() == "precious"
    assert sorted(os.listdir(save)) == ["iter_0000001", catalog.TRACKER] and catalog.read_tracker(str(save)) == 1


def test_a_link_at_the_tracker_is_refused_in_one_line_and_its_target_untouched(tmp_path):
    save, victim = tmp_path / "ckpt", tmp_path / "victim.txt"
    save.mkdir()
    victim.write_text("precious")
    (save / catalog.TRACKER).symlink_to(victim)
    line = fails(single(["--train-iters", "1", "--save", str(save)]))     # at start-up, not after training (issue 51)
    assert line == f"pretrain_llama.py: error: --save {save}: its tracker {save / catalog.TRACKER} is a symbolic " \
                   "link; llamapipe writes only regular files, never through a link (remove it or choose another path)"
    assert victim.read_text() == "precious" and catalog.list_iterations(str(save)) == []


def test_rank0_killed_during_an_async_save_ends_rank1_in_one_line(run4, tmp_path):
    """kill -9 of rank 0 while its background save writes: rank 1 (with its data-loader workers) ends in one line
    (before: a multiprocessing resource_sharer ConnectionResetError traceback), and iteration 2 still loads."""
    script = wrapped(tmp_path, 0, "os.kill(os.getpid(), signal.SIGKILL)")
    save = tmp_path / "ckpt"
    proc = torchrun(2, TINY + FLAGS + ["--pipeline-model-parallel-size", "2", "--num-workers", "2", "--train-iters",
                                       "4", "--save", str(save), "--save-interval", "2", "--async-save"], script=script)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert f'File "{os.path.join(ROOT, "llamapipe")}' not in out and "resource_sharer" not in out, out[-4000:]
    rank1 = [line for line in out.splitlines() if re.match(r"(pretrain_llama\.py: (error: )?)?rank 1: ", line)]
    assert len(rank1) == 1, out[-4000:]
    assert catalog.list_iterations(str(save)) == [2] and catalog.read_tracker(str(save)) == 2
    assert [i for i, defect in scan(str(save)) if defect is None] == [2]


def test_a_resumed_run_marks_in_the_metrics_where_it_took_over(run4, tmp_path):
    """Issue 40: after a resume, the JSONL held iterations 1-4 then 3, 4 again with nothing telling the two runs
    apart. Every record now names its run, and the resumed run's first record says where it took over."""
    ckpt = copy_of(run4[0], tmp_path)
    shutil.rmtree(ckpt / "iter_0000004")
    jsonl = tmp_path / "m.jsonl"
    shutil.copy(run4[0].parent / "full.jsonl", jsonl)
    proc = single(["--train-iters", "4", "--load", str(ckpt), "--metrics-jsonl", str(jsonl)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in open(jsonl)]
    first, second = records[:4], records[4:]
    assert [r["iteration"] for r in first] == [1, 2, 3, 4] and [r["iteration"] for r in second] == [3, 4]
    assert len({r["run_id"] for r in first}) == 1 and len({r["run_id"] for r in second}) == 1
    assert first[0]["run_id"] != second[0]["run_id"]
    assert [r.get("resumed_from_iteration") for r in first + second] == [None] * 4 + [2, None]
    assert [r["lm_loss"] for r in second] == [r["lm_loss"] for r in first[2:]]
