"""The zero-bubble fork's examples/pretrain_zero_bubble.sh and pretrain_offload.sh (examples/zero_bubble/), scaled
down through their own environment switches, on CPU at pp 2: the V, V-Half, V-Min, ZB-2p, 1F1B-V, Seq1F1B and
offload-grouped-interleaved settings (as the fork's examples/test_all_schedules.sh sets them) each train the schedule
their flags name, which the 'run:' block says.
"""
import math
import os
import subprocess
import sys

import pytest

from llamapipe.tools import make_sample_corpus, preprocess_data, train_tokenizer
from tests.cli import ROOT, free_port, read_metrics

pytestmark = pytest.mark.slow

SCRIPT = os.path.join(ROOT, "examples", "zero_bubble", "pretrain_zero_bubble.sh")
OFFLOAD_SCRIPT = os.path.join(ROOT, "examples", "zero_bubble", "pretrain_offload.sh")

# test_all_schedules.sh's sizes, scaled: pipeline 2, layers 2p-2 -> 4 (two per rank, one per V chunk), hidden
# 4096 -> 64, 32 heads -> 4 (GQA 8 -> 2), seq 2048 -> 32, global batch 2p (4 microbatches), 3 iterations
SMALL = {"WORLD_SIZE": "1", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "GPUS_PER_NODE": "2", "PIPELINE_SIZE": "2",
         "TP_SIZE": "1", "LAYERS": "4", "MICRO_BATCH_SIZE": "1", "GLOBAL_BATCH_SIZE": "4", "HIDDEN_SIZE": "64",
         "ATTENTION_HEADS": "4", "GQA": "2", "SEQ_LENGTH": "32", "MAX_POSITION_EMBEDDINGS": "64", "EVAL_ITERS": "1",
         "TRAIN_SAMPLES": "64", "EXIT_INTERVAL": "3", "LOG_INTERVAL": "1", "ZERO_BUBBLE_TIMER_START": "1",
         "ZERO_BUBBLE_TIMER_END": "2", "OMP_NUM_THREADS": "1"}

# test_all_schedules.sh's methods; FP32 where the fork would run fp16 (CPU), ZB-2p also in fp16 with
# post-validation (a small first loss scale so that 3 iterations are not all skipped)
SETTINGS = {
    "zbv": ({"ZERO_BUBBLE_V_SCHEDULE": "1", "ZERO_BUBBLE_MEM_LIMIT": "4", "FP32": "1"}, "", "zbv"),
    "zbv-half": ({"ZERO_BUBBLE_V_SCHEDULE": "1", "ZERO_BUBBLE_MEM_LIMIT": "4", "SYNC_OPTIMIZER": "1", "FP32": "1"},
                 "--zero-bubble-v-schedule-mem-setup half", "v-half"),
    "zbv-min": ({"ZERO_BUBBLE_V_SCHEDULE": "1", "ZERO_BUBBLE_MEM_LIMIT": "4", "SYNC_OPTIMIZER": "1", "FP32": "1"},
                "--zero-bubble-v-schedule-mem-setup min", "v-min"),
    "zb-2p": ({"ENABLE_ZERO_BUBBLE": "1", "ZERO_BUBBLE_MEM_LIMIT": "4"}, "--initial-loss-scale 64", "auto"),
    "1f1bv": ({"FP32": "1"}, "--enable-1f1b-v", "1f1b-v"),
    "seq1f1b": ({"FP32": "1"}, "--num-seq-splits 2", "1f1b"),     # Seq1F1B: 1F1B over sequence pieces
    # pretrain_offload.sh (the fork's method "offload-grouped-interleaved"): its OFFLOAD_CHUNK_NUM 4 of 7 chunks
    # at 8 GPUs is 1 of the 2 chunks here; --recompute-lgd, --use-tp-pp-dp-mapping are in the script itself
    "offload-grouped-interleaved": ({"INTERLEAVED_1F1B": "1", "INTERLEAVE_GROUP": "2", "OFFLOAD_TIME": "0.2",
                                     "OFFLOAD_CHUNK_NUM": "1", "OFFLOAD": "1", "FP32": "1"}, "", "group-interleaved:2"),
}


@pytest.fixture(scope="module")
def zb_dataset(tmp_path_factory):
    """The fork's DATASET_DIR layout: dataset/c4_text_document.{bin,idx} and tokenizers/tokenizer.model."""
    tmp = tmp_path_factory.mktemp("zb_sample_dataset")
    os.makedirs(tmp / "tokenizers")
    assert make_sample_corpus.main(["--out", str(tmp / "corpus"), "--max-mb", "0.2"]) == 0
    assert train_tokenizer.main(["--input", str(tmp / "corpus"), "--vocab-size", "512", "--model-prefix",
                                 str(tmp / "tokenizers" / "tokenizer")]) == 0
    assert preprocess_data.main(["--input", str(tmp / "corpus"), "--output-prefix", str(tmp / "dataset" / "c4"),
                                 "--tokenizer-model", str(tmp / "tokenizers" / "tokenizer.model"), "--workers", "1",
                                 "--append-eod", "--no-progress"]) == 0
    return str(tmp)


@pytest.mark.parametrize("method", list(SETTINGS))
def test_fork_script_trains_the_schedule_its_flags_name(zb_dataset, tmp_path, method):
    switches, extra, schedule = SETTINGS[method]
    jsonl = str(tmp_path / "metrics.jsonl")
    env = dict(os.environ, **SMALL, **switches, DATASET_DIR=zb_dataset, MASTER_PORT=str(free_port()),
               EXTRA_OPTIONS=f"--allow-padding-num-layers {extra} --metrics-jsonl {jsonl}",
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""), PYTHONPATH=ROOT)
    script = OFFLOAD_SCRIPT if method.startswith("offload") else SCRIPT
    proc = subprocess.run(["bash", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-5000:]
    run_lines = [line.split("run: ", 1)[1] for line in output.splitlines() if "] run: schedule " in line]
    assert len(run_lines) == 1 and run_lines[0].startswith(f"schedule {schedule}, 4 microbatches"), run_lines
    if schedule == "auto":      # ZB-2p: profiled until the timers' end iteration, then fitted under 2p = 4
        assert "the first 2 iterations run profiled 1F1B" in run_lines[0]
    elif method == "seq1f1b":
        assert "Seq1F1B: each microbatch in 2 sequence pieces" in run_lines[0], run_lines
    else:
        assert "2 model chunks per pipeline rank" in output
    rows = read_metrics(jsonl)
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    trained = [r["lm_loss"] for r in rows if not r.get("skipped")]
    assert trained and all(math.isfinite(loss) for loss in trained), rows
    assert "--enable-zb-runtime has no effect here" in output
    if method.startswith("offload"):        # PipeOffload's flags take effect: chunk 0 offloads, norms recomputed
        assert "activations of model chunk 0-0 offloaded to host memory" in run_lines[0]
        assert "recompute of norms, activation" in output
