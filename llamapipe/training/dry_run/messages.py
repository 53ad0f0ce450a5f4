"""The dry run's pipeline messages: a communicator that matches them in this process, and their ledger.

The executor takes its communicator from `RuntimeOptions.communicator`; the dry run's takes the place of
`p2p_communication.P2PCommunicator` with the same calls. Each pipeline rank runs its step alone on meta
tensors, so a receive cannot wait for its sender: it returns a meta tensor of the shape and dtype the receiver
expects, as Megatron-LM's receivers compute it from the configuration (`get_tensor_shapes`): the hidden state
of one microbatch, (seq / cp [/ tp under sequence parallelism], micro-batch, hidden) in the model's dtype, and
for the vocabulary-parallel targets (2, micro-batch, seq / cp) in float64. The receiver then computes with it
(a gradient of the wrong shape fails in backward). Every send and every receive goes into the
`MessageLedger`; once every pipeline rank has run, `MessageLedger.problems` holds each message whose sender
sent another shape or dtype than its receiver took, and each message sent but never taken or taken but never
sent, which in the real run would hang or fail.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from llamapipe.core.pipeline_parallel.p2p_communication import Message, receive_order
from llamapipe.core.pipeline_parallel.schedule_ir import Plan

Spec = tuple[tuple[int, ...], torch.dtype]


def expected_spec(kind: str, *, seq_length: int, micro_batch: int, hidden: int, cp: int, sp_tp: int,
                  dtype: torch.dtype) -> Spec:
    """(shape, dtype) a receiver expects for a message of `kind` (`sp_tp`: tp under sequence parallelism, else 1)."""
    if kind == "targets":
        return (2, micro_batch, seq_length // cp), torch.float64
    return (seq_length // cp // sp_tp, micro_batch, hidden), dtype


@dataclass
class MessageLedger:
    """What each pipeline rank sent and took, by message; `problems` once every rank has run."""
    sent: dict[Message, Spec] = field(default_factory=dict)
    taken: dict[Message, Spec] = field(default_factory=dict)

    def problems(self) -> list[str]:
        out = []
        for msg in sorted(set(self.sent) | set(self.taken), key=lambda m: (m.microbatch, m.stage, m.kind)):
            sent, taken = self.sent.get(msg), self.taken.get(msg)
            what = f"{msg.kind} of stage {msg.stage} microbatch {msg.microbatch} from pp rank {msg.src} to {msg.dst}"
            if sent is None:
                out.append(f"{what}: received but never sent")
            elif taken is None:
                out.append(f"{what}: sent but never received")
            elif sent != taken:
                out.append(f"{what}: sent as {_spec_text(sent)}, received as {_spec_text(taken)}")
        return out

    def largest_from_peers(self, pp_rank: int) -> dict[int, int]:
        """Bytes of the largest message each peer sends to `pp_rank`."""
        out: dict[int, int] = {}
        for msg, (shape, dtype) in self.taken.items():
            if msg.dst == pp_rank:
                nbytes = torch.Size(shape).numel() * dtype.itemsize
                out[msg.src] = max(out.get(msg.src, 0), nbytes)
        return out


def _spec_text(spec: Spec) -> str:
    return f"{tuple(spec[0])} {str(spec[1]).replace('torch.', '')}"


class DryRunCommunicator:
    """`P2PCommunicator`'s calls for one rank's step on meta tensors: sends are recorded, receives return the
    expected meta tensor and are recorded; `finish` checks that every message the plan sends here was taken."""

    def __init__(self, plan: Plan, pp_rank: int, pp_ranks: tuple, pp_group, *, device: torch.device,
                 variable_seq_lengths: bool = False, actions_of: Optional[Callable] = None,
                 ledger: MessageLedger, expect: Callable[[str], Spec]) -> None:
        self.plan, self.pp_rank, self.device = plan, pp_rank, device
        self.ledger, self.expect = ledger, expect
        self._due = {msg for msgs in receive_order(plan, pp_rank, actions_of).values() for msg in msgs}
        self.largest_send: tuple[int, torch.dtype] = (0, torch.float32)

    def send(self, msg: Message, tensor: torch.Tensor) -> None:
        assert msg.src == self.pp_rank and msg.dst != self.pp_rank, msg
        self.ledger.sent[msg] = (tuple(tensor.shape), tensor.dtype)
        if tensor.numel() > self.largest_send[0]:
            self.largest_send = (tensor.numel(), tensor.dtype)

    def recv(self, msg: Message) -> torch.Tensor:
        assert msg in self._due, f"pp rank {self.pp_rank} takes {msg}, which the plan does not send it"
        self._due.discard(msg)
        shape, dtype = self.expect(msg.kind, msg.microbatch)
        self.ledger.taken[msg] = (shape, dtype)
        return torch.empty(shape, dtype=dtype, device=self.device)

    def post_ahead(self) -> None:
        """Nothing is posted ahead: a receive is matched when it is taken."""

    def flush(self) -> None:
        """Nothing is queued: a send is recorded when it is made."""

    def finish(self) -> None:
        assert not self._due, f"pp rank {self.pp_rank}: pipeline messages left unconsumed: {sorted(self._due)[:3]}"
