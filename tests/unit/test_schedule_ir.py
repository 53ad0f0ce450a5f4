"""The one action vocabulary (schedule_ir.KIND_SPECS, needs, sends) and the rule that only the schedule table
branches on a schedule's name."""
import ast
import pathlib

import pytest

from llamapipe.core.pipeline_parallel import builders
from llamapipe.core.pipeline_parallel.p2p_communication import needs_and_sends
from llamapipe.core.pipeline_parallel.schedule_ir import KINDS, Action, Hop, needs, sends
from llamapipe.core.pipeline_parallel.schedule_specs import SPECS

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("stage,n", [(0, 4), (1, 4), (3, 4), (0, 1)])
def test_needs_and_sends_follow_the_data_flow(stage, n):
    """F takes the previous stage's activation and passes its own on; B/BW pass gradients back; W is local."""
    prev_act = Hop("act", stage - 1, stage) if stage > 0 else None
    next_act = Hop("act", stage, stage + 1) if stage < n - 1 else None
    next_grad = Hop("grad", stage + 1, stage) if stage < n - 1 else None
    prev_grad = Hop("grad", stage, stage - 1) if stage > 0 else None
    assert (needs("F", stage, n), sends("F", stage, n)) == (prev_act, next_act)
    for kind in ("B", "BW"):
        assert (needs(kind, stage, n), sends(kind, stage, n)) == (next_grad, prev_grad)
    assert (needs("W", stage, n), sends("W", stage, n)) == (None, None)


def test_every_message_sent_is_needed_once_by_its_consumer():
    """Over a whole ZB-V plan (V placement: same-rank hand-offs and cross-rank messages), the p2p view of the
    rule pairs each send with exactly one need of the same stage, microbatch and payload."""
    plan = builders.zbv(4, 8)
    sent, needed = [], []
    for rank in range(plan.pp):
        for action in plan.actions[rank]:
            need, send = needs_and_sends(plan, rank, action)
            assert action.kind in KINDS
            needed += [need] if need is not None else []
            sent += [send] if send is not None else []
    assert sorted(sent) == sorted(needed) and len(set(sent)) == len(sent) == 2 * (plan.num_stages - 1) * 8


def test_only_the_schedule_table_branches_on_a_schedule_name():
    """No comparison against a --pipeline-schedule name outside schedule_specs.py (issue: one home per rule)."""
    names = set(SPECS)
    offenders = []
    for path in (ROOT / "llamapipe").rglob("*.py"):
        if path.name == "schedule_specs.py":
            continue
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, ast.Compare) or "placement" in ast.get_source_segment(source, node):
                continue       # "interleaved" is also a placement
            operands = [node.left, *node.comparators]
            consts = [c for o in operands for c in ([o] if isinstance(o, ast.Constant) else getattr(o, "elts", []))]
            if any(isinstance(c, ast.Constant) and c.value in names for c in consts):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []


def test_action_str_is_compact():
    assert str(Action("F", 0, 3)) == "F3" and str(Action("BW", 1, 0)) == "BW0c1"
