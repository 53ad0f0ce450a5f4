"""DualPipeV: DeepSeek's DualPipe folded into a V (two chunks per rank), as torch.distributed.pipelining's
ScheduleDualPipeV orders it.

Why: DualPipe (DeepSeek-V3 technical report, arXiv 2412.19437, section 3.2.1) feeds microbatches from both ends
of the pipeline so that in the steady state every rank runs the forward of one microbatch next to the backward of
another ("F&B" pairs), whose communication each other's compute can hide. Folded onto the V placement (chunk 0 =
stage r, chunk 1 = stage 2p-1-r, as ZB-V) it needs one copy of the weights, not two. Rank r runs eight phases:
2(p-r-1) chunk-0 F's; r+1 pairs (F chunk 0, F chunk 1); p-r-1 rounds B W F on chunk 1 (zero bubble); the main
phase of m-2p+r+1 rounds of two F&B pairs (F chunk 0 with BW chunk 1, F chunk 1 with BW chunk 0; the last rank
runs its first pair unpaired); p-r-1 rounds BW chunk 1 and an F&B pair; r+1 rounds of both chunks' backward,
the second half split into B (zero bubble); p-r-1 rounds W B on chunk 0, then the remaining W's, oldest first.

In this plan IR an F&B pair is two consecutive actions, F then BW: the executor runs them one after the other
(as torch's runtime does without a custom overlap function), so the overlap of their compute and communication
that DualPipe is designed for is not modelled by the simulator nor done by the executor. torch needs m >= 2p;
smaller m are built for 2p and the phantom microbatches dropped (as zbv does), which keeps the plan valid.
"""
from __future__ import annotations

from llamapipe.core.config import ConfigError
from llamapipe.core.pipeline_parallel.schedule_ir import Action, Plan

__all__ = ["dualpipev"]


class _Rank:
    """One rank's action list with torch's counters: the next microbatch of each (kind, chunk), and the B's
    whose W is still due (oldest first)."""

    def __init__(self) -> None:
        self.actions: list[Action] = []
        self.next: dict[tuple[str, int], int] = {}
        self.pending_w: list[tuple[int, int]] = []

    def add(self, kind: str, chunk: int) -> None:
        key = ("F", chunk) if kind == "F" else ("B", chunk)     # B and BW share the backward counter
        mb = self.next.get(key, 0)
        self.next[key] = mb + 1
        self.actions.append(Action(kind, chunk, mb))
        if kind == "B":
            self.pending_w.append((chunk, mb))

    def pair(self, f_chunk: int, b_chunk: int) -> None:
        """An F&B pair: the forward of one chunk, then the fused backward of the other."""
        self.add("F", f_chunk)
        self.add("BW", b_chunk)

    def w(self) -> None:
        if self.pending_w:
            chunk, mb = self.pending_w.pop(0)
            self.actions.append(Action("W", chunk, mb))


def _rank_actions(pp: int, m: int, rank: int) -> list[Action]:
    st, last = _Rank(), rank == pp - 1
    for _ in range(2 * (pp - rank - 1)):
        st.add("F", 0)
    for _ in range(rank + 1):
        st.add("F", 0), st.add("F", 1)
    for _ in range(pp - rank - 1):
        st.add("B", 1), st.w(), st.add("F", 1)
    for i in range(m - 2 * pp + rank + 1):
        if i == 0 and last:             # torch: not overlapped, to shorten the bubble
            st.add("F", 0), st.add("BW", 1)
        else:
            st.pair(0, 1)
        st.pair(1, 0)
    for _ in range(pp - rank - 1):
        st.add("BW", 1), st.pair(1, 0)
    split = False                       # the second half of these backwards is split into B and W
    for i in range(rank + 1):
        split = split or (i == (rank + 1) // 2 and rank % 2 == 1)
        st.add("B" if split else "BW", 1)
        split = split or (i == (rank + 1) // 2 and rank % 2 == 0)
        st.add("B" if split else "BW", 0)
    for _ in range(pp - rank - 1):
        st.w(), st.add("B" if split else "BW", 0)
    while st.pending_w:
        st.w()
    return st.actions


def dualpipev(pp: int, m: int) -> Plan:
    """DualPipeV on pp ranks with two chunks each (V placement) for m microbatches."""
    if pp < 1 or m < 1:
        raise ConfigError(f"pipeline_schedule dualpipev needs pipeline size ({pp}) and microbatches ({m}) of at "
                          "least 1", "pipeline_schedule")
    n = max(m, 2 * pp)
    actions = tuple(tuple(a for a in _rank_actions(pp, n, rank) if a.microbatch < m) for rank in range(pp))
    return Plan("dualpipev", pp, 2, m, "v", actions)
