"""One pipeline trace: what every rank's executor did, as Chrome trace events on one clock.

`TraceRecorder` is a `runtime.StepObserver`. While it records (the iterations the training loop asks for) it
keeps, per action of the plan, a complete event on the rank's "compute" track (F0.3: kind, chunk, microbatch)
preceded by the time the action waited for its messages on a "waiting" track, the executor's communication
calls between actions on a "communication" track, the phases outside the plan (the vocabulary-parallel
embedding), and a flow event from each message's sending action to its receiving action (Perfetto and
chrome://tracing draw them as arrows). Times are microseconds from a point all ranks agree on (`common_zero`:
rank 0's clock, each rank's offset to it measured by exchanging timestamps), so the ranks' events merge onto one
clock without a shared wall clock, also across machines.

The events of all ranks are merged by `gather_events` (a JSON byte payload per rank, no pickle); what the
training side writes to a file and the `plot-trace` tool reads is in training/trace_log.py.
"""
from __future__ import annotations

import json
import time
import zlib
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist

from llamapipe.core.pipeline_parallel.p2p_communication import Message
from llamapipe.core.pipeline_parallel.runtime import StepObserver

if TYPE_CHECKING:
    from llamapipe.core.pipeline_parallel.schedule_ir import Action, Plan

TRACKS = {"compute": 0, "waiting": 1, "communication": 2, "iteration": 3}


class TraceRecorder(StepObserver):
    """Chrome trace events of this rank's steps while `recording`; `pp_ranks` are the global ranks of this rank's
    pipeline (message arrows name both ends by global rank)."""

    def __init__(self, rank: int, pp_ranks: tuple[int, ...]) -> None:
        self.rank, self.pp_ranks = rank, pp_ranks
        self.events: list[dict] = []
        self.plans: dict[str, dict] = {}        # plan key -> Plan.to_json(), for the plan beside the trace
        self.steps: list[dict] = []             # per recorded step: iteration, plan key, start, end (us)
        self.recording = False
        self.iteration = 0
        self._zero = time.perf_counter()
        self._timed = False

    def start(self, iteration: int, zero: Optional[float] = None) -> None:
        """Record from the next step on, for training iteration `iteration` (`zero`: the common time origin)."""
        if zero is not None:
            self._zero = zero
        self.recording, self.iteration = True, iteration

    def stop(self) -> None:
        self.recording = False

    def _us(self, t: float) -> float:
        return round((t - self._zero) * 1e6, 3)

    def _event(self, track: str, name: str, start: float, end: float, **args: Any) -> None:
        self.events.append({"ph": "X", "pid": self.rank, "tid": TRACKS[track], "name": name, "ts": self._us(start),
                            "dur": max(self._us(end) - self._us(start), 0.0), "args": args})

    def step_begin(self, plan: "Plan", pp_rank: int, forward_only: bool) -> None:
        self._timed = self.recording and not forward_only
        if not self._timed:
            return
        key = f"{plan.name}/{plan.pp}/{plan.vpp}/{plan.num_microbatches}/{int(plan.vocab)}"
        self.plans.setdefault(key, plan.to_json())
        self.steps.append({"iteration": self.iteration, "plan": key, "start": self._us(time.perf_counter())})

    def action_done(self, action: "Action", start: float, end: float, blocked_s: float) -> None:
        if not self._timed:
            return
        wait_end = start + blocked_s
        if blocked_s > 0:
            self._event("waiting", f"wait {action.kind}{action.chunk}.{action.microbatch}", start, wait_end)
        name = f"{action.kind}{action.chunk}.{action.microbatch}"
        self._event("compute", name, wait_end, end, kind=action.kind, chunk=action.chunk, mb=action.microbatch,
                    iteration=self.iteration, wait_ms=round(blocked_s * 1e3, 4))

    def comm_done(self, what: str, start: float, end: float) -> None:
        if self._timed and end - start > 2e-6:     # an empty post is no event worth drawing
            self._event("communication", what, start, end)

    def phase_done(self, what: str, start: float, end: float, blocked_s: float) -> None:
        if self._timed:
            self._event("compute", what, start, end, iteration=self.iteration, wait_ms=round(blocked_s * 1e3, 4))

    def step_end(self, largest_send: tuple[int, torch.dtype]) -> None:
        if self._timed:
            self.steps[-1]["end"] = self._us(time.perf_counter())
        self._timed = False

    def message_sent(self, msg: Message, when: float) -> None:
        if self._timed:
            self._flow("s", msg, when)

    def message_received(self, msg: Message, when: float) -> None:
        if self._timed:
            self._flow("f", msg, when)

    def _flow(self, phase: str, msg: Message, t: float) -> None:
        src, dst = self.pp_ranks[msg.src], self.pp_ranks[msg.dst]
        ident = zlib.crc32(f"{self.iteration}/{src}/{dst}/{msg.kind}/{msg.stage}/{msg.microbatch}".encode())
        event = {"ph": phase, "pid": self.rank, "tid": TRACKS["compute"], "name": msg.kind, "cat": "message",
                 "id": ident, "ts": self._us(t)}
        if phase == "f":
            event["bp"] = "e"     # bind to the enclosing slice: the receiving action
        self.events.append(event)

    def payload(self, name: str = "") -> dict:
        """What this rank contributes to the merged trace (`name`: how the trace names the rank)."""
        return {"rank": self.rank, "pp_rank": self.pp_ranks.index(self.rank), "name": name or f"rank {self.rank}",
                "events": self.events, "plans": self.plans, "steps": self.steps}


def common_zero(rounds: int = 32) -> float:
    """A time origin all ranks share, in this rank's `time.perf_counter()`: rank 0's clock now, shifted by this
    rank's clock offset to rank 0, measured NTP-style (rank r and rank 0 exchange timestamps `rounds` times; the
    round with the shortest round trip gives the offset, good to about half of it; 32 rounds, a few milliseconds
    once per trace, so that a loaded machine still gets a short one). A barrier alone would leave the
    ranks as far apart as they leave the barrier (a millisecond on a loaded machine). Collective over the world."""
    if not dist.is_initialized():
        return time.perf_counter()
    rank, offset = dist.get_rank(), 0.0
    for peer in range(1, dist.get_world_size()):
        if rank == 0:
            _serve_clock(peer, rounds)
        elif rank == peer:
            offset = _clock_offset(rounds)
    zero = torch.tensor([time.perf_counter()], dtype=torch.float64)
    dist.broadcast(zero, src=0)
    return float(zero) + offset


def _serve_clock(peer: int, rounds: int) -> None:
    stamp = torch.zeros(2, dtype=torch.float64)
    for _ in range(rounds):
        dist.recv(stamp[:1], src=peer)
        stamp[0] = stamp[1] = time.perf_counter()
        dist.send(stamp, dst=peer)


def _clock_offset(rounds: int) -> float:
    """This rank's clock minus rank 0's, from the round with the shortest round trip."""
    best_rtt, best = float("inf"), 0.0
    stamp = torch.zeros(2, dtype=torch.float64)
    for _ in range(rounds):
        sent = time.perf_counter()
        dist.send(torch.tensor([sent], dtype=torch.float64), dst=0)
        dist.recv(stamp, src=0)
        back = time.perf_counter()
        rtt = (back - sent) - float(stamp[1] - stamp[0])
        if rtt < best_rtt:
            best_rtt, best = rtt, (sent + back) / 2 - float(stamp[0] + stamp[1]) / 2
    return best


def gather_events(payload: dict, dst: int = 0) -> Optional[list[dict]]:
    """Every rank's `payload()` on global rank `dst` (None elsewhere), as JSON bytes in uint8 tensors."""
    data = json.dumps(payload).encode()
    if not dist.is_initialized():
        return [payload]
    size = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, size)
    longest = int(max(s.item() for s in sizes))
    buffer = torch.zeros(longest, dtype=torch.uint8)
    buffer[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else buffer[:0]
    gathered = [torch.zeros(longest, dtype=torch.uint8) for _ in sizes] if dist.get_rank() == dst else None
    dist.gather(buffer, gathered, dst=dst)
    if gathered is None:
        return None
    return [json.loads(t[:int(n.item())].numpy().tobytes().decode()) for t, n in zip(gathered, sizes)]
