"""--enable-optimizer-post-validation through the CLI: per-iteration losses, grad norms and the final parameters
and optimizer state are bit-identical to the same run without the flag (fp32, CPU), when clipping never
triggers, when it triggers on every step, when it triggers on some steps only for the global norm (the
rollback path), with an injected non-finite loss, and across a resume from a checkpoint saved under the flag;
and the speculation policy: a run that clips on every step replays nothing under every schedule and split, and
a run whose clipping starts mid-way replays exactly the steps the policy let speculate and that clipped."""
import glob
import os
import re

import pytest
import torch
from safetensors.torch import load_file

from llamapipe.core.optimizer import post_validation as pv
from tests.cli import TINY, read_metrics, torchrun

PV = ["--enable-optimizer-post-validation"]
BATCH = ["--micro-batch-size", "1", "--lr-decay-style", "cosine", "--train-iters", "10"]
ZBV = ["--pipeline-schedule", "zbv", "--num-virtual-stages-per-pipeline-rank", "2"]


def _run(nproc: int, flags: list[str], tmp, name: str, *, script: str = "pretrain_llama.py",
         prefix: tuple = (), ok: bool = True, env: dict | None = None) -> tuple[list[dict], str, str]:
    jsonl, save = str(tmp / f"{name}.jsonl"), str(tmp / name)
    args = list(prefix) + TINY + flags + ["--metrics-jsonl", jsonl]
    if "--save" not in flags:
        args += ["--save", save]
    proc = torchrun(nproc, args, script=script, env=env)
    out = proc.stdout + proc.stderr
    if ok:
        assert proc.returncode == 0, out[-4000:]
    rows = read_metrics(jsonl) if os.path.exists(jsonl) else []
    return rows, out, save


def _records(rows: list[dict]) -> list[tuple]:
    return [(r["iteration"], r["lm_loss"], r["grad_norm"], r["lr"]) for r in rows]


def _final_state(save: str) -> dict[str, torch.Tensor]:
    """Every tensor of the newest checkpoint's model and optimizer shards, keyed by file and name."""
    state = {}
    for path in sorted(glob.glob(os.path.join(save, "iter_*", "*.safetensors")))[-8:]:
        for key, value in load_file(path).items():
            state[f"{os.path.basename(path)}:{key}"] = value
    assert state, f"no checkpoint under {save}"
    return state


def _assert_identical(tmp, nproc: int, flags: list[str], *, script: str = "pretrain_llama.py",
                      sync_rows: list | None = None, env: dict | None = None) -> str:
    """The post-validated run's records and final state equal the synchronous run's; its log. `sync_rows`: a list
    that receives the synchronous run's records; `env`: the post-validated run's extra environment."""
    sync, _, sync_save = _run(nproc, flags, tmp, "sync")
    pv_rows, out, pv_save = _run(nproc, flags + PV, tmp, "pv", script=script, env=env)
    assert len(sync) == 10 and _records(pv_rows) == _records(sync)
    sync_state, pv_state = _final_state(sync_save), _final_state(pv_save)
    assert sync_state.keys() == pv_state.keys()
    different = [k for k in sync_state if not torch.equal(sync_state[k], pv_state[k])]
    assert not different, f"parameters or optimizer state differ: {different[:5]}"
    if sync_rows is not None:
        sync_rows.extend(sync)
    return out


def _rolled_back(out: str) -> tuple[int, int]:
    found = re.findall(r"post-validation: (\d+) speculative updates? rolled back, (\d+) iterations? run again", out)
    assert found, out[-3000:]
    return int(found[-1][0]), int(found[-1][1])


def test_pp2_zbv_clipping_for_the_global_norm_only_rolls_back_and_stays_identical(tmp_path):
    # grad norms of this run are 1.55 .. 2.5, each stage's part about 1/sqrt(2) of it: with --clip-grad 1.7 the
    # global norm clips on some steps where no stage's own part does, so a rank that speculated there rolls
    # back (which rank speculates depends on which finishes first: the forced test below pins the counts)
    out = _assert_identical(tmp_path, 2, BATCH + ZBV + ["--global-batch-size", "4",
                                                         "--pipeline-model-parallel-size", "2", "--clip-grad", "1.7"])
    rollbacks, replays = _rolled_back(out)
    assert replays >= rollbacks


def test_pp4_zb_h2_clipping_never_triggers(tmp_path):
    out = _assert_identical(tmp_path, 4, BATCH + ["--global-batch-size", "8", "--pipeline-model-parallel-size", "4",
                                                  "--pipeline-schedule", "zb-h2", "--clip-grad", "100"])
    assert _rolled_back(out) == (0, 0)


def test_pp4_zbv_two_chunks_per_rank(tmp_path):
    _assert_identical(tmp_path, 4, BATCH + ZBV + ["--global-batch-size", "8", "--pipeline-model-parallel-size", "4",
                                                  "--clip-grad", "1.3"])


def test_tp2_pp2_zbv_clipping_on_every_step(tmp_path):
    # every stage's own norm is above 1e-3, so no rank speculates: each step is the synchronous one
    out = _assert_identical(tmp_path, 4, BATCH + ZBV + ["--global-batch-size", "4", "--tensor-model-parallel-size", "2",
                                                         "--sequence-parallel", "--pipeline-model-parallel-size", "2",
                                                         "--clip-grad", "1e-3"])
    assert _rolled_back(out) == (0, 0)


def test_dp2_pp2_auto_zero1_overlapped_grad_reduce(tmp_path):
    _assert_identical(tmp_path, 4, BATCH + ["--global-batch-size", "8", "--pipeline-model-parallel-size", "2",
                                            "--pipeline-schedule", "auto", "--use-distributed-optimizer",
                                            "--overlap-grad-reduce", "--clip-grad", "1.5"])


def test_forced_speculation_rolls_back_every_clipped_step_and_stays_identical(tmp_path):
    out = _assert_identical(tmp_path, 2, BATCH + ["--global-batch-size", "4", "--pipeline-model-parallel-size", "2",
                                                  "--pipeline-schedule", "zb-h2", "--clip-grad", "1e-3"],
                            script="tests/scripts/speculate_always.py")
    assert _rolled_back(out) == (10, 9)     # the last step drains (nothing ran after it)


def test_dp2_pp2_speculation_on_one_data_parallel_replica_replays_both(tmp_path):
    """Ranks 0 and 2 (data-parallel rank 0 of each stage) speculate on every step, ranks 1 and 3 never (every step
    clips): the replica that rolled back and the one that did not both run the next iteration again, since a
    re-run forward-backward reduces over both (without that the replicas' collectives part ways and the run hangs)."""
    out = _assert_identical(tmp_path, 4, BATCH + ["--global-batch-size", "8", "--pipeline-model-parallel-size", "2",
                                                  "--pipeline-schedule", "1f1b", "--clip-grad", "1e-3"],
                            script="tests/scripts/speculate_always.py", env={"SPECULATING_RANKS": "0,2"})
    assert _rolled_back(out) == (10, 9)


@pytest.mark.parametrize("skip", [False, True])
def test_injected_nonfinite_loss_is_rolled_back_like_the_synchronous_step(tmp_path, skip):
    flags = BATCH + ZBV + ["--global-batch-size", "4", "--pipeline-model-parallel-size", "2", "--clip-grad", "100"]
    flags += ["--skip-nonfinite-steps"] if skip else []
    prefix = ("--inject-inf-iteration", "2", "--")
    sync, sync_out, _ = _run(2, flags, tmp_path, "sync", script="tests/scripts/inject_inf.py", prefix=prefix, ok=skip)
    pv, pv_out, _ = _run(2, flags + PV, tmp_path, "pv", script="tests/scripts/speculate_always.py", prefix=prefix,
                         ok=skip)
    assert _records(pv) == _records(sync)
    if skip:
        assert [r["iteration"] for r in pv] == [1] + list(range(3, 11))
        assert "skipped iteration 2" in pv_out
    else:
        assert [r["iteration"] for r in pv] == [1]
        assert "iteration 2: lm loss is inf" in pv_out and "iteration 2: lm loss is inf" in sync_out


def test_resume_from_a_checkpoint_saved_under_the_flag(tmp_path):
    flags = BATCH[:-2] + ZBV + ["--global-batch-size", "4", "--pipeline-model-parallel-size", "2",
                                "--clip-grad", "1.7", "--lr-decay-iters", "10"]
    full, _, _ = _run(2, flags + ["--train-iters", "10"], tmp_path, "full")
    save = str(tmp_path / "resumed")
    first, _, _ = _run(2, flags + PV + ["--train-iters", "6", "--save", save], tmp_path, "first")
    second, out, _ = _run(2, flags + PV + ["--train-iters", "10", "--save", save, "--load", save], tmp_path, "second")
    assert "resumed from" in out
    assert _records(first + second) == _records(full)


FP16 = ["--fp16", "--initial-loss-scale", "512"]     # 2**32 overflows every step of this tiny run


@pytest.mark.parametrize("precision", [FP16, ["--bf16"]], ids=["fp16", "bf16"])
def test_half_precision_with_forced_rollbacks_stays_identical(tmp_path, precision):
    """fp16 (dynamic loss scaling: the scaler's state is part of the snapshot) and bf16 with fp32 masters:
    every step clips, every speculating rank rolls back, and records and final state equal the synchronous run."""
    flags = BATCH + precision + ["--global-batch-size", "4", "--pipeline-schedule", "zb-h2",
                                 "--pipeline-model-parallel-size", "2", "--clip-grad", "1e-3"]
    out = _assert_identical(tmp_path, 2, flags, script="tests/scripts/speculate_always.py")
    assert _rolled_back(out) == (10, 9)


def test_fp16_injected_inf_is_skipped_like_the_synchronous_step(tmp_path):
    """An infinite loss under fp16 is an overflow: both forms skip iteration 2 with the same reason and record
    (the loss scale stays 512: --hysteresis 2 shrinks it at the second overflow)."""
    flags = BATCH + ZBV + FP16 + ["--global-batch-size", "4", "--pipeline-model-parallel-size", "2",
                                  "--clip-grad", "100"]
    prefix = ("--inject-inf-iteration", "2", "--")
    sync, sync_out, _ = _run(2, flags, tmp_path, "sync", script="tests/scripts/inject_inf.py", prefix=prefix)
    pv, pv_out, _ = _run(2, flags + PV, tmp_path, "pv", script="tests/scripts/speculate_always.py", prefix=prefix)
    assert _records(pv) == _records(sync) and [r["iteration"] for r in pv] == [1] + list(range(3, 11))
    reasons = [re.findall(r"skipped iteration 2: [^\n]*", out) for out in (sync_out, pv_out)]
    assert reasons[0] == ["skipped iteration 2: inf/nan in gradients (loss scale now 512)"]
    assert reasons[1] == reasons[0]


EAGER = "tests/scripts/speculate_eagerly.py"
SCHEDULES = {"1f1b": ["--pipeline-schedule", "1f1b"], "auto": ["--pipeline-schedule", "auto"],
             "zb-h2": ["--pipeline-schedule", "zb-h2"], "zbv": ZBV}
# a vocabulary worth several decoder layers: --pipeline-model-parallel-layout auto picks an uneven split, the one
# whose light stage's own norm stays under --clip-grad while the global norm clips
LAYOUTS = {"even": [], "layout-auto": ["--pipeline-model-parallel-layout", "auto", "--vocab-size", "1024"]}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_clipping_on_every_step_pauses_speculation_and_replays_nothing(tmp_path, schedule, layout):
    """Every rank speculates wherever the policy allows (without it: every step rolled back, 9 iterations run
    again); the run starts paused and every step clips, so nothing speculates."""
    flags = SCHEDULES[schedule] if layout == "even" else ["--pipeline-schedule", schedule]
    out = _assert_identical(tmp_path, 2, BATCH + flags + LAYOUTS[layout] + [
        "--global-batch-size", "4", "--pipeline-model-parallel-size", "2", "--clip-grad", "0.01"], script=EAGER)
    assert _rolled_back(out) == (0, 0)
    assert "speculation paused on 10 of 10 iterations (1 at the start, 9 after clipping)" in out


def _policy_replays(norms: list[float], clip: float) -> tuple[int, int]:
    """(steps rolled back, iterations run again) of a run where every rank speculates whenever the policy allows,
    from the synchronous run's grad norms (the last step drains: rolled back but not run again)."""
    policy, wrong = pv.SpeculationPolicy(), []
    for norm in norms:
        speculated = policy.begin_step()
        wrong.append(speculated and norm > clip)
        policy.record("clip" if norm > clip else "apply", speculated)
    return sum(wrong), sum(wrong[:-1])


def test_clipping_that_starts_mid_run_replays_once_then_pauses(tmp_path):
    """Grad norms of this run: 1.58 .. 1.86 on the first five steps, then mostly above 1.9: the policy resumes
    speculation after four steps that applied, and the first clipped step it speculated on is the one replay."""
    sync_rows: list = []
    out = _assert_identical(tmp_path, 2, BATCH + ["--global-batch-size", "4", "--pipeline-model-parallel-size", "2",
                                                  "--pipeline-schedule", "1f1b", "--clip-grad", "1.9"],
                            script=EAGER, sync_rows=sync_rows)
    expected = _policy_replays([r["grad_norm"] for r in sync_rows], 1.9)
    assert expected == (1, 1) and _rolled_back(out) == expected
