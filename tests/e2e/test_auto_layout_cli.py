"""--pipeline-model-parallel-layout auto through the CLI: a pp 2 run with a vocabulary worth several decoder
layers picks an uneven split (one chunk per rank under 1F1B, the V's two under ZB-V), says which and why in its
start-up log, and trains the same losses as the run given the layout string it printed (bit for bit: both run
the same split)."""
import re

import pytest

from tests.cli import TINY, read_metrics, torchrun

FLAGS = ["--vocab-size", "1024", "--train-iters", "3", "--micro-batch-size", "1", "--global-batch-size", "4",
         "--pipeline-model-parallel-size", "2"]
NOTICE = re.compile(r"--pipeline-model-parallel-layout auto chose '([^']+)' \(layers per virtual stage ([\d/]+)\) "
                    r"from the analytic FLOP model")


def run(tmp_path, name: str, flags: list[str]):
    jsonl = str(tmp_path / f"{name}.jsonl")
    proc = torchrun(2, TINY + FLAGS + flags + ["--metrics-jsonl", jsonl])
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    return log, [r["lm_loss"] for r in read_metrics(jsonl)]


@pytest.mark.parametrize("schedule,lighter", [("1f1b", [1]), ("zbv", [0, 3])], ids=["1f1b", "zbv"])
def test_auto_layout_trains_like_the_layout_string_it_chose(tmp_path, schedule, lighter):
    """`lighter`: the stages on the rank with the output layer, which must hold fewer layers than the even split."""
    log, auto_losses = run(tmp_path, "auto", ["--pipeline-schedule", schedule,
                                              "--pipeline-model-parallel-layout", "auto"])
    chosen = NOTICE.search(log)
    assert chosen, log[-3000:]
    layout, counts = chosen[1], [int(n) for n in chosen[2].split("/")]
    assert sum(counts[s] for s in lighter) < 8 * len(lighter) / len(counts), layout
    assert f"layers per pipeline stage: {', '.join(map(str, counts))}\n" in log, log[-3000:]
    explicit_log, explicit_losses = run(tmp_path, "explicit", ["--pipeline-schedule", schedule,
                                                               "--pipeline-model-parallel-layout", layout])
    assert "auto chose" not in explicit_log
    assert len(auto_losses) == 3 and auto_losses == explicit_losses


def test_auto_schedule_turns_vocabulary_parallelism_on_and_trains_like_the_flag(tmp_path):
    """issue 42: at vocabulary 8192 (the output layer outweighs every layer split of the tiny model) the auto
    schedule with layout auto chooses vocabulary parallelism with the even split, says so, and trains the losses
    of the run that asks for both by flag."""
    flags = ["--vocab-size", "8192", "--pipeline-schedule", "auto"]
    log, auto_losses = run(tmp_path, "auto", flags + ["--pipeline-model-parallel-layout", "auto"])
    assert "vocabulary parallelism, chosen with --pipeline-schedule auto" in log, log[-3000:]
    chosen = NOTICE.search(log)
    assert chosen and chosen[2] == "4/4", log[-3000:]
    explicit_log, explicit_losses = run(tmp_path, "explicit", flags + [
        "--pipeline-model-parallel-layout", chosen[1], "--enable-vocab-parallel"])
    assert "auto chose" not in explicit_log
    assert len(auto_losses) == 3 and auto_losses == explicit_losses
