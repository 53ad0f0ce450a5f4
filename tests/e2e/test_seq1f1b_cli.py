"""Seq1F1B through the CLI (--num-seq-splits): pp 2 with every microbatch in K sequence pieces trains with the
single process's losses (fp32, rel 1e-5), also with packed documents (--reset-attention-mask) and evaluation; so do
dp 2 with ZeRO-1 (--use-distributed-optimizer) and ZeRO-3 (FSDP2), and cp 2 (a2a, and the ring: Megatron's
default --cp-comm-type) with packed documents."""
import pytest

from tests.cli import train

ITERS = ["--train-iters", "4", "--micro-batch-size", "1", "--global-batch-size", "4"]
PP2 = ["--pipeline-model-parallel-size", "2"]
PACKED = ["--reset-attention-mask", "--reset-position-ids", "--tokenizer-type", "NullTokenizer"]
CASES = {
    "1f1b-k2": (PP2 + ["--num-seq-splits", "2"], []),
    "zbh1-k4-length": (PP2 + ["--pipeline-schedule", "zb-h1", "--num-seq-splits", "4",
                              "--seq1f1b-balance-method", "length"], []),
    "zbv-k4-eval": (PP2 + ["--num-virtual-stages-per-pipeline-rank", "2", "--pipeline-schedule", "zbv",
                           "--num-seq-splits", "4"], ["--eval-iters", "1", "--eval-interval", "2"]),
    "zbh1-k2-post-validation": (PP2 + ["--pipeline-schedule", "zb-h1", "--num-seq-splits", "2",
                                       "--enable-optimizer-post-validation"], []),
    "1f1b-k2-packed": (PP2 + ["--num-seq-splits", "2"], PACKED),
    "zero1-dp2-k2": (["--use-distributed-optimizer", "--num-seq-splits", "2"], []),
    "zero3-dp2-k2": (["--data-parallel-sharding-strategy", "optim_grads_params", "--num-seq-splits", "2"], []),
    "cp2-a2a-k2-packed": (["--context-parallel-size", "2", "--cp-comm-type", "a2a", "--num-seq-splits", "2"], PACKED),
    "cp2-p2p-k2-packed": (["--context-parallel-size", "2", "--num-seq-splits", "2"], PACKED),   # Megatron's default ring
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The single process's records for the given flags, run once per flags in this module (shared by cases)."""
    runs: dict = {}

    def run(common: list) -> list[dict]:
        if tuple(common) not in runs:
            runs[tuple(common)] = train(1, ITERS + common, str(tmp_path_factory.mktemp("ref") / "ref.jsonl"))
        return runs[tuple(common)]
    return run


def _losses(records: list[dict], key: str) -> list[float]:
    return [r[key] for r in records if key in r]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_seq1f1b_matches_single_process(name, tmp_path, reference):
    flags, common = CASES[name]
    ref = reference(common)
    got = train(2, ITERS + common + flags, str(tmp_path / "seq.jsonl"))
    for key in ("lm_loss", "valid_lm_loss"):
        want, have = _losses(ref, key), _losses(got, key)
        assert len(want) == len(have) and (want or key != "lm_loss")
        assert have == pytest.approx(want, rel=1e-5), key


@pytest.mark.slow
def test_seq1f1b_resume_is_bit_exact(tmp_path):
    """A run resumed from its iteration-2 checkpoint continues with the uninterrupted run's losses."""
    import shutil
    from tests.cli import TINY, read_metrics, torchrun
    flags = ITERS + PP2 + ["--pipeline-schedule", "zb-h1", "--num-seq-splits", "2"]
    save = tmp_path / "run"
    full = train(2, flags + ["--save", str(save), "--save-interval", "2"], str(tmp_path / "full.jsonl"))
    resume_dir = tmp_path / "resume"      # only the iteration-2 checkpoint, as if the job died after it
    resume_dir.mkdir()
    shutil.copytree(save / "iter_0000002", resume_dir / "iter_0000002")
    (resume_dir / "latest_checkpointed_iteration.txt").write_text("2\n")
    jsonl = str(tmp_path / "resumed.jsonl")
    proc = torchrun(2, TINY + flags + ["--load", str(resume_dir), "--metrics-jsonl", jsonl])
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    resumed = read_metrics(jsonl)
    assert [r["iteration"] for r in resumed] == [3, 4]
    for got, want in zip(resumed, full[2:]):
        assert (got["lm_loss"], got["grad_norm"]) == (want["lm_loss"], want["grad_norm"]), got["iteration"]
