"""The LLaMA model chunk with tensor, sequence and pipeline parallelism (Megatron-LM chunk protocol), built from
the parts its `spec` names (model/spec.py): every LLaMA-shaped family's chunk is this class with its own spec.

`LlamaModel(config)` is the whole model on one process. Given a `ParallelState` it holds this TP rank's
shards; `layer_range` / `pre_process` / `post_process` make it one pipeline chunk. Parameter names are
logical (`embedding.weight`, `layers.<global index>...`, `final_norm.weight`, `output.weight`), and every
parameter is initialised from (seed, name) on the full logical tensor before slicing, so every layout
starts from identical weights (docs/design.md section 4). Activations travel sequence-first, (s, b, h).
With context parallelism (the state's cp_size > 1) a chunk takes the whole sequence of each microbatch and
keeps s/cp tokens of it in the causal load-balanced layout of core/context_parallel/sharding.py: its
`sequence_shard` cuts the input ids, the labels and the positions, so no caller cuts them first; its attention
spans the CP group (`cp_comm_type` "p2p", "allgather", "a2a" or "a2a+p2p") and it returns those tokens' losses, which the
caller's loss mask meets after the same cut (`chunk.sequence_shard(loss_mask)`).
With tied embeddings (`tie_word_embeddings`) a chunk holding both ends uses the embedding as the output
weight; when the ends are in two chunks (pipeline parallelism) the last stage's output weight is a copy of the
embedding, initialised and stored under its name and kept equal by summing the two gradients
(core/distributed/tied_embeddings.py).
With `vocab_parallel` (arXiv 2411.05288) the last chunk ends at the final norm, the first starts from the
embedding output it is given (`set_input_tensor`, like any later chunk: `pre_process` is False), and the
output layer and the embedding are `PipelineVocabOutput` / `PipelineVocabEmbedding` shards held by local chunk 0
of every pipeline rank (`vocab_shard=True`), which the executor runs (S/T actions, the embedding prepass); tied,
the two shards of a rank are one parameter.
"""
from __future__ import annotations

import math
import zlib
from typing import Optional, Sequence, Union

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from llamapipe.core.context_parallel import COMM_TYPES, SequenceShard
from llamapipe.core.context_parallel.ulysses import A2A_TYPES, UlyssesGroup
from llamapipe.core.distributed.tied_embeddings import logical_name, mark_tied
from llamapipe.core.parallel_state import ParallelState
from llamapipe.core.pipeline_parallel import seq_split
from llamapipe.core.tensor_parallel import mappings
from llamapipe.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from llamapipe.core.tensor_parallel.vocab_pipeline import PipelineVocabEmbedding, PipelineVocabOutput
from llamapipe.core.tensor_parallel.layers import (INPUT_COPY, INPUT_GATHER, ColumnParallelLinear, VocabParallelEmbedding,
                                         parallel_linear, set_tensor_model_parallel_attributes,
                                         shard_logical_tensor)
from llamapipe.model.layers import DecoderLayer
from llamapipe.model.llama.config import LlamaConfig
from llamapipe.model.spec import ModelSpec

_SCALED_INIT = ("attention.o_proj.weight", "mlp.down_proj.weight")


def _check_config(config: LlamaConfig, tp_size: int, layer_range: tuple[int, int]) -> None:
    c = config
    if c.kv_channels is None and c.hidden_size % c.num_attention_heads:
        raise ValueError(f"hidden_size {c.hidden_size} is not divisible by num_attention_heads {c.num_attention_heads}")
    if c.rotary_dim <= 0 or c.rotary_dim % 2:
        raise ValueError(f"rotary_percent {c.rotary_percent} of head dim {c.head_dim} gives {c.rotary_dim} rotated "
                         "dims; RoPE needs a positive even number")
    for name in ("num_attention_heads", "num_query_groups", "ffn_hidden_size"):
        if getattr(c, name) % tp_size:
            raise ValueError(f"{name} {getattr(c, name)} is not divisible by the tensor-parallel size {tp_size}")
    if c.num_attention_heads % c.num_query_groups:
        raise ValueError(f"num_query_groups {c.num_query_groups} does not divide num_attention_heads "
                         f"{c.num_attention_heads}")
    start, end = layer_range
    if not 0 <= start <= end <= c.num_layers:
        raise ValueError(f"layer_range {layer_range} is not inside the model's {c.num_layers} layers")
    if c.use_rope_scaling and not (c.rope_scaling_factor > 0 and c.rope_high_freq_factor > c.rope_low_freq_factor > 0):
        raise ValueError(f"RoPE scaling needs a positive factor (got {c.rope_scaling_factor}) and 0 < low_freq_factor "
                         f"({c.rope_low_freq_factor}) < high_freq_factor ({c.rope_high_freq_factor})")
    if c.recompute_granularity not in (None, "full", "selective"):
        raise ValueError(f"recompute_granularity {c.recompute_granularity!r} must be None, 'full' or 'selective'")


def init_logical_tensor(name: str, shape: Sequence[int], config: LlamaConfig, seed: int) -> torch.Tensor:
    """The full (unsharded) initial value of parameter `name`: ones for norms, zeros for biases (as HF and
    Megatron start them), else seeded normal."""
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    std = config.init_method_std
    if name.endswith(_SCALED_INIT):  # Megatron's scaled init for the projections into the residual stream
        std /= math.sqrt(2.0 * config.num_layers)
    generator = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2 ** 63)
    return torch.empty(shape).normal_(0.0, std, generator=generator)


class LlamaModel(nn.Module):
    """A LLaMA chunk: [embedding] -> layers[start:end] -> [final norm, output head, loss]. Another family
    with LLaMA's chunk structure subclasses it with its own `spec` (model/qwen2/model.py)."""

    spec = ModelSpec()

    def __init__(self, config: LlamaConfig, parallel_state: Optional[ParallelState] = None, *,
                 layer_range: Optional[tuple[int, int]] = None, pre_process: bool = True,
                 post_process: bool = True, sequence_parallel: bool = False,
                 params_dtype: torch.dtype = torch.float32, seed: int = 1234, vocab_parallel: bool = False,
                 vocab_shard: bool = False, cp_comm_type: str = "p2p", cp_a2a_size: Optional[int] = None) -> None:
        super().__init__()
        ps = parallel_state if parallel_state is not None else ParallelState()
        tp_size = ps.tp_size
        self.tp_size, self.tp_rank = tp_size, ps.tp_rank
        self.tp_group = ps.tp_group if tp_size > 1 else None
        self.sequence_shard = SequenceShard(ps.cp_size, ps.cp_rank)   # this CP rank's tokens of every input
        cp_group = ps.cp_group if ps.cp_size > 1 else None
        if ps.cp_size > 1 and cp_group is None:   # attention would silently stay local to this rank's tokens
            raise ValueError(f"context-parallel size {ps.cp_size} needs the parallel state's cp group")
        if cp_comm_type not in COMM_TYPES:
            raise ValueError(f"--cp-comm-type {cp_comm_type} is not supported; use one of {', '.join(COMM_TYPES)}")
        if cp_group is not None and cp_comm_type in A2A_TYPES:   # heads over the a2a level (ulysses.py)
            cp_group = UlyssesGroup(cp_group, ps.cp_size if cp_comm_type == "a2a" else cp_a2a_size)
        layer_range = tuple(layer_range) if layer_range is not None else (0, config.num_layers)
        _check_config(config, tp_size, layer_range)
        self.config, self.layer_range = config, layer_range
        pre_process = pre_process and not vocab_parallel     # the embedding runs before the step (prepass)
        self.pre_process, self.post_process, self.vocab_parallel = pre_process, post_process, vocab_parallel
        self.sequence_parallel = sequence_parallel and tp_size > 1
        kw = dict(sequence_parallel=self.sequence_parallel, params_dtype=params_dtype)
        padded_vocab = config.padded_vocab_size(tp_size)
        if pre_process:
            self.embedding = VocabParallelEmbedding(padded_vocab, config.hidden_size, self.tp_group, **kw)
        self.rotary = self.spec.positions(config.rotary_dim, config.max_position_embeddings, config.rope_theta,
                                          scaling=config.rope_scaling)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(config, self.spec, self.tp_group, cp_group=cp_group,
                                                          cp_comm_type=cp_comm_type, **kw)
                                     for i in range(*layer_range)})
        tied = config.tie_word_embeddings
        if post_process:
            self.final_norm = self.spec.norm(config.hidden_size, config.norm_epsilon, **kw)
            if not (tied and pre_process) and not vocab_parallel:
                self.output = ColumnParallelLinear(config.hidden_size, padded_vocab, self.tp_group, **kw)
                set_tensor_model_parallel_attributes(self.output.weight, 0, vocab_padded=True)
        if tied and pre_process != post_process and not vocab_parallel:   # the two ends in two chunks: two copies
            mark_tied(self.embedding.weight if pre_process else self.output.weight, copy=post_process)
        if vocab_shard:
            pp_rank, pp_size = parallel_state.pp_rank, parallel_state.pp_size
            padded_split = config.padded_vocab_size(tp_size * pp_size)
            self.embedding = PipelineVocabEmbedding(padded_split, config.hidden_size, self.tp_group, pp_rank,
                                                    pp_size, sequence_shard=self.sequence_shard, **kw)
            self.output = PipelineVocabOutput(padded_split, config.hidden_size, config.vocab_size, self.tp_group,
                                              pp_rank, pp_size, **kw)
            if tied:     # the same rows of the same matrix: one parameter for both shards
                self.output.weight = self.embedding.weight
        self.input_tensor: Optional[torch.Tensor] = None
        self._piece_starts: dict[int, int] = {}   # Seq1F1B: microbatch -> first position of its next piece
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Initialise every parameter from (seed, name) on its full logical tensor, then keep this shard."""
        for name, param in self.named_parameters():
            if param.is_meta:       # shapes without values (the dry run): nothing to draw
                continue
            shape = list(param.shape)
            rank, size = self._shard_of(param)
            if param.tensor_model_parallel:
                shape[param.partition_dim] *= size
            if getattr(param, "vocab_padded", False):
                shape[0] = self.config.vocab_size  # padding rows start at zero in every layout
            full = init_logical_tensor(logical_name(name, param), shape, self.config, seed)  # tied copy: as the embedding
            param.copy_(shard_logical_tensor(full, param, rank, size))

    def _shard_of(self, param: torch.Tensor) -> tuple[int, int]:
        """(shard index, shard count) of a parameter: its TP rank, or its vocabulary shard over pp x tp."""
        if hasattr(param, "vocab_shards"):
            return param.vocab_shard, param.vocab_shards
        return self.tp_rank, self.tp_size

    @torch.no_grad()
    def load_logical_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Load full logical tensors (e.g. from `from_hf`), keeping this rank's shard of each."""
        own = dict(self.named_parameters())
        missing = sorted(name for name, param in own.items() if logical_name(name, param) not in state_dict)
        if strict and missing:
            raise ValueError(f"state dict lacks {len(missing)} parameters of this chunk, e.g. {missing[0]}")
        for name, param in own.items():
            if logical_name(name, param) in state_dict:
                param.copy_(shard_logical_tensor(state_dict[logical_name(name, param)], param, *self._shard_of(param)))

    def set_input_tensor(self, input_tensor: Union[torch.Tensor, Sequence[torch.Tensor], None]) -> None:
        """Megatron protocol: the previous stage's output, (s, b, h) or (s/tp, b, h) with sequence parallel."""
        if isinstance(input_tensor, (list, tuple)):
            assert len(input_tensor) == 1, "a LLaMA chunk takes one input tensor"
            input_tensor = input_tensor[0]
        self.input_tensor = input_tensor

    def _recompute_layer(self, index_in_chunk: int) -> bool:
        c = self.config
        return c.recompute_granularity == "full" and (c.recompute_num_layers is None
                                                      or index_in_chunk < c.recompute_num_layers)

    def forward(self, input_ids: Optional[torch.LongTensor] = None, labels: Optional[torch.LongTensor] = None,
                position_ids: Optional[torch.LongTensor] = None,
                document_ids: Optional[torch.LongTensor] = None) -> torch.Tensor:
        """Hidden states (s, b, h) for the next stage, or logits (b, s, vocab), or per-token losses (b, s), from
        `input_ids`, `labels` and `position_ids` (None: 0..s-1) of the whole sequence, (b, s). `document_ids`
        (b, s), the document of each token of a packed sample, restricts attention to each document
        (Megatron's --reset-attention-mask; None: causal over the sample).

        Under context parallelism the chunk keeps this rank's s/cp tokens of each (`sequence_shard`; the document
        ids stay whole, since keys come from every CP rank) and the outputs hold those tokens only: s is s/cp
        above."""
        shard = self.sequence_shard
        input_ids, labels, position_ids = shard(input_ids), shard(labels), shard(position_ids)
        if self.pre_process:
            if input_ids is None:
                raise ValueError("the first pipeline chunk needs input_ids")
            hidden = self.embedding(input_ids)  # (s, b, h) or (s/tp, b, h)
        else:
            assert self.input_tensor is not None, "set_input_tensor must be called before forward"
            hidden = self.input_tensor
        seq_len = hidden.shape[0] * (self.tp_size if self.sequence_parallel else 1)   # this CP rank's tokens
        start = self._piece_start(seq_len * shard.cp_size)
        if position_ids is None and shard.cp_size > 1:   # the global positions of this rank's tokens
            position_ids = shard.positions(seq_len, hidden.shape[1], hidden.device) + start
        rope = self._rope(seq_len, start, position_ids, hidden.dtype)
        for i, layer in enumerate(self.layers.values()):
            if self._recompute_layer(i) and torch.is_grad_enabled():
                hidden = checkpoint(layer, hidden, rope, document_ids, use_reentrant=False)
            else:
                hidden = layer(hidden, rope, document_ids)
        if not self.post_process:
            return hidden
        if self.vocab_parallel:
            return self.final_norm(hidden)   # (s, b, h): the output layer runs in the plan's S/T actions
        return self._head(self.final_norm(hidden), labels)

    def _piece_start(self, piece_len: int) -> int:
        """The first position of this forward's tokens in their sequence: after the earlier pieces' tokens for a
        Seq1F1B piece of `piece_len` tokens (all CP ranks' together), else 0."""
        piece = seq_split.current()
        if piece is None:
            return 0
        start = self._piece_starts.pop(piece.microbatch, 0) if piece.index else 0
        if piece.index < piece.count - 1:
            self._piece_starts[piece.microbatch] = start + piece_len
        return start

    def _rope(self, seq_len: int, start: int, position_ids: Optional[torch.Tensor], dtype: torch.dtype):
        """RoPE tables of this forward's `seq_len` tokens, at `position_ids`, else at start, start + 1, ..."""
        if position_ids is not None or start == 0:
            return self.rotary(seq_len, position_ids, dtype)
        cos, sin = self.rotary(start + seq_len, None, dtype)
        return cos[start:], sin[start:]

    def _head(self, hidden: torch.Tensor, labels: Optional[torch.Tensor]) -> torch.Tensor:
        weight = self.embedding.weight if self.config.tie_word_embeddings and self.pre_process else self.output.weight
        mode = INPUT_GATHER if self.sequence_parallel else INPUT_COPY
        logits = parallel_linear(hidden, [weight], self.tp_group, mode)[0]  # (s, b, vocab/tp)
        if labels is None:
            logits = mappings.gather_from_tensor_model_parallel_region(logits, self.tp_group)
            return logits[..., :self.config.vocab_size].transpose(0, 1).contiguous()  # (b, s, vocab)
        # the logits are a temporary here: the loss may overwrite them
        losses = vocab_parallel_cross_entropy(logits, labels.t(), self.tp_group, self.config.vocab_size,
                                              inplace=True)  # (s, b)
        return losses.t().contiguous()  # (b, s)
