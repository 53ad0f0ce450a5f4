"""Seq1F1B (arXiv 2406.03488; thunlp/Seq1F1B, the zero-bubble fork's `--num-seq-splits`): each microbatch is
split along the sequence into K pieces, and the pieces are the microbatch units of the schedule.

Unit u of a plan with `seq_splits` K is piece u % K of microbatch u // K. The pieces of one sequence run their
forwards in order (piece i attends to the cached keys and values of pieces 0..i-1, model/piece_attention.py)
and their backwards in reverse (piece i's backward gives the key/value gradients of the earlier pieces, which
piece i-1's backward adds to its own). This module holds what the pipeline side needs: which piece runs now
(`running`/`current`, set by the executor around every action of a split plan, read by the model's attention and
RoPE), where the pieces' boundaries are (`piece_bounds`) and the data iterator that cuts each microbatch into its
pieces (`PieceIterator`).

Boundaries: "flops" (the default, the paper's solver) gives every piece the same attention + MLP FLOPs; a later
piece attends to more keys, so it is shorter. Equal compute keeps every unit of the pipeline the same length,
which is what the schedules assume. "length" gives every piece seq/K tokens (equal activation memory per piece).

Context parallelism (a2a and allgather; docs/schedules.md says why not p2p): the pieces are cut from the whole
sequence, and the model's `SequenceShard` then cuts each piece into its 2 x cp load-balanced chunks, so each CP
rank's tokens of a sequence are its shards of the K pieces (s / (cp K) tokens each under "length"); the attention
meets the cached earlier pieces across the CP group (model/piece_attention.py).
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple, Optional

import torch

from llamapipe.core.config import ConfigError

BALANCE_METHODS = ("flops", "length")
SLICED = ("tokens", "labels", "loss_mask", "position_ids")   # cut to the piece's tokens


class Piece(NamedTuple):
    """Piece `index` of `count` of microbatch `microbatch` (the plan's unit microbatch * count + index)."""
    microbatch: int
    index: int
    count: int


_current: Optional[Piece] = None


@contextmanager
def running(piece: Optional[Piece]) -> Iterator[None]:
    """Mark `piece` as the one whose pass runs now (None: an unsplit plan)."""
    global _current
    previous, _current = _current, piece
    try:
        yield
    finally:
        _current = previous


def current() -> Optional[Piece]:
    """The piece whose forward or backward runs now, or None outside a split plan."""
    return _current


def piece_of(unit: int, count: int) -> Piece:
    return Piece(unit // count, unit % count, count)


@dataclass(frozen=True)
class SeqSplits:
    """--num-seq-splits K with --seq1f1b-balance-method; the FLOPs model of one layer: `linear` FLOPs per token
    (projections and MLP) and `pair` FLOPs per (query, key) pair (scores and context)."""
    count: int
    method: str = "flops"
    linear: float = 1.0
    pair: float = 0.0
    align: int = 1           # every piece a multiple of this many tokens (the TP size under sequence parallelism)

    @classmethod
    def for_model(cls, count: int, method: str, hidden: int, ffn: int, heads: int, head_dim: int,
                  groups: int, align: int = 1) -> "SeqSplits":
        linear = 2 * hidden * head_dim * (2 * heads + 2 * groups) + 6 * hidden * ffn
        return cls(count, method, float(linear), float(4 * heads * head_dim), align)

    def bounds(self, seq_len: int) -> tuple[int, ...]:
        return piece_bounds(seq_len, self.count, self.method, self.linear, self.pair, self.align)


def piece_align(tp_size: int = 1, sequence_parallel: bool = False, cp_size: int = 1) -> int:
    """The multiple of tokens every piece keeps: the TP size under sequence parallelism (each rank holds s/tp of
    a piece), times 2 x CP under context parallelism (each piece is cut into the 2 x cp chunks of the
    load-balanced layout, context_parallel/sharding.py)."""
    return (tp_size if sequence_parallel else 1) * (2 * cp_size if cp_size > 1 else 1)


def piece_bounds(seq_len: int, count: int, method: str = "flops", linear: float = 1.0, pair: float = 0.0,
                 align: int = 1) -> tuple[int, ...]:
    """The K+1 boundaries 0 = b0 < b1 < ... < bK = seq_len of the pieces. "flops": piece [a, b) costs
    linear * (b - a) + pair * (b^2 - a^2) / 2 (causal), so bi solves linear * b + pair * b^2 / 2 = i/K of the
    total; boundaries are rounded to multiples of `align`, every piece keeps at least `align` tokens."""
    if count < 1 or seq_len % count or seq_len % (count * align):
        raise ConfigError(f"num_seq_splits {count} does not divide the sequence of {seq_len} tokens"
                          + (f" into pieces of multiples of {align} tokens" if align > 1 else ""), "num_seq_splits")
    if method not in BALANCE_METHODS:
        raise ConfigError(f"seq_split_balance {method} is unknown; choose one of {', '.join(BALANCE_METHODS)}",
                          "seq_split_balance")
    if method == "length" or pair == 0:
        return tuple(i * seq_len // count for i in range(count + 1))
    total = linear * seq_len + pair * seq_len ** 2 / 2
    bounds = [0]
    for i in range(1, count):
        target = total * i / count      # pair/2 b^2 + linear b - target = 0
        b = (-linear + math.sqrt(linear ** 2 + 2 * pair * target)) / pair
        b = round(b / align) * align
        bounds.append(min(max(b, bounds[-1] + align), seq_len - (count - i) * align))
    return tuple(bounds + [seq_len])


def split_batch(batch: dict, bounds: tuple[int, ...]) -> list[dict]:
    """One microbatch's pieces: every (b, s) entry of SLICED cut to the piece's tokens; `document_ids` keeps
    the prefix up to the piece's end (the documents of its keys: the cached earlier pieces and its own)."""
    pieces = []
    for a, b in zip(bounds, bounds[1:]):
        piece = {}
        for key, value in batch.items():
            if key in SLICED and isinstance(value, torch.Tensor):
                piece[key] = value[:, a:b]
            elif key == "document_ids":
                piece[key] = value[:, :b]
            else:
                piece[key] = value
        pieces.append(piece)
    return pieces


class PieceIterator:
    """Yields the K pieces of every microbatch of `iterator`, in order (the order of the units' forwards)."""

    def __init__(self, iterator: Any, splits: SeqSplits) -> None:
        self.iterator, self.splits, self.pending = iterator, splits, []

    def __iter__(self) -> "PieceIterator":
        return self

    def __next__(self) -> dict:
        if not self.pending:
            batch = next(self.iterator)
            self.pending = split_batch(batch, self.splits.bounds(batch["tokens"].shape[1]
                                                                 if "tokens" in batch else batch["labels"].shape[1]))
        return self.pending.pop(0)


def piece_iterators(data_iterator: Any, splits: SeqSplits) -> Any:
    """`data_iterator` (one, or one per chunk with None entries) with every iterator cut into pieces."""
    if isinstance(data_iterator, (list, tuple)):
        return [None if it is None else PieceIterator(it, splits) for it in data_iterator]
    return None if data_iterator is None else PieceIterator(data_iterator, splits)
