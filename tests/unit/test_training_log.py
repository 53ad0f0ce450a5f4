"""What the training loop reports and how it manages the process: norms (--log-params-norm,
--log-num-zeros-in-grad) against torch references and across TP ranks, the per-iteration JSONL records and
the interval-averaged console line, throughput without the first iteration, the end-of-training summary,
Weights & Biases in offline mode, --manual-gc, and the final validation."""
import glob
import gc
import json
import logging
import math
import os
import struct
import time

import pytest
import torch
from torch import nn

from llamapipe.core.config import ArgumentError
from llamapipe.core.parallel_state import ParallelState
from llamapipe.model.llama import LlamaConfig
from llamapipe.training.config import Config, LoggingConfig
from llamapipe.training.log import MetricsWriter, check_wandb, flops_per_token, num_zeros_in_grad, params_norm
from llamapipe.training.progress import TrainingProgress
from tests.cli import TINY
from tests.harness import free_port, run_distributed

MODEL = LlamaConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                    vocab_size=256, max_position_embeddings=16)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def log_lines():
    handler = _Records()
    logger = logging.getLogger("llamapipe")
    logger.addHandler(handler)
    yield handler.lines
    logger.removeHandler(handler)


def _toy() -> nn.Module:
    """A TP-sharded weight, a replicated norm weight and a pipeline duplicate (`shared`, counted elsewhere)."""
    torch.manual_seed(0)
    m = nn.Module()
    m.proj, m.norm, m.dup = (nn.Parameter(torch.randn(6, 4)), nn.Parameter(torch.randn(4)),
                             nn.Parameter(torch.randn(3)))
    m.proj.tensor_model_parallel, m.dup.shared = True, True
    return m


def test_norms_on_one_rank_match_torch():
    m = _toy()
    want = torch.linalg.vector_norm(torch.cat([m.proj.detach().flatten(), m.norm.detach()]).double()).item()
    assert params_norm([m], ParallelState()) == pytest.approx(want, rel=1e-6)      # fp32 per-tensor norms
    m.proj.grad = torch.where(m.proj > 0, m.proj, torch.zeros(()))   # zero where the weight is <= 0
    m.dup.grad = torch.zeros(3)                                       # not counted: shared
    want_zeros = int((m.proj <= 0).sum()) + m.norm.numel()           # norm has no grad: all zeros
    assert num_zeros_in_grad([m], ParallelState()) == want_zeros


def _tp_norms(rank: int, world_size: int) -> tuple[float, int]:
    from llamapipe.core.parallel_state import destroy_model_parallel, initialize_model_parallel
    from llamapipe.model.llama import LlamaModel
    ps = initialize_model_parallel(tp=world_size)
    try:
        model = LlamaModel(MODEL, ps, seed=7)
        for p in model.parameters():        # a gradient that is zero exactly where the weight is negative
            p.grad = p.detach().clamp(min=0)
        return params_norm([model], ps), num_zeros_in_grad([model], ps)
    finally:
        destroy_model_parallel()


@pytest.mark.slow
def test_norms_count_tp_shards_and_replicas_once():
    """tp=2: replicated norm weights count once, sharded weights once per shard: the single-rank values."""
    from llamapipe.model.llama import LlamaModel
    model = LlamaModel(MODEL, None, seed=7)
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    results = run_distributed(_tp_norms, 2)
    for norm, zeros in results:
        assert norm == pytest.approx(torch.linalg.vector_norm(flat.double()).item(), rel=1e-6)
        assert zeros == int((flat <= 0).sum())


def _progress(tmp_path, **logging_kw) -> tuple[TrainingProgress, MetricsWriter, str]:
    path = str(tmp_path / "m.jsonl")
    writer = MetricsWriter(LoggingConfig(metrics_jsonl=path, **logging_kw), enabled=True)
    return TrainingProgress(writer, MODEL, seq_length=8, world_size=2, train_iters=4,
                            log_interval=logging_kw.get("log_interval", 1)), writer, path


def _step(progress: TrainingProgress, it: int, loss: float, seconds: float, batch: int = 4, **extra) -> None:
    progress.iteration(iteration=it, consumed_samples=batch * it, global_batch_size=batch, seconds=seconds,
                       lr=1e-3, loss=loss, loss_scale=1.0, grad_norm=0.5, skipped_iterations=0, extra=extra)


def test_jsonl_every_iteration_console_line_averaged(tmp_path, log_lines):
    """--log-interval 2: four JSONL records, two console lines with the mean loss and the mean time of
    their two iterations; throughput leaves out iteration 1 (tokens = batch 4 x seq 8 = 32 per iteration)."""
    progress, writer, path = _progress(tmp_path, log_interval=2, log_throughput=True)
    for it, (loss, seconds) in enumerate([(4.0, 1.0), (3.0, 0.5), (2.0, 0.25), (1.5, 0.35)], start=1):
        _step(progress, it, loss, seconds, params_norm=10.0 + it, num_zeros_in_grad=it)
    writer.close()
    rows = [json.loads(line) for line in open(path)]
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4]
    assert rows[0]["tokens_per_sec"] is None and rows[0]["tflops_per_device"] is None
    assert rows[1]["tokens_per_sec"] == pytest.approx(32 / 0.5, rel=1e-12)
    assert rows[2]["tflops_per_device"] == pytest.approx(flops_per_token(MODEL, 8) * 32 / 0.25 / 2 / 1e12, rel=1e-12)
    assert [r["params_norm"] for r in rows] == [11.0, 12.0, 13.0, 14.0]
    assert [r["num_zeros_in_grad"] for r in rows] == [1, 2, 3, 4]
    lines = [line for line in log_lines if line.startswith("iteration")]
    assert len(lines) == 2
    assert "lm loss: 3.500000E+00" in lines[0] and "elapsed time per iteration (ms): 750.0" in lines[0]
    assert f"tokens/s: {32 / 0.5:.0f}" in lines[0]                   # iteration 2 alone
    assert "lm loss: 1.750000E+00" in lines[1] and "elapsed time per iteration (ms): 300.0" in lines[1]
    assert f"tokens/s: {64 / 0.6:.0f}" in lines[1]                   # iterations 3 and 4
    assert "params norm: 14.000" in lines[1] and "num zeros: 4" in lines[1] and "global batch size:     4" in lines[1]


def test_throughput_only_with_log_throughput(tmp_path, log_lines):
    progress, writer, _ = _progress(tmp_path, log_interval=1)
    _step(progress, 1, 2.0, 1.0)
    _step(progress, 2, 2.0, 1.0)
    writer.close()
    lines = [line for line in log_lines if line.startswith("iteration")]
    assert len(lines) == 2 and not any("tokens/s" in line or "TFLOP/s" in line for line in lines)
    progress, writer, _ = _progress(tmp_path, log_interval=1, log_throughput=True)
    _step(progress, 1, 2.0, 1.0)
    writer.close()
    assert "throughput: not measured on the first iteration (warm-up)" in log_lines[-1]


@pytest.mark.parametrize("losses,want", [
    ([10.0 - 0.1 * i for i in range(25)],
     "; mean lm loss 9.5500 over iterations 1-10 -> 8.0500 over iterations 16-25: the loss is falling"),
    ([5.0, 4.0, 6.0, 3.0, 3.5],
     "; mean lm loss 4.5000 over iterations 1-2 -> 3.2500 over iterations 4-5 (only 5 iterations, so means of 2 "
     "instead of means of 10): the loss is falling"),
    ([5.0, 6.0], "; lm loss 5.0000 at iteration 1 -> 6.0000 at iteration 2 (only 2 iterations, so single "
                 "iterations instead of means of 10): the loss is not falling"),
    ([5.0], "; lm loss 5.0000 at iteration 1 (one iteration: nothing to compare)"),
])
def test_summary_compares_averaged_losses(tmp_path, losses, want):
    progress, writer, _ = _progress(tmp_path, log_interval=100)
    for it, loss in enumerate(losses, start=1):
        _step(progress, it, loss, 0.5)
    writer.close()
    summary = progress.summary()
    assert summary.startswith(f"training done: {len(losses)} iterations in ") and summary.endswith(want)
    if len(losses) > 1:
        assert f"{32 / 0.5:.0f} tokens/s" in summary


def read_wandb_run(run_dir: str) -> tuple[dict, dict, dict[int, dict]]:
    """(run fields, config, history by step) from an offline run's .wandb file: W&B's LevelDB-style log of
    protobuf Records (a 7-byte file header, 32 KiB blocks of records with 7-byte headers)."""
    from wandb.proto import wandb_internal_pb2 as pb
    (path,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    with open(path, "rb") as f:
        data = f.read()
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:                 # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        if kind == 0:
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):                          # a full record, or the last fragment of one
            records.append(pb.Record.FromString(pending))
            pending = b""
    run, config, history = {}, {}, {}
    for r in records:
        kind = r.WhichOneof("record_type")
        if kind == "run":
            run = {"project": r.run.project, "name": r.run.display_name}
            config = {item.key: json.loads(item.value_json) for item in r.run.config.update}
        elif kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
            history[row["_step"]] = row
    return run, config, history


def test_wandb_offline_run_holds_the_records(tmp_path, monkeypatch):
    """W&B in offline mode, read back from the run directory: one history row per iteration with every
    numeric value (a validation record joins its iteration's row), the run's name, project and Config."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = LoggingConfig(wandb_project="llamapipe-test", wandb_exp_name="tiny", wandb_save_dir=str(tmp_path / "wb"))
    writer = MetricsWriter(cfg, enabled=True, run_config=Config())
    for it in (1, 2, 3):
        writer.write({"iteration": it, "lm_loss": 5.0 - it, "lr": 1e-3 * it, "mfu": None})
    writer.write({"iteration": 3, "valid_lm_loss": 2.5, "valid_ppl": math.exp(2.5)})
    writer.close()
    (run_dir,) = glob.glob(str(tmp_path / "wb" / "wandb" / "offline-run-*"))
    deadline = time.monotonic() + 15        # wandb's service process may still be flushing the run file
    run, config, history = read_wandb_run(run_dir)
    while (not run or sorted(history) != [1, 2, 3]) and time.monotonic() < deadline:
        time.sleep(0.2)
        run, config, history = read_wandb_run(run_dir)
    assert run == {"project": "llamapipe-test", "name": "tiny"}
    assert config["training"]["global_batch_size"] == Config().training.global_batch_size
    assert sorted(history) == [1, 2, 3]
    for it in (1, 2, 3):
        assert history[it]["lm_loss"] == 5.0 - it and history[it]["lr"] == pytest.approx(1e-3 * it)
        assert "mfu" not in history[it]            # None values are not logged
    assert history[3]["valid_lm_loss"] == 2.5 and history[3]["valid_ppl"] == pytest.approx(math.exp(2.5))


def test_wandb_missing_package_and_other_ranks(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ArgumentError, match=r"^--wandb-project p needs the wandb package: "
                                            r"pip install llamapipe\[wandb\]$"):
        check_wandb(LoggingConfig(wandb_project="p"))
    check_wandb(LoggingConfig())
    MetricsWriter(LoggingConfig(wandb_project="p"), enabled=False).close()   # rank != 0: never imports it


def test_loss_definitions_agree_on_our_data():
    """--calculate-per-token-loss (global token mean) and Megatron's default (mean of per-microbatch means)
    differ only when microbatches hold different numbers of loss tokens; every sample our datasets make has
    a loss mask of ones, so both are the same number and the flag has nothing to change."""
    from llamapipe.data.gpt_dataset import MockGPTDataset
    from llamapipe.training.setup import loss_func
    data = MockGPTDataset(12, 8, 256, seed=1)
    gen = torch.Generator().manual_seed(0)
    sums, counts = [], []
    for mb in range(4):                       # 4 microbatches of 3 samples
        mask = torch.stack([data[3 * mb + i]["loss_mask"] for i in range(3)])
        loss_sum, tokens, _ = loss_func(mask, torch.rand(3, 8, generator=gen))
        sums.append(loss_sum)
        counts.append(tokens)
    per_token = sum(sums) / sum(counts)
    per_microbatch = sum(s / n for s, n in zip(sums, counts)) / len(sums)
    torch.testing.assert_close(per_token, per_microbatch, rtol=1e-6, atol=0)


def test_manual_gc_and_final_validation(tmp_path, monkeypatch):
    """In-process, one rank: --manual-gc keeps the collector off during every step and collects at start,
    every --manual-gc-interval 2 iterations and around each evaluation; --train-iters 5 with
    --eval-interval 4 validates at 4 and once more at the end."""
    from llamapipe.core.parallel_state import destroy_model_parallel
    from llamapipe.training import loop, pretrain
    from llamapipe.training.arguments import parse_args
    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(key, value)
    jsonl = str(tmp_path / "m.jsonl")
    config = parse_args(TINY + ["--train-iters", "5", "--eval-interval", "4", "--eval-iters", "1",
                                "--micro-batch-size", "1", "--global-batch-size", "2", "--release-host-memory",
                                "--manual-gc", "--manual-gc-interval", "2", "--metrics-jsonl", jsonl])
    events = []
    real_collect, real_step, real_eval = gc.collect, loop.Trainer.train_step, loop.Trainer.evaluate
    monkeypatch.setattr(gc, "collect", lambda generation=2: events.append(("collect", generation)) or 0)

    def train_step(self):
        events.append(("step", gc.isenabled()))
        return real_step(self)

    def evaluate(self):
        events.append(("eval", self.state.iteration))
        return real_eval(self)
    monkeypatch.setattr(loop.Trainer, "train_step", train_step)
    monkeypatch.setattr(loop.Trainer, "evaluate", evaluate)
    try:
        assert pretrain.pretrain(config) == 0
    finally:
        destroy_model_parallel()
        monkeypatch.setattr(gc, "collect", real_collect)
    assert gc.isenabled()
    full, young, step = ("collect", 2), ("collect", 0), ("step", False)
    assert events == [full, step, step, full, step, step, full, ("eval", 4), full, young, step,
                      ("eval", 5), full, young]
    with open(jsonl) as f:
        rows = [json.loads(line) for line in f]
    assert [r["iteration"] for r in rows if "valid_lm_loss" in r] == [4, 5]
    assert [r["iteration"] for r in rows if "lm_loss" in r] == [1, 2, 3, 4, 5]
