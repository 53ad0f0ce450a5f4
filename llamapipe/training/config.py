"""The application's configuration: the library's per-concern configs plus checkpointing and logging.

`Config` is what llamapipe.training.arguments builds; each component receives only its own part.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from llamapipe.core.config import DataConfig, OptimizerConfig, ParallelConfig, TrainingConfig
from llamapipe.model.llama import LlamaConfig


@dataclass(frozen=True)
class CheckpointConfig:
    save: Optional[str] = None
    save_interval: Optional[int] = None
    load: Optional[str] = None
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False
    keep_last_n: Optional[int] = None
    override_opt_param_scheduler: bool = False       # the LR schedule comes from the command line
    use_checkpoint_opt_param_scheduler: bool = False  # the LR schedule comes from the checkpoint
    async_save: bool = False                         # write checkpoints on a background thread
    allow_tokenizer_change: bool = False             # resume a checkpoint trained with another tokenizer
    overwrite_save: bool = False                     # a fresh run deletes the checkpoints already in --save
    megatron_save: Optional[str] = None              # --ckpt-format torch_dist: Megatron's copies go here, ours
                                                     # into `save` = megatron_save/llamapipe (megatron_save.py)


@dataclass(frozen=True)
class LoggingConfig:
    log_interval: int = 100
    tensorboard_dir: Optional[str] = None
    metrics_jsonl: Optional[str] = None
    log_throughput: bool = False
    log_params_norm: bool = False
    log_num_zeros_in_grad: bool = False
    wandb_project: Optional[str] = None
    wandb_exp_name: Optional[str] = None
    wandb_save_dir: Optional[str] = None
    timing_log_level: int = 0           # 0: no timers; 1: per-rank compute/communication/idle and the bubble; 2: +phases
    timing_log_option: str = "minmax"   # how a timer is reported across ranks: max, minmax or all
    pipeline_trace: Optional[str] = None        # write one merged Chrome trace of the profiled iterations here
    profile_step_start: int = 10        # Megatron's: trace from when this many iterations have completed...
    profile_step_end: int = 12          # ...until this many have
    profile_ranks: Optional[tuple[int, ...]] = None     # the ranks that record (None: all)
    log_straggler: bool = False         # slowest/fastest ranks every interval, a straggler named (training/straggler)
    straggler_minmax_count: int = 1     # how many of the slowest and of the fastest ranks the JSONL lists
    straggler_threshold: float = 1.1    # compute over the fastest replica's that names a rank (3 intervals in a row)
    hang_report_seconds: float = 300.0  # a step without progress this long is reported (training/hang_watch); 0: off
    hang_report_keep_waiting: bool = False  # after the report, keep waiting instead of exiting


@dataclass(frozen=True)
class Config:
    model: LlamaConfig = field(default_factory=LlamaConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
