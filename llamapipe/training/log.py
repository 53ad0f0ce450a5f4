"""Training metrics: the Megatron-style log line, TensorBoard scalars and one JSON object per iteration.

Only global rank 0 writes; the loss it reports has already been reduced over data- and pipeline-parallel
ranks by the training loop. FLOPs follow the Megatron/PaLM accounting (6 x params x tokens for the dense
matmuls plus 12 x layers x seq x hidden x tokens for attention scores), so MFU is comparable across tools.
"""
from __future__ import annotations

import json
import os
import resource
from typing import Optional

import torch

from llamapipe.core.logger import get_logger
from llamapipe.model.config import LlamaConfig

log = get_logger()

# Dense bf16 peak TFLOP/s per device name fragment; MFU is reported only where the peak is known.
_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "A800": 312.0, "H800": 989.0, "L40S": 362.0}


def flops_per_token(cfg: LlamaConfig, seq_length: int) -> float:
    """Training FLOPs per token (forward + backward) of the whole model."""
    h, layers, kv = cfg.hidden_size, cfg.num_layers, cfg.num_query_groups * cfg.head_dim
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * cfg.ffn_hidden_size   # q, o, k, v, gate/up/down
    dense = layers * per_layer + h * cfg.vocab_size                    # + output head
    return 6.0 * dense + 12.0 * layers * seq_length * h


def device_peak_tflops() -> Optional[float]:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in _PEAK_TFLOPS.items() if key in name), None)


def max_memory_gib() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2 ** 30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20   # ru_maxrss is KiB on Linux


class MetricsWriter:
    """Writes stdout lines, TensorBoard scalars and JSONL records on global rank 0."""

    def __init__(self, tensorboard_dir: Optional[str], metrics_jsonl: Optional[str], enabled: bool) -> None:
        self.enabled = enabled
        self._tb = None
        self._jsonl = None
        if not enabled:
            return
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter
            self._tb = SummaryWriter(log_dir=tensorboard_dir)
        if metrics_jsonl:
            os.makedirs(os.path.dirname(os.path.abspath(metrics_jsonl)), exist_ok=True)
            self._jsonl = open(metrics_jsonl, "a", buffering=1)

    def iteration(self, record: dict, train_iters: int) -> None:
        if not self.enabled:
            return
        parts = [f"iteration {record['iteration']:>6}/{train_iters:>6}",
                 f"consumed samples: {record['consumed_samples']:>10}",
                 f"elapsed time per iteration (ms): {record['elapsed_ms']:.1f}",
                 f"learning rate: {record['lr']:.6E}", f"lm loss: {record['lm_loss']:.6E}",
                 f"loss scale: {record['loss_scale']:.1f}", f"grad norm: {record['grad_norm']:.3f}",
                 f"skipped iterations: {record['skipped_iterations']:>3}",
                 f"tokens/s: {record['tokens_per_sec']:.0f}",
                 f"TFLOP/s per device: {record['tflops_per_device']:.3f}"]
        if record.get("mfu") is not None:
            parts.append(f"MFU: {100 * record['mfu']:.1f}%")
        parts.append(f"max memory (GiB): {record['max_memory_gib']:.2f}")
        log.info(" | ".join(parts))
        self.write(record)

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")
        if self._tb is not None:
            step = record["iteration"]
            for key, value in record.items():
                if key != "iteration" and isinstance(value, (int, float)) and value is not None:
                    self._tb.add_scalar(key, value, step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._jsonl is not None:
            self._jsonl.close()
