"""Training metrics: the Megatron-style log line, TensorBoard scalars, Weights & Biases and one JSON object per
iteration, plus the model-wide norms some of them report.

Only global rank 0 writes; the loss it reports has already been reduced over data- and pipeline-parallel
ranks by the training loop. FLOPs per token come from the model's family (model/families.py; LLaMA's
is model/llama/counts.py, Megatron's accounting: the padded vocabulary, --kv-channels and GQA honoured), the formula
the planner and the memory check use too.
"""
from __future__ import annotations

import contextlib
import errno
import dataclasses
import importlib.util
import json
import os
import resource
import socket
import stat
import time
from typing import Any, Optional

import torch

from llamapipe.core.config import ArgumentError
from llamapipe.core.distributed.grad_reduce import all_reduce_over
from llamapipe.core.logger import get_logger
from llamapipe.core.optimizer.clip_grads import counts_for_norm, global_grad_norm
from llamapipe.core.parallel_state import ParallelState
from llamapipe.safe_files import open_existing
from llamapipe.model.families import flops_per_token  # noqa: F401  (the family's formula; progress imports it here)
from llamapipe.training.config import LoggingConfig
from llamapipe.training.straggler import line_part

log = get_logger()

# Dense bf16 peak TFLOP/s per device name fragment; MFU is reported only where the peak is known.
_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "A800": 312.0, "H800": 989.0, "L40S": 362.0}


def device_peak_tflops() -> Optional[float]:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in _PEAK_TFLOPS.items() if key in name), None)


def max_memory_gib() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2 ** 30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20   # ru_maxrss is KiB on Linux


def _counted_params(model_chunks: list[torch.nn.Module], ps: ParallelState) -> list[torch.nn.Parameter]:
    """Each element of the model once over the TP and PP ranks (Megatron: not shared, not a TP duplicate)."""
    return [p for chunk in model_chunks for p in chunk.parameters()
            if p.requires_grad and counts_for_norm(p, ps.tp_rank)]


def params_norm(model_chunks: list[torch.nn.Module], ps: ParallelState) -> float:
    """L2 norm of all model weights (--log-params-norm); collective over the model-parallel group.

    Every DP rank holds the full weights (ZeRO-1 gathers them after each step), so no DP reduction."""
    params = [p.detach().float() for p in _counted_params(model_chunks, ps)]
    device = params[0].device if params else torch.device("cpu")
    return global_grad_norm(params, [ps.mp_group], device)


def num_zeros_in_grad(model_chunks: list[torch.nn.Module], ps: ParallelState) -> int:
    """Gradient elements that are exactly zero (--log-num-zeros-in-grad), after the DP reduction; a parameter
    without a gradient counts as all zeros, as Megatron's zero-filled main grad does. Collective over the
    model-parallel group."""
    params = _counted_params(model_chunks, ps)
    device = params[0].device if params else torch.device("cpu")
    zeros = torch.zeros(1, dtype=torch.float64, device=device)
    for p in params:
        zeros += p.numel() if p.grad is None else (p.grad == 0).sum()
    return int(all_reduce_over(zeros, [ps.mp_group]).item())


def check_wandb(cfg: LoggingConfig) -> None:
    """Refuse --wandb-project when the optional package is missing (every rank, before any group)."""
    if cfg.wandb_project and importlib.util.find_spec("wandb") is None:
        raise ArgumentError(f"--wandb-project {cfg.wandb_project} needs the wandb package: "
                            "pip install llamapipe[wandb]")


def _open_wandb(cfg: LoggingConfig, run_config: Optional[Any], save_dir: Optional[str]) -> Any:
    """A W&B run (offline with WANDB_MODE=offline) in --wandb-save-dir, or <--save>/wandb, or runs/wandb."""
    import wandb
    directory = cfg.wandb_save_dir or os.path.join(save_dir or "runs", "wandb")
    os.makedirs(directory, exist_ok=True)
    config = dataclasses.asdict(run_config) if dataclasses.is_dataclass(run_config) else run_config
    return wandb.init(project=cfg.wandb_project, name=cfg.wandb_exp_name or None, dir=directory, config=config)


def _line(record: dict, train_iters: int, throughput: bool) -> str:
    parts = [f"iteration {record['iteration']:>6}/{train_iters:>6}",
             f"consumed samples: {record['consumed_samples']:>10}",
             f"elapsed time per iteration (ms): {record['elapsed_ms']:.1f}"]
    if throughput:
        if record.get("tflops_per_device") is None:
            parts.append("throughput: not measured on the first iteration (warm-up)")
        else:
            parts += [f"throughput per GPU (TFLOP/s/GPU): {record['tflops_per_device']:.3f}",
                      f"tokens/s: {record['tokens_per_sec']:.0f}"]
            if record.get("mfu") is not None:
                parts.append(f"MFU: {100 * record['mfu']:.1f}%")
    parts += [f"learning rate: {record['lr']:.6E}", f"global batch size: {record['global_batch_size']:>5}",
              f"lm loss: {record['lm_loss']:.6E}", f"loss scale: {record['loss_scale']:.1f}",
              f"grad norm: {record['grad_norm']:.3f}"]
    if "num_zeros_in_grad" in record:
        parts.append(f"num zeros: {record['num_zeros_in_grad']}")
    if "params_norm" in record:
        parts.append(f"params norm: {record['params_norm']:.3f}")
    if "bubble_max" in record:
        parts.append(f"pipeline bubble (measured): {100 * record['bubble_max']:.1f}% max (rank "
                     f"{record['bubble_max_rank']}), {100 * record['bubble_mean']:.1f}% mean")
    straggler = line_part(record)
    if straggler:
        parts.append(straggler)
    parts += [f"skipped iterations: {record['skipped_iterations']:>3}",
              f"max memory (GiB): {record['max_memory_gib']:.2f}"]
    return " | ".join(parts)


class MetricsWriter:
    """Writes stdout lines, TensorBoard scalars, W&B and JSONL records on global rank 0.

    A sink that fails (a full disk: ENOSPC, a vanished directory, a W&B service that died) warns once, naming
    the file and the error, and is written no more; training goes on, because metrics are never worth a lost
    run or the checkpoint its exit would have saved."""

    def __init__(self, cfg: LoggingConfig, enabled: bool, *, run_config: Optional[Any] = None,
                 save_dir: Optional[str] = None) -> None:
        self.enabled, self.cfg = enabled, cfg
        # Every JSONL record names its run: a resumed run appends to the same file, and iterations after its
        # checkpoint then appear twice (the earlier run's, then this one's).
        self.run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{socket.gethostname()}-{os.getpid()}"
        self._resumed_from: Optional[int] = None        # said once, in this run's first JSONL record
        self._tb = self._jsonl = self._wandb = None
        if not enabled:
            return
        if cfg.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter
            self._tb = self._guard("_tb", lambda _: SummaryWriter(log_dir=cfg.tensorboard_dir), True)
        if cfg.metrics_jsonl:
            self._jsonl = self._guard("_jsonl", lambda _: _open_jsonl(cfg.metrics_jsonl), True)
        if cfg.wandb_project:
            self._wandb = self._guard("_wandb", lambda _: _open_wandb(cfg, run_config, save_dir), True)

    def _guard(self, sink: str, action: Any, opening: bool = False) -> Any:
        """`action(the sink)`; on a write error, one warning and the sink is dropped (None)."""
        errors = Exception if sink == "_wandb" else OSError     # wandb wraps its I/O errors in its own types
        broken = None if opening else getattr(self, sink)
        try:
            return action(broken)
        except errors as err:
            setattr(self, sink, None)
            if sink != "_wandb" and broken is not None:
                with contextlib.suppress(Exception):   # else the unwritable buffer fails again at exit, loudly
                    broken.close()
            target = {"_tb": f"--tensorboard-dir {self.cfg.tensorboard_dir}",
                      "_jsonl": f"--metrics-jsonl {self.cfg.metrics_jsonl}",
                      "_wandb": f"--wandb-project {self.cfg.wandb_project}"}[sink]
            log.warning(f"{target}: cannot write ({type(err).__name__}: {err}); no more metrics go there, "
                        "training goes on")
            return None

    def iteration(self, record: dict, train_iters: int) -> None:
        """The console line of a (log-interval averaged) training record."""
        if self.enabled:
            log.info(_line(record, train_iters, self.cfg.log_throughput))

    def write(self, record: dict) -> None:
        """One JSONL object; its numeric values as TensorBoard and W&B scalars at step record['iteration']."""
        if not self.enabled:
            return
        if self._jsonl is not None:
            mark = {"run_id": self.run_id}
            if self._resumed_from is not None:
                mark["resumed_from_iteration"], self._resumed_from = self._resumed_from, None
            self._guard("_jsonl", lambda f: f.write(json.dumps({**record, **mark}) + "\n"))
        scalars = {k: v for k, v in record.items()
                   if k != "iteration" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._tb is not None:
            self._guard("_tb", lambda tb: [tb.add_scalar(k, v, record["iteration"]) for k, v in scalars.items()])
        if self._wandb is not None:
            self._guard("_wandb", lambda run: run.log(scalars, step=record["iteration"]))

    def mark_resume(self, iteration: int) -> None:
        """This run took over from a checkpoint at `iteration`: its first JSONL record says so (JSONL only, it
        is no metric; still one record per iteration)."""
        self._resumed_from = iteration

    def close(self) -> None:
        for sink, method in (("_tb", "close"), ("_jsonl", "close"), ("_wandb", "finish")):
            if getattr(self, sink) is not None:
                self._guard(sink, lambda obj: getattr(obj, method)())
                setattr(self, sink, None)


class _JsonlFile:
    """An appended JSONL file that holds whole lines only (issue 51): each record goes in one write, and a write
    the disk cuts short is taken back (the file truncated to where the record began) before the error is raised;
    a file that ends mid-line (an older run's cut-short record) gets a newline first, so ours starts a line."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        st = os.fstat(fd)
        self._regular = stat.S_ISREG(st.st_mode)
        if self._regular and st.st_size and os.pread(fd, 1, st.st_size - 1) != b"\n":
            self.write("\n")

    def write(self, text: str) -> None:
        data = text.encode()
        start = os.fstat(self.fd).st_size if self._regular else 0
        try:
            written = os.write(self.fd, data)
            if written != len(data):
                raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} ({written} of {len(data)} bytes written)")
        except OSError:
            if self._regular:
                with contextlib.suppress(OSError):
                    os.ftruncate(self.fd, start)
            raise

    def close(self) -> None:
        os.close(self.fd)


def _open_jsonl(path: str) -> Any:
    """Appended to, never through a link (a link, FIFO or directory there is refused; /dev/null is fine)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fd = open_existing(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, devices=True)    # read: its last byte
    try:
        return _JsonlFile(fd)
    except BaseException:
        os.close(fd)
        raise
