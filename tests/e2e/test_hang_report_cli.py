"""--hang-report-seconds through the CLI (issue 46 item 1): a rank stopped by the test hook LLAMAPIPE_TEST_STALL in
iteration 2 of 1F1B, interleaved, ZB-V, DualPipeV, a schedule file, the vocabulary-parallel output layer, CP's ring,
all-gather and all-to-all, the DP gradient reduction and the optimizer step is named, with its action, by one
report; the report comes within --hang-report-seconds + 10 s of the stop, the run exits 1 and the checkpoint of
iteration 1 is intact and loadable. Two ranks, a tiny model, --hang-report-seconds 2."""
from __future__ import annotations

import json
import os
import re

import pytest

from llamapipe.tools.plot_schedule import main as plot_schedule
from llamapipe.training.checkpointing.catalog import incomplete_reason, iter_dir, read_tracker
from tests.cli import ROOT, TINY, torchrun

SECONDS = 2
BASE = ["--num-layers", "4", "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "4",
        "--save-interval", "1", "--hang-report-seconds", str(SECONDS)]
PP2 = ["--pipeline-model-parallel-size", "2"]

# case: (flags, LLAMAPIPE_TEST_STALL, the stopped rank, what the report says it stopped in, who waits on it)
CASES = {
    "1f1b": (PP2 + ["--pipeline-schedule", "1f1b"], "rank=1,iteration=2,action=F,microbatch=1", 1,
             "stopped in F mb 1 chunk 0", "rank 0 (pp 0) waits in BW mb"),
    "interleaved": (PP2 + ["--num-layers-per-virtual-pipeline-stage", "1"], "rank=1,iteration=2,action=F,microbatch=2",
                    1, "stopped in F mb 2 chunk 0", "rank 0 (pp 0) waits in"),
    "zbv": (PP2 + ["--pipeline-schedule", "zbv"], "rank=0,iteration=2,action=B,microbatch=1", 0,
            "stopped in B mb 1 chunk 1", "rank 1 (pp 1) waits in B mb 1 chunk 1 for rank 0's gradient"),
    "dualpipev": (PP2 + ["--pipeline-schedule", "dualpipev"], "rank=1,iteration=2,action=F,microbatch=2", 1,
                  "stopped in F mb 2 chunk", "rank 0 (pp 0) waits in"),
    "schedule-file": (PP2 + ["--pipeline-schedule-file", "{csv}"], "rank=1,iteration=2,action=B,microbatch=0", 1,
                      "stopped in B mb 0 chunk", "rank 0 (pp 0) waits in"),
    "cp-ring": (["--context-parallel-size", "2"], "rank=1,iteration=2,action=F,microbatch=1", 1,
                "stopped in F mb 1 chunk 0", "rank 0 (cp 0) waits in F mb 1 chunk 0 for rank 1's keys/values in the "
                                             "context-parallel ring"),
    "vocab-parallel": (PP2 + ["--enable-vocab-parallel"], "rank=1,iteration=2,action=S,microbatch=1", 1,
                       "stopped in S mb 1 chunk 0", "rank 0 (pp 0) waits in the vocabulary-parallel output layer's "
                                                    "all-gather of mb 1 for rank 1, which did not join it"),
    "cp-allgather": (["--context-parallel-size", "2", "--cp-comm-type", "allgather"],
                     "rank=1,iteration=2,action=F,microbatch=1", 1, "stopped in F mb 1 chunk 0",
                     "rank 0 (cp 0) waits in the context-parallel all-gather of keys/values for rank 1, which did "
                     "not join it"),
    "cp-a2a": (["--context-parallel-size", "2", "--cp-comm-type", "a2a"], "rank=1,iteration=2,action=F,microbatch=1",
               1, "stopped in F mb 1 chunk 0", "rank 0 (cp 0) waits in the context-parallel all-to-all for rank 1, "
                                              "which did not join it"),
    "optimizer": (["--use-distributed-optimizer"], "rank=1,iteration=2,action=optimizer", 1,
                  "stopped before the optimizer step", "rank 0 (dp 0) waits in the optimizer step for rank 1, which "
                                                       "did not join it"),
    "dp-reduction": ([], "rank=1,iteration=2,action=grad-reduce", 1, "stopped before the gradient reduction",
                     "rank 0 (dp 0) waits in the gradient reduction for rank 1, which did not join it"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_a_stopped_rank_is_named_by_one_report_and_the_run_exits_with_its_checkpoint(tmp_path, case):
    flags, stall, stopped, where, waiter = CASES[case]
    if "{csv}" in flags:
        csv = str(tmp_path / "v_half.csv")
        assert plot_schedule(["--schedule", "v-half", "--pp", "2", "--microbatches", "4", "--json",
                              "--export-csv", csv]) == 0
        flags = [f.format(csv=csv) for f in flags]
    save = str(tmp_path / "ck")
    os.mkdir(save)
    proc = torchrun(2, TINY + BASE + flags + ["--save", save], env={"LLAMAPIPE_TEST_STALL": stall}, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, f"exit {proc.returncode}\n{out[-4000:]}"
    reports = [line for line in out.splitlines() if "hang report: hang at iteration" in line]
    assert len(reports) == 1, out[-4000:]
    assert f"hang at iteration 2: rank {stopped} " in reports[0] and where in reports[0], reports[0]
    assert waiter in reports[0], reports[0]
    assert f"hang: rank {1 - stopped} " in out and f"hang: rank {stopped} " in out    # every rank's position
    assert "Traceback" not in proc.stdout     # ours (torchrun's own summary of the failed rank is on stderr)
    ours = [f for f in re.findall(r'File "([^"]+)"', proc.stderr) if f.startswith(ROOT) and "site-packages" not in f]
    assert not ours, proc.stderr[-4000:]     # torchrun's traceback on stderr has no frame of ours
    with open(os.path.join(save, "hang_report.json")) as f:
        record = json.load(f)
    assert record["report"]["stopped"] == stopped and len(record["positions"]) == 2
    stop = next(p for p in record["positions"] if p["rank"] == stopped)
    assert record["written_at"] - stop["progress_at"] <= SECONDS + 10, record
    assert read_tracker(save) == 1 and incomplete_reason(iter_dir(save, 1)) is None
    assert not os.path.exists(os.path.join(save, "llamapipe.lock"))
