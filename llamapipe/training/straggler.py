"""--log-straggler: the slowest and fastest ranks of every logging interval, and a straggler named.

Megatron-LM's `--log-straggler` (megatron.core.utils.StragglerDetector) times each rank's GEMMs with CUDA
events and logs, every log interval, the ranks of lowest and highest throughput (`--straggler-minmax-count` of
each). Here the measure is each rank's compute for its share of the plan: the per-rank timers' "actions"
(`core/pipeline_parallel/step_timers.py`: the plan's F/B/W/S/T actions without their message waits; not the
optimizer, whose collectives wait for the other ranks), so time spent waiting for a slow peer does not make a
rank look slow. Ranks doing the same work
(the data-parallel replicas of one stage) are compared directly; ranks of different stages are compared
through the plan's expected cost of their share (`expected_work`: the analytic FLOPs of their decoder layers,
embedding and output layer, stage_balance.analytic_parts), since a stage with more layers is slower by design.

Every interval rank 0 reports the slowest and fastest ranks by compute per expected cost and their ratio
(log line, JSONL, TensorBoard). A rank is *named* a straggler when its compute exceeds the fastest of its
data-parallel replicas by `--straggler-threshold` (or, at data-parallel size 1, the stages' expected-cost ratio
by `CROSS_STAGE_MARGIN` times that, since the expected costs are a model) in `CONSECUTIVE` intervals in a row:
one noisy interval on a loaded machine names nobody.
"""
from __future__ import annotations

from typing import Optional

import torch

from llamapipe.core.logger import get_logger
from llamapipe.core.pipeline_parallel.stage_balance import ELEMENT_FLOPS, analytic_parts

log = get_logger()

CONSECUTIVE = 3             # intervals in a row the same rank must be the straggler before it is named
CROSS_STAGE_MARGIN = 1.5    # across stages the expected costs are a model: a straggler must be this much plainer


def expected_work(model_cfg, chunks: list[torch.nn.Module], roles: list[tuple[bool, bool]], *, pp: int,
                  tp: int, seq_length: int, micro_batch: int, vocab_parallel: bool, device: str) -> float:
    """This rank's F + B + W per microbatch in analytic FLOPs (relative units): its chunks' decoder layers, the
    embedding where it has stage 0, the output layer + loss where it has the last (or 1/pp of both under
    vocabulary parallelism)."""
    parts = analytic_parts(hidden=model_cfg.hidden_size, ffn_hidden=model_cfg.ffn_hidden_size,
                           heads=model_cfg.num_attention_heads, kv_heads=model_cfg.num_query_groups,
                           head_dim=model_cfg.head_dim, vocab=model_cfg.padded_vocab_size(tp),
                           seq_length=seq_length, micro_batch=micro_batch,
                           element_flops=ELEMENT_FLOPS.get(device, ELEMENT_FLOPS["cpu"]))
    total = {name: c.f + c.b + c.w for name, c in parts.items()}
    layers = sum(len(getattr(chunk, "layers", ())) for chunk in chunks)
    work = layers * total["layer"]
    if vocab_parallel and pp > 1:
        return work + (total["embedding"] + total["head"]) / pp
    return work + sum(total["embedding"] * pre + total["head"] * post for pre, post in roles)


class StragglerDetector:
    """Rank 0's view of the ranks' compute over each interval (`fields`), with the memory of who was the
    straggler candidate in the intervals before."""

    def __init__(self, stage_of: list[tuple], minmax_count: int = 1, threshold: float = 1.1) -> None:
        self.stage_of = stage_of            # per global rank: its coordinates but dp (replicas share them)
        self.count = max(1, minmax_count)
        self.threshold = threshold
        self._candidate: Optional[int] = None
        self._streak = 0
        self.named: list[tuple[int, int, float]] = []   # (interval, rank, ratio) of every naming

    def fields(self, ranks: list[dict]) -> dict:
        """Record fields for the interval whose per-rank sums (with "expected") are `ranks`."""
        per_iter = [r["actions"] / r["iterations"] if r["iterations"] else 0.0 for r in ranks]
        rel = [c / r["expected"] if r.get("expected", 0) > 0 else c for c, r in zip(per_iter, ranks)]
        base = min(rel) or 1.0
        order = sorted(range(len(rel)), key=lambda r: rel[r])
        fields = {"straggler_slowest_rank": order[-1], "straggler_fastest_rank": order[0],
                  "straggler_ratio": rel[order[-1]] / base,
                  "straggler_slowest": [[r, rel[r] / base] for r in reversed(order[-self.count:])],
                  "straggler_fastest": [[r, rel[r] / base] for r in order[:self.count]],
                  "straggler_compute_ms": [1e3 * c for c in per_iter]}
        candidate, ratio, replicas = self._candidate_of(per_iter, rel)
        fields["straggler_replica_ratio"] = replicas
        if candidate is not None and candidate == self._candidate:
            self._streak += 1
        else:
            self._candidate, self._streak = candidate, int(candidate is not None)
        named = self._candidate if self._streak >= CONSECUTIVE else None
        fields["straggler_rank"] = -1 if named is None else named
        if named is not None:
            fields["straggler_named_ratio"] = ratio
            no_replicas = len(set(self.stage_of)) == len(self.stage_of)     # then stages by their expected costs
            fields["straggler_named_against"] = "stages" if no_replicas else "replicas"
            self.named.append((len(self.named), named, ratio))
        return fields

    def _candidate_of(self, per_iter: list[float], rel: list[float]) -> tuple[Optional[int], float, float]:
        """(the rank over the threshold this interval or None, its ratio, the largest replica ratio)."""
        groups: dict[tuple, list[int]] = {}
        for rank, key in enumerate(self.stage_of):
            groups.setdefault(key, []).append(rank)
        best, best_ratio = None, 1.0
        for members in (m for m in groups.values() if len(m) > 1):
            fastest = min(per_iter[r] for r in members) or 1e-12
            for r in members:
                if per_iter[r] / fastest > best_ratio:
                    best, best_ratio = r, per_iter[r] / fastest
        if best is not None and best_ratio >= self.threshold:
            return best, best_ratio, best_ratio
        if all(len(m) == 1 for m in groups.values()) and len(rel) > 1:
            slowest = max(range(len(rel)), key=lambda r: rel[r])
            cross = rel[slowest] / (min(rel) or 1e-12)
            if cross >= self.threshold * CROSS_STAGE_MARGIN:
                return slowest, cross, best_ratio
        return None, 0.0, best_ratio


def line_part(record: dict) -> Optional[str]:
    """The log line's straggler field ("straggler: rank 3 named, 1.21x ...") or None without the fields."""
    if "straggler_ratio" not in record:
        return None
    text = (f"slowest rank {record['straggler_slowest_rank']} {record['straggler_ratio']:.2f}x fastest rank "
            f"{record['straggler_fastest_rank']}")
    if record.get("straggler_rank", -1) >= 0:
        against = ("the fastest stage's compute per unit of the plan's expected cost"
                   if record.get("straggler_named_against") == "stages" else
                   "the compute of the fastest rank doing its work")
        text = (f"STRAGGLER rank {record['straggler_rank']} ({record['straggler_named_ratio']:.2f}x {against}, "
                f"{CONSECUTIVE} intervals in a row), " + text)
    return "straggler: " + text
