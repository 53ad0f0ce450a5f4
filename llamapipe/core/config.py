"""Frozen configuration dataclasses of the library, one per concern; built by llamapipe.training.arguments.

A component receives only its own part (e.g. the optimizer gets `OptimizerConfig`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


class ArgumentError(ValueError):
    """A user-caused configuration error; the message is one plain sentence."""


class ConfigError(ArgumentError):
    """A user-caused configuration error raised by the library: one plain sentence that names the config fields (or
    arguments) it is about as they are spelled, e.g. "pp_size 3 ...", never a command-line flag. `fields` lists those
    names, so that the application can word them its own way (training/flag_names.py: as flags)."""

    def __init__(self, message: str, *fields: str) -> None:
        super().__init__(message)
        assert fields and all(field in message for field in fields), (message, fields)
        self.fields = fields


# Megatron's --data-parallel-sharding-strategy values, ZeRO stage 0 to 3; the last two run on FSDP2
SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
FSDP_STRATEGIES = SHARDING_STRATEGIES[2:]


@dataclass(frozen=True)
class ParallelConfig:
    world_size: int = 1
    tp_size: int = 1
    pp_size: int = 1
    vpp_size: int = 1                   # model chunks per pipeline rank
    dp_size: int = 1
    cp_size: int = 1                    # --context-parallel-size: ranks that split each sequence
    cp_comm_type: str = "p2p"           # --cp-comm-type: ring (p2p), all-gather, a2a or a2a+p2p attention
    cp_a2a_size: Optional[int] = None   # a2a+p2p: the a2a level (--hierarchical-context-parallel-sizes' first)
    order: str = "tp-cp-dp-pp"          # rank order, fastest-varying axis first (Megatron's)
    sequence_parallel: bool = False
    pipeline_schedule: str = "1f1b"     # effective schedule; ignored when pp_size == 1
    pipeline_memory_limit: Optional[float] = None   # activation units per rank for `auto`
    pipeline_memory_limit_bytes: Optional[int] = None   # or a byte cap, turned into units once measured
    first_stage_layers: Optional[int] = None        # --decoder-first-pipeline-num-layers (uneven split)
    last_stage_layers: Optional[int] = None         # --decoder-last-pipeline-num-layers
    account_for_embedding: bool = False             # --account-for-embedding-in-pipeline-split
    account_for_loss: bool = False                  # --account-for-loss-in-pipeline-split
    pipeline_layout: Optional[str] = None           # --pipeline-model-parallel-layout (layers of every stage)
    distributed_backend: str = "gloo"
    distributed_timeout_minutes: float = 10.0
    data_parallel_sharding_strategy: str = "no_shard"   # one of SHARDING_STRATEGIES; optim is ZeRO-1
    overlap_grad_reduce: bool = False
    vocab_parallel: bool = False                    # --enable-vocab-parallel: output layer split over pp (S/T)
    offload_chunk_num: int = 0                      # --cpu-offload: local chunks below this offload (PipeOffload)
    offload_time: Optional[float] = None            # --offload-time (one copy / (F + B + W)); None: measured
    offload_modules: tuple = ()                     # --offload-modules (Megatron's names); (): every saved tensor
    offload_fraction: float = 1.0                   # --activation-offload-fraction
    offload_min_numel: int = 0                      # --min-offloaded-tensor-size (fine-grained offloading)
    offload_rank_delta_bytes: int = 0               # --delta-offload-bytes-across-pp-ranks
    offload_held: bool = False                      # --offload-weight-grad-inputs: OW/RW from B to W too
    ddp_bucket_size: int = 25_000_000               # elements per DP all-reduce bucket
    num_seq_splits: int = 1                         # --num-seq-splits: Seq1F1B's sequence pieces per microbatch
    seq_split_balance: str = "flops"                # --seq1f1b-balance-method: equal FLOPs or equal length

    @property
    def sizes(self) -> dict[str, int]:
        """The size of every parallel axis by name (core.parallel_state.AXES), as the rank grid reads them."""
        return {"tp": self.tp_size, "cp": self.cp_size, "dp": self.dp_size, "pp": self.pp_size}


@dataclass(frozen=True)
class TrainingConfig:
    micro_batch_size: int = 1
    global_batch_size: int = 1
    seq_length: int = 128               # the one home of --seq-length: the model, loop and data read it here
    train_iters: int = 10
    seed: int = 1234                    # the one home of --seed: weights, RNG streams and the data's shuffle
    eval_interval: Optional[int] = None
    eval_iters: int = 100               # Megatron's default; 0 (or -1) runs no evaluation
    exit_interval: Optional[int] = None
    exit_duration_in_mins: Optional[float] = None
    exit_signal_handler: bool = False
    exit_signal: str = "SIGTERM"        # --exit-signal: the signal that saves under exit_signal_handler (and SIGINT)
    skip_nonfinite_steps: bool = False
    num_microbatches: int = 1           # derived: global / (micro x dp)
    profile_iters: int = 3              # `auto` and `zb-h2`: 1F1B iterations measured before switching
    keep_host_memory: bool = True       # CPU runs: glibc keeps freed memory (llamapipe.core.host_memory)
    train_samples: Optional[int] = None         # --train-samples; train_iters is then derived from it
    rampup_batch_size: Optional[tuple] = None   # (start, increment, ramp_samples) of --rampup-batch-size
    calculate_per_token_loss: bool = False
    manual_gc: bool = False                     # --manual-gc: Python's gc only at chosen points
    manual_gc_interval: int = 0                 # iterations between manual collections (0: none in training)
    manual_gc_eval: bool = True                 # collect around evaluation (--no-manual-gc-eval to not)
    compile: bool = False                       # --compile: torch.compile each decoder layer and the final norm
    post_validation: bool = False               # --enable-optimizer-post-validation: the step's form and the
                                                # profiled schedules' objective (zero-bubble paper, section 4)


@dataclass(frozen=True)
class OptimizerConfig:
    lr: float = 3e-4
    min_lr: float = 0.0
    lr_decay_style: str = "linear"
    lr_warmup_iters: int = 0
    lr_decay_iters: Optional[int] = None
    lr_warmup_samples: int = 0                  # sample-based schedule (with --train-samples)
    lr_decay_samples: Optional[int] = None
    lr_warmup_fraction: Optional[float] = None  # warmup as a fraction of the decay length
    decoupled_lr: Optional[float] = None        # the embedding's and output layer's peak rate (None: lr)
    decoupled_min_lr: Optional[float] = None    # and their rate at the end of the decay (None: min_lr)
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    bf16: bool = False
    fp16: bool = False
    loss_scale: Optional[float] = None  # fixed fp16 loss scale; None means dynamic
    initial_loss_scale: float = 2.0 ** 32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    use_distributed_optimizer: bool = False     # ZeRO-1: --data-parallel-sharding-strategy optim, resolved once
    optimizer_cpu_offload: bool = False # fp32 masters, Adam moments and the update on the CPU


@dataclass(frozen=True)
class DataConfig:
    """Where samples come from; their length and the shuffle seed are TrainingConfig's (passed down with it)."""
    data_path: tuple = ()               # prefixes, or weight prefix weight prefix ...
    split: str = "969,30,1"            # train,valid,test weights, always three (arguments pad "99,1")
    tokenizer_model: Optional[str] = None
    tokenizer_type: Optional[str] = None     # Megatron's --tokenizer-type; None: guessed from the model path
    mock_data: bool = False
    data_cache_path: Optional[str] = None
    num_workers: int = 0
    vocab_size: Optional[int] = None    # --vocab-size, which NullTokenizer needs
    train_data_path: tuple = ()         # per-split datasets (--train/valid/test-data-path) instead of --split
    valid_data_path: tuple = ()
    test_data_path: tuple = ()
    reset_position_ids: bool = False    # --reset-position-ids: positions restart after each end-of-document token
    reset_attention_mask: bool = False  # --reset-attention-mask: attention stays within each packed document
    eod_mask_loss: bool = False         # --eod-mask-loss: no loss where the input token is end-of-document
    eod_id: Optional[int] = None        # the tokenizer's end-of-document id, set when any of the three is on

    @property
    def packed_documents(self) -> bool:
        """Whether the samples carry their documents' boundaries (any of the three flags above)."""
        return self.reset_position_ids or self.reset_attention_mask or self.eod_mask_loss

    @property
    def per_split_paths(self) -> tuple:
        """(train, valid, test) blends of --train/valid/test-data-path; all empty when --data-path is split."""
        return self.train_data_path, self.valid_data_path, self.test_data_path

    def has_split(self, index: int) -> bool:
        """Whether split `index` (0 train, 1 valid, 2 test) has data: its own path, or a --split weight > 0."""
        if any(self.per_split_paths):
            return bool(self.per_split_paths[index])
        return float(self.split.split(",")[index]) > 0
