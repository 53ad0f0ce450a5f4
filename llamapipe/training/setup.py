"""Builds what the training loop runs on: the model config, this rank's model chunks, data iterators,
the pipeline schedule, and the Megatron-style `forward_step(data_iterator, model)` with its token-sum
loss function.

Chunk placement follows docs/design.md section 3: virtual stage v holds layers [v*L/S, (v+1)*L/S) for
S = pp*vpp stages (unless --decoder-first/last-pipeline-num-layers give an uneven split, see
`core.pipeline_parallel.layout.stage_layer_ranges`); the schedule's spec says where stage v goes
(interleaved: rank v % pp; ZB-V and two-chunk auto: the V placement). Under --enable-vocab-parallel local
chunk 0 of every rank also holds its shard of the output layer, and the last stage's forward step returns the
targets its S/T actions need (`VocabTargets`) instead of computing the loss.
"""
from __future__ import annotations

import contextlib
import itertools
from functools import partial
from typing import Optional

import torch

from llamapipe.training.config import Config
from llamapipe.core.logger import get_logger
from llamapipe.core.parallel_state import ParallelState
from llamapipe.core.pipeline_parallel.layout import stage_layer_ranges
from llamapipe.core.pipeline_parallel.runtime import RuntimeOptions, StepObserver
from llamapipe.core.pipeline_parallel.offload_plan import OffloadOptions
from llamapipe.core.pipeline_parallel.schedule_ir import stage_of
from llamapipe.core.pipeline_parallel.schedule_specs import SPECS
from llamapipe.core.pipeline_parallel.schedules import get_forward_backward_func
from llamapipe.core.pipeline_parallel.seq_split import SeqSplits, piece_align
from llamapipe.core.tensor_parallel.vocab_pipeline import VocabTargets
from llamapipe.model.llama import LlamaConfig
from llamapipe.model.offload_modules import module_paths
from llamapipe.training.arguments.offload_args import measured_offload_time

log = get_logger()


def params_dtype(config: Config) -> torch.dtype:
    if config.optimizer.bf16:
        return torch.bfloat16
    if config.optimizer.fp16:
        return torch.float16
    return torch.float32


def chunk_stages(config: Config, ps: ParallelState) -> list[int]:
    """Virtual stage of each local chunk."""
    placement = SPECS[config.parallel.pipeline_schedule].placement(ps.vpp_size)
    return [stage_of(ps.pp_rank, chunk, ps.pp_size, placement) for chunk in range(ps.vpp_size)]


def build_model_chunks(config: Config, model_cfg: LlamaConfig, ps: ParallelState,
                       device: torch.device) -> tuple[list[torch.nn.Module], list[tuple[bool, bool]]]:
    """This rank's model chunks (the chunk class of the config's model family) and their (pre_process,
    post_process) roles; under --compile they are compiled here, before training (llamapipe/model/compile.py)."""
    from llamapipe.model.families import family_of
    model_class = family_of(model_cfg).model_class
    if config.training.compile:
        from llamapipe.model.compile import check_compiler
        check_compiler(device)   # fail in one sentence before building anything
    num_stages = ps.pp_size * ps.vpp_size
    par = config.parallel
    ranges = stage_layer_ranges(model_cfg.num_layers, ps.pp_size, ps.vpp_size, par.first_stage_layers,
                                par.last_stage_layers, embedding=par.account_for_embedding, loss=par.account_for_loss,
                                layout=par.pipeline_layout)
    if num_stages > 1:
        log.info("layers per pipeline stage: " + ", ".join(str(end - start) for start, end in ranges))
    chunks, roles = [], []
    vocab_parallel = par.vocab_parallel and ps.pp_size > 1
    for index, stage in enumerate(chunk_stages(config, ps)):
        role = (stage == 0 and not vocab_parallel, stage == num_stages - 1)   # vocab: the embedding runs apart
        # on meta (the dry run) the chunk is built there: its per-name initialisation allocates nothing; elsewhere
        # it is built on the CPU, where that initialisation draws its numbers, and moved
        with torch.device("meta") if device.type == "meta" else contextlib.nullcontext():
            chunk = model_class(model_cfg, ps, layer_range=ranges[stage],
                                pre_process=role[0], post_process=role[1],
                                sequence_parallel=config.parallel.sequence_parallel,
                                params_dtype=params_dtype(config), seed=config.training.seed,
                                vocab_parallel=vocab_parallel, vocab_shard=vocab_parallel and index == 0,
                                cp_comm_type=par.cp_comm_type, cp_a2a_size=par.cp_a2a_size)
        chunks.append(chunk.to(device))
        roles.append(role)
    if vocab_parallel:
        chunks[0].output.stats_group = vocab_stats_group(ps)
    from llamapipe.core.distributed.grad_reduce import accumulate_grads_in_fp32
    if not accumulate_grads_in_fp32(chunks):
        log.warning("this torch has no per-tensor grad_dtype, so bf16/fp16 gradients accumulate in half "
                    "precision across microbatches; torch >= 2.10 accumulates them in fp32")
    from llamapipe.core.distributed.fsdp import apply_data_parallel_sharding
    apply_data_parallel_sharding(chunks, config.parallel.data_parallel_sharding_strategy, ps)   # ZeRO-2/3: FSDP2
    if config.training.compile:
        from llamapipe.model.compile import compile_chunks
        compile_chunks(chunks, micro_batch_size=config.training.micro_batch_size,
                       seq_length=config.training.seq_length, eval_too=config.training.eval_iters > 0,
                       positions=config.data.reset_position_ids, documents=config.data.reset_attention_mask)
    return chunks, roles


def vocab_stats_group(ps: ParallelState):
    """This rank's pipeline ranks as a process group of their own for S's all-gather: NCCL runs one
    communicator's operations in order, so on the pipeline group a receive posted ahead would hold the
    all-gather behind it. Collective over the world (every rank builds its chunks)."""
    import torch.distributed as dist
    from llamapipe.core.parallel_state import RankGrid
    others = {axis: n for axis, n in ps.sizes.items() if axis not in ("tp", "pp", "dp")}   # dp: what is left
    grid = RankGrid(ps.world_size, ps.tp_size, ps.pp_size, ps.order, **others)
    return dist.new_subgroups_by_enumeration(grid.named_groups("pp"))[0]


def build_runtime_options(config: Config, ps: ParallelState, chunks: list[torch.nn.Module],
                          observers: tuple[StepObserver, ...] = ()) -> RuntimeOptions:
    """The job's runtime options (`core/pipeline_parallel/runtime.py`), built once and handed unchanged from the
    loop to the executor: the overlapped gradient reduction, what the profiled schedules read, and the step's
    `observers` (the timers, the pipeline trace)."""
    grad_sync = None
    if config.parallel.overlap_grad_reduce and ps.dp_cp_size > 1:   # Megatron's overlap, during the backward
        from llamapipe.core.distributed.grad_sync import GradSync
        grad_sync = GradSync(chunks, ps, config.parallel.ddp_bucket_size)
    return RuntimeOptions(grad_sync=grad_sync, observers=observers, profile_iters=config.training.profile_iters,
                          memory_limit=config.parallel.pipeline_memory_limit,
                          memory_limit_bytes=config.parallel.pipeline_memory_limit_bytes,
                          post_validation=config.training.post_validation, offload=offload_options(config, chunks),
                          seq_splits=seq_splits(config))


def seq_splits(config: Config) -> Optional[SeqSplits]:
    """Seq1F1B's pieces (--num-seq-splits, --seq1f1b-balance-method) with the model's FLOPs per token and per
    (query, key) pair; None without splits."""
    par, m = config.parallel, config.model
    if par.num_seq_splits <= 1:
        return None
    return SeqSplits.for_model(par.num_seq_splits, par.seq_split_balance, m.hidden_size, m.ffn_hidden_size,
                               m.num_attention_heads, m.head_dim, m.num_query_groups,
                               align=piece_align(par.tp_size, par.sequence_parallel, par.cp_size))


def offload_options(config: Config, chunks: list[torch.nn.Module]) -> Optional[OffloadOptions]:
    """--cpu-offload's options; --auto-offload-time measures one copy against one chunk's F + B + W here. Copies
    overlap compute on a GPU (the reload one backward ahead; the dry run plans for one), not on a CPU (the reload
    right before its B)."""
    par = config.parallel
    if not par.offload_chunk_num:
        return None
    share, device = par.offload_time, next(chunks[0].parameters()).device
    if share is None and device.type == "meta":      # the dry run: nothing to time, the copies are counted
        share = 0.0
    if share is None:
        from llamapipe.model.families import flops_per_token
        m, cfg = config.model, config.training
        layers = m.num_layers / (par.pp_size * par.vpp_size)
        tokens = cfg.seq_length * cfg.micro_batch_size
        # one chunk's saved bytes by Korthikanti et al. 2022 (arXiv 2205.05198): 34 s b h per layer over tp
        saved = 34 * tokens * m.hidden_size / par.tp_size
        flops = flops_per_token(m, cfg.seq_length, par.tp_size) / m.num_layers * layers * tokens / par.tp_size
        share = measured_offload_time(saved * layers, flops, device)
    return OffloadOptions(par.offload_chunk_num, share, reload_lead=0 if device.type == "cpu" else 1,
                          modules=module_paths(par.offload_modules), fraction=par.offload_fraction,
                          min_numel=par.offload_min_numel, rank_delta_bytes=par.offload_rank_delta_bytes,
                          held=par.offload_held)


def build_forward_backward_func(config: Config, ps: ParallelState, options: RuntimeOptions = RuntimeOptions()):
    """The schedule's forward-backward callable, bound to the job's runtime options."""
    return get_forward_backward_func(ps, config.parallel.pipeline_schedule, options=options)


def build_iterators(config: Config, model_cfg: LlamaConfig, ps: ParallelState, roles: list[tuple[bool, bool]],
                    consumed_samples: int) -> tuple[list, Optional[list]]:
    """Per-chunk train and validation iterators; chunks that neither embed nor compute the loss get None,
    and the validation list is None on every rank when --eval-iters is 0. Under vocabulary parallelism one more
    iterator follows the chunks' ones: the embedding shard's, on every rank.

    The datasets and samplers are built once per rank, even when two local chunks read data (the first and
    the last stage under the V placement); those chunks get copies of one iterator that yield the same
    microbatches in the same order. With packed documents (--reset-attention-mask, --reset-position-ids) every
    chunk reads the microbatches, since every layer needs the documents' boundaries (a chunk that neither
    embeds nor computes the loss takes only their position and document ids).
    """
    from llamapipe.data.sampler import build_data_iterators
    needs = [pre or post for pre, post in roles]
    if config.parallel.vocab_parallel and ps.pp_size > 1:
        needs.append(True)          # every rank's embedding shard reads the microbatches (executor's prepass)
    if config.data.packed_documents:
        needs = [True] * len(needs)   # every chunk's attention needs the documents' boundaries
    train, valid, _ = build_data_iterators(config.data, config.training, dp_rank=ps.dp_rank, dp_size=ps.dp_size,
                                           vocab_size=model_cfg.vocab_size, consumed_samples=consumed_samples,
                                           needs_data=any(needs))
    train, valid = _per_chunk(train, needs), _per_chunk(valid, needs)
    # Every rank joins the evaluation schedule, also a rank whose chunks read no data (middle stages), so
    # whether there is one depends on the config alone; arguments.py rejects --eval-iters with no validation split.
    return train, (valid if config.training.eval_iters > 0 else None)


def _per_chunk(iterator, needs: list[bool]) -> list:
    """One copy of `iterator` per chunk that reads data, None for the others. The first stage's forwards run
    ahead of the last stage's on the same rank, so tee buffers the microbatches read by one and not yet by
    the other (a few microbatches of token ids)."""
    if iterator is None:
        return [None] * len(needs)
    copies = iter(itertools.tee(iterator, sum(needs)) if sum(needs) > 1 else [iterator])
    return [next(copies) if need else None for need in needs]


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Token-sum loss of one microbatch: (sum of masked token losses, token count, log values).

    The loop divides the global sum by the global token count: Megatron's --calculate-per-token-loss.
    Megatron's default instead averages each microbatch's own token mean; the two differ only when
    microbatches hold different numbers of loss tokens. Every sample has a loss mask of ones (seq_length
    tokens), so both settings of the flag train the same model, except under --eod-mask-loss: there the
    microbatches lose as many tokens as they hold end-of-document tokens, and the loss here is still the mean
    over the global batch's loss tokens (docs/data.md).
    """
    mask = loss_mask.to(output_tensor.device, torch.float32)
    loss_sum = (output_tensor.float() * mask).sum()
    num_tokens = mask.sum()
    return loss_sum, num_tokens, {"lm loss": (loss_sum.detach(), num_tokens)}


def forward_step(data_iterator, model: torch.nn.Module):
    """Megatron's forward_step_func: read a microbatch when this chunk has a data iterator (`build_iterators`
    gives one to the chunks that embed or compute the loss, and to every chunk with packed documents), and give
    the chunk its whole sequences, with the position and document ids of packed documents when the microbatch
    has them. Under context parallelism the chunk keeps its CP rank's tokens of them and returns their losses,
    so the loss mask is cut the same way (`model.sequence_shard`)."""
    pre, post = model.pre_process, model.post_process
    batch = next(data_iterator) if data_iterator is not None else None
    device = next(model.parameters()).device
    tokens = batch["tokens"].to(device) if pre else None
    labels = batch["labels"].to(device) if post else None
    documents = {key: batch[key].to(device) for key in ("position_ids", "document_ids") if batch and key in batch}
    output = model(input_ids=tokens, labels=labels, **documents)
    if not post:
        return output, None
    loss_mask = model.sequence_shard(batch["loss_mask"])
    if model.vocab_parallel:    # the output layer runs in the plan's S/T actions, on every pipeline rank
        return output, VocabTargets(model.sequence_shard(labels), loss_mask.to(device), partial(loss_func, loss_mask))
    return output, partial(loss_func, loss_mask)
