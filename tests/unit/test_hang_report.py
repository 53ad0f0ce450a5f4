"""The hang report from synthetic positions: who stopped first, the chain of waits, cycles, missing ranks; and the
position an executor-like sequence of hooks leaves."""
from __future__ import annotations

from llamapipe.core.pipeline_parallel.hang_report import explain, waits_on
from llamapipe.core.pipeline_parallel.position import RankPosition, describe
from llamapipe.core.pipeline_parallel.p2p_communication import Message
from llamapipe.core.pipeline_parallel.schedule_ir import Action


def pos(rank, *, current=None, last=None, wait=None, idle=10.0, iteration=3, phase="forward-backward", **coords):
    return {"rank": rank, "coords": coords or {"pp": rank}, "iteration": iteration, "phase": phase,
            "last_done": last, "current": current, "wait": wait, "idle_s": idle, "step_elapsed_s": idle + 2,
            "progress_at": 0.0}


def p2p(peer, what="gradient of mb 1 (for stage 1)"):
    return {"what": what, "peers": [peer], "collective": False}


def test_pipeline_chain_names_the_stopped_rank_and_who_waits_on_it():
    positions = [pos(0, current="B mb 1 chunk 0", last="F mb 3 chunk 0", wait=p2p(1), idle=11.0),
                 pos(1, current="F mb 2 chunk 0", last="B mb 0 chunk 0", idle=12.0),
                 pos(2, current="F mb 3 chunk 0", wait=p2p(1, "activation of mb 3 (for stage 2)"), idle=11.5),
                 pos(3, current="F mb 2 chunk 0", wait=p2p(2, "activation of mb 2 (for stage 3)"), idle=11.9)]
    report = explain(positions, 4)
    assert report["stopped"] == 1
    assert report["chain"] == [0, 2, 3]
    text = report["paragraph"]
    assert text.startswith("hang at iteration 3: rank 1 (pp 1) stopped in F mb 2 chunk 0 (last done: B mb 0 "
                           "chunk 0) and made no progress for 12 s; rank 0 (pp 0) waits in B mb 1 chunk 0 for "
                           "rank 1's gradient of mb 1 (for stage 1)")
    assert "rank 3 (pp 3) waits in F mb 2 chunk 0 for rank 2's activation" in text
    assert "\n" not in text and "Look at rank 1 first" in text


def test_collective_waits_only_on_members_that_did_not_join():
    reduction = {"what": "the gradient reduction", "peers": [0, 1, 2, 3], "collective": True}
    positions = [pos(0, wait=reduction, phase="after its forward-backward", pp=0, dp=0),
                 pos(1, wait=reduction, phase="after its forward-backward", pp=0, dp=1),
                 pos(2, wait=reduction, phase="after its forward-backward", pp=1, dp=0),
                 pos(3, last="W mb 3 chunk 0", phase="after its forward-backward", pp=1, dp=1, idle=13.0)]
    by_rank = {p["rank"]: p for p in positions}
    assert waits_on(positions[0], by_rank) == [3]
    report = explain(positions, 4)
    assert report["stopped"] == 3 and report["chain"] == [0, 1, 2]
    assert ("rank 3 (pp 1, dp 1) stopped after its forward-backward (last done: W mb 3 chunk 0)"
            in report["paragraph"])
    assert "rank 0 (pp 0, dp 0) waits in the gradient reduction for rank 3, which did not join it" in \
        report["paragraph"]


def test_cp_ring_neighbours_and_a_missing_rank():
    ring = {"what": "keys/values in the context-parallel ring", "peers": [1], "collective": False}
    report = explain([pos(0, current="F mb 1 chunk 0", wait=ring, cp=0)], 2)
    assert report["stopped"] == 1 and report["missing"] == [1]
    assert "rank 1 sent no position" in report["paragraph"]
    assert "rank 0 (cp 0) waits in F mb 1 chunk 0 for rank 1's keys/values" in report["paragraph"]


def test_several_stopped_ranks_the_one_idle_longest_is_first_and_a_cycle_is_named():
    report = explain([pos(0, current="F mb 0 chunk 0", idle=5.0), pos(1, current="F mb 1 chunk 0", idle=9.0)], 2)
    assert report["stopped"] == 1 and "not waiting on it: rank 0 (pp 0) stopped in F mb 0" in report["paragraph"]
    cycle = explain([pos(0, current="F mb 1 chunk 0", wait=p2p(1)), pos(1, current="B mb 0 chunk 0", wait=p2p(0))],
                    2)
    assert cycle["stopped"] is None and cycle["cycle"] == [0, 1]
    assert "in a cycle" in cycle["paragraph"] and "deadlock" in cycle["paragraph"]


def test_position_follows_the_executor_hooks():
    position = RankPosition(rank=5, coords={"pp": 1}, pp_ranks=(1, 5))
    position.begin_iteration(4)
    position.step_begin(None, 1, False)
    f = Action("F", 0, 2)
    position.action_begin(f)
    position.message_waiting(Message("act", 1, 2, 0, 1))
    snap = position.snapshot()
    assert snap["current"] == describe(f) == "F mb 2 chunk 0" and snap["iteration"] == 4
    assert snap["wait"] == {"what": "activation of mb 2 (for stage 1)", "peers": [1], "collective": False}
    position.message_received(None, 0.0)
    position.action_done(f, 0.0, 0.0, 0.0)
    with position.waiting("the gradient reduction", [1, 5, 9], collective=True):
        assert position.snapshot()["wait"]["peers"] == [1, 9]
    snap = position.snapshot()
    assert snap["last_done"] == "F mb 2 chunk 0" and snap["current"] is None and snap["wait"] is None
