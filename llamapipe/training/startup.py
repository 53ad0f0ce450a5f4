"""The start-up block: what this run will do, logged once by rank 0 as soon as the configuration is valid.

A new user could not tell from the log which data-parallel sharding was active, that zb-h2 and auto begin
with profiled 1F1B iterations, or that the default final validation (--eval-iters 100, Megatron's) would
take longer than training (issue 33). Each line starts with "run:" and is built from the frozen `Config`
alone; the flags that do nothing for this layout get their own notice lines just before it
(training/arguments/noop.py).
"""
from __future__ import annotations

from llamapipe.core.logger import get_logger
from llamapipe.core.pipeline_parallel.schedule_specs import SPECS
from llamapipe.training.config import Config

# Megatron's --data-parallel-sharding-strategy values -> what they shard, by ZeRO stage
SHARDING = {"no_shard": "DDP, ZeRO-0: every data-parallel rank holds all parameters, gradients and optimizer state",
            "optim": "distributed optimizer, ZeRO-1: optimizer state sharded over data-parallel ranks",
            "optim_grads": "FSDP2, ZeRO-2: optimizer state and gradients sharded",
            "optim_grads_params": "FSDP2, ZeRO-3: optimizer state, gradients and parameters sharded"}


def _layout(config: Config) -> str:
    par = config.parallel
    chunks = f", {par.vpp_size} model chunks per pipeline rank (vpp)" if par.vpp_size > 1 else ""
    sp = "on" if par.sequence_parallel else "off"
    cp = (f" x cp {par.cp_size} (context parallel, {par.cp_comm_type} attention: each rank holds "
          f"{config.training.seq_length // par.cp_size} of every {config.training.seq_length} tokens)"
          if par.cp_size > 1 else "")
    return (f"{par.world_size} rank{'s' if par.world_size > 1 else ''} = tp {par.tp_size}{cp} x pp {par.pp_size} x dp "
            f"{par.dp_size} (order {par.order}){chunks}, sequence parallel {sp}, {par.distributed_backend}")


def _schedule(config: Config) -> str:
    par, cfg = config.parallel, config.training
    per_step = ("microbatches per step growing with --rampup-batch-size" if cfg.rampup_batch_size else
                f"{cfg.num_microbatches} microbatch{'es' if cfg.num_microbatches > 1 else ''} per step "
                f"(global batch {cfg.global_batch_size} / (micro-batch {cfg.micro_batch_size} x dp {par.dp_size}))")
    pieces = ""
    if par.num_seq_splits > 1:
        from llamapipe.core.pipeline_parallel.seq_split import SeqSplits
        bounds = SeqSplits(par.num_seq_splits, par.seq_split_balance, *_pair_flops(config)).bounds(cfg.seq_length)
        lengths = "/".join(str(b - a) for a, b in zip(bounds, bounds[1:]))
        pieces = (f"; Seq1F1B: each microbatch in {par.num_seq_splits} sequence pieces of {lengths} tokens "
                  f"(--num-seq-splits, equal {par.seq_split_balance}), backwards in reverse")
    if par.pp_size == 1:
        return f"no pipeline schedule (one pipeline stage runs its microbatches in turn), {per_step}{pieces}"
    line = f"schedule {par.pipeline_schedule}, {per_step}{pieces}"
    if par.offload_chunk_num:
        copy = ("measured at start-up" if par.offload_time is None else f"{par.offload_time:g} of F + B + W")
        line += (f"; activations of model chunk{'s' if par.offload_chunk_num > 1 else ''} 0-{par.offload_chunk_num - 1} "
                 f"offloaded to host memory between forward and backward (--cpu-offload; copy time {copy})")
    if SPECS[par.pipeline_schedule].profiled:
        line += (f"; the first {cfg.profile_iters} iterations run profiled 1F1B (--pipeline-profile-iters), "
                 f"then the {par.pipeline_schedule} plan fitted to the measured costs")
    return line


def _pair_flops(config: Config) -> tuple[float, float, int]:
    """Seq1F1B's FLOPs per token and per (query, key) pair, and the pieces' alignment (setup.seq_splits)."""
    from llamapipe.training.setup import seq_splits
    splits = seq_splits(config)
    return splits.linear, splits.pair, splits.align


def _data_parallel(config: Config) -> str:
    par, opt = config.parallel, config.optimizer
    strategy = par.data_parallel_sharding_strategy
    line = f"data-parallel sharding {strategy} ({SHARDING[strategy]})"
    if par.dp_size * par.cp_size == 1:
        return line + (", inactive at dp 1" if strategy != "no_shard" else "") + "; no gradient reduction"
    overlap = "during the backward (--overlap-grad-reduce)" if par.overlap_grad_reduce else "after the backward"
    over = f" over dp x cp ({par.dp_size * par.cp_size} replicas)" if par.cp_size > 1 else ""
    line += f"; gradients reduced{over} {overlap}"
    return line + ("; optimizer on the CPU" if opt.optimizer_cpu_offload else "")


def _numerics(config: Config) -> str:
    opt, m = config.optimizer, config.model
    if opt.bf16:
        precision = "bf16 with fp32 master weights"
    elif opt.fp16:
        scale = f"loss scale {opt.loss_scale:g}" if opt.loss_scale else "dynamic loss scaling"
        precision = f"fp16 with fp32 master weights and {scale}"
    else:
        precision = "fp32"
    recompute = m.recompute_granularity or "none"
    if recompute == "full":
        recompute += (f" (the first {m.recompute_num_layers} layers of each chunk)" if m.recompute_num_layers
                      else " (every layer)")
    elif m.recompute_modules:
        names = {"act": "activation", "layernorm": "norms"}
        recompute = f"of {', '.join(names.get(n, n) for n in m.recompute_modules)}"
    on = {True: "on", False: "off"}
    return (f"precision {precision}, recompute {recompute}, compile {on[config.training.compile]}, "
            f"optimizer post-validation {on[config.training.post_validation]}")


def _validation(config: Config) -> str:
    cfg = config.training
    if not cfg.eval_iters:
        return "no validation (--eval-iters 0)"
    when = f"every {cfg.eval_interval} iterations and " if cfg.eval_interval else ""
    return (f"validation over {cfg.eval_iters} global batches {when}after training (--eval-iters {cfg.eval_iters}; "
            "0 turns it off)")


def _documents(config: Config) -> list[str]:
    """The packed-document line, when any of Megatron's three flags is on (docs/data.md, "Packed documents")."""
    data = config.data
    if not data.packed_documents:
        return []
    parts = [what for on, what in ((data.reset_attention_mask, "attention within each document"),
                                   (data.reset_position_ids, "positions restart at each document"),
                                   (data.eod_mask_loss, "no loss on end-of-document tokens")) if on]
    return [f"packed documents: {', '.join(parts)} (end-of-document id {data.eod_id})"]


def startup_lines(config: Config) -> list[str]:
    """The block, one 'run: ...' line per concern."""
    return ["run: " + part for part in (_layout(config), _schedule(config), _data_parallel(config),
                                        _numerics(config), _validation(config), *_documents(config))]


def log_startup(config: Config) -> None:
    log = get_logger()
    for line in startup_lines(config):
        log.info(line)
