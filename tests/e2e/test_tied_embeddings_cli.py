"""--tie-embeddings-and-output-weights across the pipeline through the CLI (fp32, CPU): under every schedule at pp 2
(and pp 4 for 1F1B and ZB-V), with tp 2 + sequence parallelism, cp 2, dp 2 under ZeRO-1/2/3 and
--overlap-grad-reduce, post-validation and vocabulary parallelism, the per-iteration losses over 6 iterations equal
the single-process tied run's (rel 1e-5), and the save at the end finds the first stage's embedding equal to the
last stage's output weight bit for bit (the save compares them, `checkpointing/tie_check.py`, and stops when they
differ; under vocabulary parallelism each rank's two shards are one parameter, two copies only under ZeRO-3).
A run saved at iteration 3 resumes bit for bit in its layout and, in two others (ZB-V with ZeRO-1: both copies on
one rank; vocabulary parallelism under ZeRO-3), reproduces the single-process losses, the copies again equal at the
save. Without the gradient sum (tried by hand, ZB-V) the losses leave the single-process ones by about 1e-3
relative from iteration 3 on."""
import math
import shutil

import pytest

from llamapipe.tools.plot_schedule import main as plot_schedule
from tests.cli import TINY, read_metrics, torchrun, train

ITERS = ["--train-iters", "6", "--micro-batch-size", "1", "--global-batch-size", "8",
         "--tie-embeddings-and-output-weights"]
PP2, PP4 = ["--pipeline-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "4"]
V2 = ["--num-virtual-stages-per-pipeline-rank", "2"]
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
PROFILED = ["--pipeline-profile-iters", "1"]
POSTVAL = ["--enable-optimizer-post-validation"]
EQUAL = "the tied embedding's copies on the first and the last pipeline stage are equal bit for bit"


def schedule(name: str, *more: str) -> list[str]:
    return ["--pipeline-schedule", name, *more]


CASES = {
    "pp2-1f1b-cp2": (4, PP2 + schedule("1f1b") + ["--context-parallel-size", "2"]),
    "pp4-1f1b": (4, PP4 + schedule("1f1b")),
    "pp2-interleaved-tp2-sp": (4, PP2 + schedule("interleaved", *V2) + TP2_SP),
    "pp2-zb-h1-dp2-zero2": (4, PP2 + schedule("zb-h1") + ["--data-parallel-sharding-strategy", "optim_grads"]),
    "pp2-zb-h2": (2, PP2 + schedule("zb-h2", *PROFILED)),
    "pp2-zbv-dp2-zero3": (4, PP2 + schedule("zbv", *V2) + ["--use-torch-fsdp2"]),
    "pp4-zbv": (4, PP4 + schedule("zbv", *V2)),
    "pp2-v-half-dp2-zero1-postval": (4, PP2 + schedule("v-half", *V2) + ["--use-distributed-optimizer"] + POSTVAL),
    "pp2-v-min-dp2-overlap": (4, PP2 + schedule("v-min", *V2) + ["--overlap-grad-reduce", "--ddp-bucket-size", "1000"]),
    "pp2-dualpipev-tp2-sp": (4, PP2 + schedule("dualpipev", *V2) + TP2_SP),
    "pp2-auto-postval": (2, PP2 + schedule("auto", *V2, *PROFILED) + POSTVAL),
    "pp2-file": (2, PP2),     # a 1F1B plan written by plot-schedule, --pipeline-schedule-file
    # vocabulary parallelism: one parameter per rank for both shards (two copies kept equal under ZeRO-3)
    "pp2-vocab-1f1b-dp2-overlap": (4, PP2 + schedule("1f1b") + ["--enable-vocab-parallel", "--overlap-grad-reduce"]),
    "pp2-vocab-zbv-dp2-zero3": (4, PP2 + schedule("zbv", *V2) + ["--enable-vocab-parallel", "--use-torch-fsdp2"]),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return train(1, ITERS, str(tmp_path_factory.mktemp("ref") / "m.jsonl"))


def run(nproc: int, flags: list[str], tmp, name: str = "m") -> tuple[list[dict], str]:
    """Train with a save at the end; (records, the ranks' output)."""
    jsonl = str(tmp / f"{name}.jsonl")
    proc = torchrun(nproc, TINY + ITERS + flags + ["--save", str(tmp / f"{name}-ckpt"), "--metrics-jsonl", jsonl])
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return read_metrics(jsonl), proc.stdout + proc.stderr


def assert_same(records: list[dict], reference: list[dict], what: str) -> None:
    want = {r["iteration"]: r["lm_loss"] for r in reference}
    assert records and all(r["iteration"] in want for r in records), what
    for r in records:
        assert math.isclose(r["lm_loss"], want[r["iteration"]], rel_tol=1e-5), \
            f"{what}, iteration {r['iteration']}: loss {r['lm_loss']}, one process {want[r['iteration']]}"


@pytest.mark.parametrize("name", list(CASES))
def test_tied_embeddings_train_like_one_process(reference, tmp_path, name):
    nproc, flags = CASES[name]
    if name == "pp2-file":
        path = str(tmp_path / "1f1b.csv")
        assert plot_schedule(["--schedule", "1f1b", "--pp", "2", "--microbatches", "8", "--json", "--export-csv",
                              path]) == 0
        flags = flags + ["--pipeline-schedule-file", path]
    records, output = run(nproc, flags, tmp_path)
    assert [r["iteration"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert_same(records, reference, name)
    one_parameter = "--enable-vocab-parallel" in flags and "--use-torch-fsdp2" not in flags
    assert (f"iteration 6: {EQUAL}" in output) is not one_parameter, f"{name}: the save's comparison of the copies"


def test_resume_in_the_same_and_in_another_layout(reference, tmp_path):
    """pp 2 1F1B saved at 3 and 6: from the iteration-3 checkpoint alone, the same layout repeats iterations 4-6
    bit for bit; ZB-V at pp 2 x dp 2 with ZeRO-1 (both copies on one rank, the copy's optimizer state loaded
    from the embedding's) and vocabulary parallelism at pp 2 x dp 2 under ZeRO-3 (each rank's two shard copies
    loaded from the embedding's rows) give the single-process losses. Every save finds the copies equal."""
    full, output = run(2, PP2 + schedule("1f1b") + ["--save-interval", "3"], tmp_path, "full")
    assert f"iteration 3: {EQUAL}" in output and f"iteration 6: {EQUAL}" in output
    only3 = tmp_path / "only3"
    only3.mkdir()
    shutil.copytree(tmp_path / "full-ckpt" / "iter_0000003", only3 / "iter_0000003")
    (only3 / "latest_checkpointed_iteration.txt").write_text("3\n")
    for name, nproc, flags in (("same", 2, PP2 + schedule("1f1b")),
                               ("zbv-dp2-zero1", 4, PP2 + schedule("zbv", *V2) + ["--use-distributed-optimizer"]),
                               ("vocab-1f1b-dp2-zero3", 4, PP2 + schedule("1f1b") + ["--enable-vocab-parallel",
                                                                                     "--use-torch-fsdp2"])):
        records, output = run(nproc, flags + ["--load", str(only3)], tmp_path, name)
        assert [r["iteration"] for r in records] == [4, 5, 6], name
        assert f"iteration 6: {EQUAL}" in output, name
        assert_same(records, reference, f"resumed into {name}")
        if name == "same":
            for got, want in zip(records, full[3:]):
                assert (got["lm_loss"], got["grad_norm"]) == (want["lm_loss"], want["grad_norm"]), got["iteration"]
