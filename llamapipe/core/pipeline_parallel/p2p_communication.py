"""Point-to-point transfer of activations and gradients between virtual pipeline stages.

Every message is derived from the plan (docs/design.md section 3): an F on virtual stage v sends its output
to stage v+1, a B (or BW) on stage v sends the input gradient to stage v-1. Because the plan is global,
each rank knows the exact order in which every peer sends to it and posts its receives in that order;
this is what NCCL needs (it matches per peer by order), and every message also carries a unique tag,
which is what gloo matches by. Sends never block (isend) and a receive is waited only when its action
needs it, so a plan that the simulator accepts cannot deadlock. Receives are posted ahead of need
(`lookahead` per peer) so transfers overlap compute; ops of one step go out in one `batch_isend_irecv`
(Megatron-LM, arXiv 2104.04473).

Shapes: the first message of a step on each channel (peer, direction, stage) is preceded by a small
header with its shape and dtype, which the receiver caches; with `variable_seq_lengths` every message
carries a header. The receiver only posts a payload once its shape is known, and headers travel in
the same per-peer order as payloads, so shape exchange adds no deadlock.

A vocabulary-parallel plan (arXiv 2411.05288) adds messages that `vocab_messages` derives from
`schedule_ir.vocab_needs`: the last stage's F sends its normed hidden state and its targets to every rank's S,
and every rank's T sends its partial input gradient to the last stage's B; they travel like the others.
"""
from __future__ import annotations


import time
import weakref
from collections import deque
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from llamapipe.core.pipeline_parallel.schedule_ir import BACKWARD_KINDS, Action, Hop, Plan, needs, sends

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32)
_MAX_DIMS = 8
_HEADER_LEN = _MAX_DIMS + 2          # ndim, dims..., dtype code
MESSAGE_KINDS = ("act", "grad", "hidden", "targets", "vgrad")


class Message(NamedTuple):
    kind: str          # "act" (forward output), "grad" (input gradient) or a vocabulary message (`vocab_messages`)
    stage: int         # virtual stage that consumes it
    microbatch: int
    src: int           # sending pipeline rank
    dst: int           # receiving pipeline rank (== src: local hand-off, no transfer)

    def tag(self, num_stages: int, header: bool) -> int:
        kinds = len(MESSAGE_KINDS)
        return ((self.microbatch * num_stages + self.stage) * kinds + MESSAGE_KINDS.index(self.kind)) * 2 + header


def needs_and_sends(plan: Plan, pp_rank: int, action: Action) -> tuple[Optional[Message], Optional[Message]]:
    """(message this action consumes, message it produces); None where there is none (`schedule_ir.needs`/`sends`)."""
    stage = plan.stage_of(pp_rank, action.chunk)

    def message(hop: Optional[Hop]) -> Optional[Message]:
        if hop is None:
            return None
        return Message(hop.payload, hop.dst, action.microbatch, plan.rank_chunk_of(hop.src)[0],
                       plan.rank_chunk_of(hop.dst)[0])

    return (message(needs(action.kind, stage, plan.num_stages)),
            message(sends(action.kind, stage, plan.num_stages)))


def vocab_messages(plan: Plan, pp_rank: int, action: Action) -> tuple[list[Message], list[Message]]:
    """(messages consumed, messages produced) by `action` for the output layer's S/T in a vocabulary plan:
    the last stage's F sends its hidden state and targets to every rank (itself included, as a local hand-off),
    S consumes them, T sends its partial input gradient to the last stage, whose B consumes every rank's."""
    if not plan.vocab:
        return [], []
    last = plan.num_stages - 1
    last_rank, mb = plan.rank_chunk_of(last)[0], action.microbatch
    on_last = plan.stage_of(pp_rank, action.chunk) == last
    if action.kind == "F" and on_last:
        return [], [Message(kind, last, mb, pp_rank, r) for r in range(plan.pp) for kind in ("hidden", "targets")]
    if action.kind == "S":
        return [Message(kind, last, mb, last_rank, pp_rank) for kind in ("hidden", "targets")], []
    if action.kind == "T":
        return [], [Message("vgrad", last, mb, pp_rank, last_rank)]
    if action.kind in BACKWARD_KINDS and on_last:
        return [Message("vgrad", last, mb, r, pp_rank) for r in range(plan.pp)], []
    return [], []


def receive_order(plan: Plan, pp_rank: int, actions_of=None) -> dict[int, list[Message]]:
    """For each peer, the messages it sends to `pp_rank`, in the peer's action order. The plan's own actions are
    walked once for every rank together (`_receive_orders`, cached): walking every peer for each rank made a
    pp-1000 plan quadratic."""
    if actions_of is None:
        return _receive_orders(plan).get(pp_rank, {})
    return _orders(plan, actions_of, range(plan.pp)).get(pp_rank, {})


_ORDERS: dict[int, tuple] = {}     # id(plan) -> (weak reference to it, its orders): hashing a big plan per call costs


def _receive_orders(plan: Plan) -> dict[int, dict[int, list[Message]]]:
    cached = _ORDERS.get(id(plan))
    if cached is None or cached[0]() is not plan:
        cached = (weakref.ref(plan), _orders(plan, lambda r: plan.actions[r], range(plan.pp)))
        _ORDERS[id(plan)] = cached
        weakref.finalize(plan, _ORDERS.pop, id(plan), None)
    return cached[1]


def _orders(plan: Plan, actions_of, peers) -> dict[int, dict[int, list[Message]]]:
    """dst -> peer -> the messages peer sends to dst, in peer's action order (a rank's messages to itself left out)."""
    order: dict[int, dict[int, list[Message]]] = {}
    for peer in peers:
        for action in actions_of(peer):
            _, send = needs_and_sends(plan, peer, action)
            for msg in ([send] if send is not None else []) + vocab_messages(plan, peer, action)[1]:
                if msg.dst != peer:
                    order.setdefault(msg.dst, {}).setdefault(peer, []).append(msg)
    return order


class _Recv:
    """One receive: optional header, then payload once the shape is known."""
    __slots__ = ("msg", "header", "header_work", "shape", "dtype", "buffer", "works")

    def __init__(self, msg: Message) -> None:
        self.msg, self.header, self.header_work = msg, None, None
        self.shape, self.dtype, self.buffer, self.works = None, None, None, []


class P2PCommunicator:
    """Sends and receives of one pipeline rank for one step of `plan` (shapes are cached per step)."""

    def __init__(self, plan: Plan, pp_rank: int, pp_ranks: tuple, pp_group, *, device: torch.device,
                 variable_seq_lengths: bool = False, lookahead: int = 2, actions_of=None) -> None:
        self.plan, self.pp_rank, self.pp_ranks, self.group = plan, pp_rank, pp_ranks, pp_group
        self.device, self.variable, self.lookahead = device, variable_seq_lengths, lookahead
        self._queue = {peer: deque(msgs) for peer, msgs in receive_order(plan, pp_rank, actions_of).items()}
        self._posted: dict[Message, _Recv] = {}
        self._ahead = {peer: 0 for peer in self._queue}        # posted, not yet consumed, per peer
        self._recv_shape: dict[tuple, tuple] = {}               # channel -> (shape, dtype)
        self._sent_shape: dict[tuple, tuple] = {}
        self._ops: list[tuple[dist.P2POp, Optional[_Recv]]] = []
        self._send_works: list = []
        self._header_pending: dict[int, _Recv] = {}              # peer -> receive waiting for its header
        self.largest_send: tuple[int, torch.dtype] = (0, torch.float32)   # (numel, dtype): for measure_latency

    @staticmethod
    def _channel(msg: Message, peer: int) -> tuple:
        return peer, msg.kind, msg.stage

    def send(self, msg: Message, tensor: torch.Tensor) -> None:
        """Queue `tensor` for `msg.dst`; goes out at the next `flush()`. The tensor must not be modified."""
        assert msg.src == self.pp_rank and msg.dst != self.pp_rank, msg
        assert tensor.dim() <= _MAX_DIMS and tensor.dtype in _DTYPES, (tensor.shape, tensor.dtype)
        channel, meta = self._channel(msg, msg.dst), (tuple(tensor.shape), tensor.dtype)
        if self.variable or channel not in self._sent_shape:
            self._sent_shape[channel] = meta
            header = torch.zeros(_HEADER_LEN, dtype=torch.int64, device=self.device)
            header[0], header[-1] = tensor.dim(), _DTYPES.index(tensor.dtype)
            header[1:1 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
            self._add_op(dist.isend, header, msg.dst, msg.tag(self.plan.num_stages, True), None)
        elif self._sent_shape[channel] != meta:
            raise ValueError(f"pipeline message shape changed within a step from {self._sent_shape[channel][0]} "
                             f"to {tuple(tensor.shape)}; pass variable_seq_lengths=True")
        self._add_op(dist.isend, tensor.detach().contiguous(), msg.dst, msg.tag(self.plan.num_stages, False), None)
        if tensor.numel() > self.largest_send[0]:
            self.largest_send = (tensor.numel(), tensor.dtype)

    def recv(self, msg: Message) -> torch.Tensor:
        """Block until `msg` has arrived and return it (posting receives up to it in peer order)."""
        peer = msg.src
        while msg not in self._posted:
            self._post(peer, block=True)
            self.flush()
        entry = self._posted.pop(msg)
        for work in entry.works:
            work.wait()
        self._ahead[peer] -= 1
        return entry.buffer

    def post_ahead(self) -> None:
        """Post the next receives from every peer without waiting; ops go out at `flush()`."""
        for peer in self._queue:
            while self._ahead[peer] < self.lookahead and self._post(peer, block=False):
                pass

    def flush(self) -> None:
        """Issue all queued sends and receives in one batch."""
        if not self._ops:
            return
        ops, entries = zip(*self._ops)
        self._ops = []
        works = dist.batch_isend_irecv(list(ops))
        per_op = len(works) == len(ops)        # coalescing backends return one work per batch
        for i, (op, entry) in enumerate(zip(ops, entries)):
            mine = [works[i]] if per_op else list(works)
            if entry is None:
                self._send_works.extend(mine)
            elif entry.header_work is True:
                entry.header_work = mine
            else:
                entry.works = mine
        self._send_works = [w for w in self._send_works if not w.is_completed()]

    def finish(self) -> None:
        """Wait for every send; every expected message must have been consumed."""
        self.flush()
        for work in self._send_works:
            work.wait()
        self._send_works = []
        assert not self._posted and not any(self._queue.values()), "pipeline messages left unconsumed"

    def _add_op(self, op, tensor: torch.Tensor, dst_pp_rank: int, tag: int, entry: Optional[_Recv]) -> None:
        self._ops.append((dist.P2POp(op, tensor, self.pp_ranks[dst_pp_rank], self.group, tag), entry))

    def _post(self, peer: int, block: bool) -> bool:
        """Advance the peer's receive queue by one step; False when nothing could be posted now."""
        entry = self._header_pending.get(peer)
        if entry is None:
            if not self._queue[peer]:
                return False
            msg = self._queue[peer][0]
            entry = _Recv(msg)
            known = self._recv_shape.get(self._channel(msg, peer))
            if known is not None and not self.variable:
                entry.shape, entry.dtype = known
            else:
                entry.header = torch.empty(_HEADER_LEN, dtype=torch.int64, device=self.device)
                entry.header_work = True          # filled by flush()
                self._add_op(dist.irecv, entry.header, peer, msg.tag(self.plan.num_stages, True), entry)
                self._header_pending[peer] = entry
                return True
        if entry.shape is None:
            self.flush()
            if not block and not all(w.is_completed() for w in entry.header_work):
                return False
            for work in entry.header_work:
                work.wait()
            h = entry.header.tolist()
            entry.shape, entry.dtype = tuple(h[1:1 + h[0]]), _DTYPES[h[-1]]
            self._recv_shape[self._channel(entry.msg, peer)] = (entry.shape, entry.dtype)
            del self._header_pending[peer]
        self._queue[peer].popleft()
        entry.buffer = torch.empty(entry.shape, dtype=entry.dtype, device=self.device)
        self._add_op(dist.irecv, entry.buffer, peer, entry.msg.tag(self.plan.num_stages, False), entry)
        self._posted[entry.msg] = entry
        self._ahead[peer] += 1
        return True


def measure_latency(pp_rank: int, pp_ranks: tuple, pp_group, *, nbytes: int, device: torch.device,
                    rounds: int = 10, reduce_group=None) -> float:
    """One-way seconds to move `nbytes` between neighbouring pipeline ranks: every pair (r, r+1) in
    turn ping-pongs `rounds` times after one warm-up; the slowest pair, as MAX over `reduce_group`
    (default `pp_group`). The simulator's `comm` cost (`auto` and `zb-h2` measure it after profiling).
    Every rank of `pp_group` must call it with the same `nbytes`."""
    buf = torch.zeros(max(int(nbytes), 1), dtype=torch.uint8, device=device)
    slowest = 0.0

    def sync() -> None:
        if buf.is_cuda:
            torch.cuda.synchronize(buf.device)
    for left in range(len(pp_ranks) - 1):
        if pp_rank not in (left, left + 1):
            continue
        peer, first = pp_ranks[left + 1 if pp_rank == left else left], pp_rank == left
        start = 0.0
        for i in range(rounds + 1):
            if i == 1:
                sync()
                start = time.perf_counter()
            if first:
                dist.send(buf, peer, group=pp_group)
                dist.recv(buf, peer, group=pp_group)
            else:
                dist.recv(buf, peer, group=pp_group)
                dist.send(buf, peer, group=pp_group)
        sync()
        slowest = max(slowest, (time.perf_counter() - start) / (2 * rounds))
    result = torch.tensor([slowest], dtype=torch.float64, device=device)
    dist.all_reduce(result, op=dist.ReduceOp.MAX, group=pp_group if reduce_group is None else reduce_group)
    return float(result)
