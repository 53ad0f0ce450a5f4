"""A step's time predicted from a measured profile (`llamapipe profile`), for `llamapipe plan --profile`.

Per virtual stage, the pass times are the sum of its parts as measured: its decoder layers, the embedding on
the first stage, the output layer and loss on the last (`profile_costs.stage_costs`), or with vocabulary
parallelism (arXiv 2411.05288) the output layer split over every rank as the S/T actions and the embedding's
shards run on every rank before and after the plan (`embedding_passes_s`, as `vocab_runtime` runs them). Under tensor
parallelism every part's compute is divided by tp and each layer's F and B (and B's recomputed forward under
full recompute) pay two tp all-reduces of the (s, b, h) activations at the measured all-reduce bandwidth. The
schedule's plan (for zb-h2 the one fitted to the slowest stage's costs, as at run time) is simulated with these costs
and the measured p2p time of one activation message; the step is its makespan (with post-validation the
longest stage span), plus the optimizer step of the most loaded rank (measured seconds per parameter) and
the data-parallel gradient all-reduce (4 bytes per parameter, ring over dp at the measured bus bandwidth).
The runtime's overhead as `profile_overhead` measured it enters twice: its cost per action is part of every
simulated action (so it adds up along the critical path as at run time), plus, per p2p message the action
receives or sends to another rank, what an action of the measured pipeline cost beyond it; and its cost per iteration and per
parameter of the most loaded rank is added to the step (`overhead_s`).

On a CPU, ranks share the machine's cores: with more threads in all (ranks x the profile's threads per rank)
than cores, every compute time is stretched by that ratio (`oversubscription`).

`balanced_counts` is the split of layers over the virtual stages that `plan` picks: starting from the even
split, it moves one layer at a time off the most loaded pipeline rank (F + B + W of all its chunks) while that
lowers the busiest rank's work; `layout_string` writes a split as --pipeline-model-parallel-layout.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional, Sequence

from llamapipe.core.pipeline_parallel.layout import stage_layer_ranges
from llamapipe.core.pipeline_parallel.profile_costs import PassCosts, StageCosts, stage_costs, uniform_costs
from llamapipe.core.pipeline_parallel.schedule_specs import SPECS, build
from llamapipe.core.pipeline_parallel.simulator import simulate
from llamapipe.core.pipeline_parallel.vocab_parallel import with_vocab_parallel
from llamapipe.tools import profile_schema
from llamapipe.tools.parallel_estimate import Layout, rank_params, stage_ranks

ELEMENT_BYTES = {"fp32": 4, "bf16": 2}


@dataclasses.dataclass(frozen=True)
class Prediction:
    step_s: float
    pipeline_s: float           # the simulated makespan (or longest stage span under post-validation)
    busy_s: tuple               # compute of each pipeline rank in the pipeline part
    bubble: float               # idle share of all pipeline ranks over the makespan
    optimizer_s: float
    dp_s: float
    overhead_s: float           # per-iteration and per-parameter runtime overhead outside the plan
    layer_counts: tuple
    slowdown: float             # CPU oversubscription factor applied to compute


def oversubscription(profile: dict, ranks: int, cores: Optional[int] = None) -> float:
    """How much slower each rank computes than in the profile when `ranks` share this machine's CPU cores."""
    if profile["device"] != "cpu":
        return 1.0
    cores = cores or os.cpu_count() or 1
    return max(1.0, ranks * profile["threads"] / cores)


def _comm(profile: dict, what: str, needed: bool) -> dict:
    comm = profile.get("comm")
    if needed and comm is None:
        raise profile_schema.ProfileError(f"this layout needs {what}, but the profile has no communication "
                                          "figures: run `llamapipe profile` under torchrun with 2 or more ranks")
    return comm or {}


def allreduce_s(comm: dict, nbytes: float, ranks: int) -> float:
    if ranks == 1:
        return 0.0
    return comm["allreduce_latency_s"] + 2 * (ranks - 1) / ranks * nbytes / comm["allreduce_bus_bandwidth_Bps"]


def component_costs(profile: dict, lay: Layout, slowdown: float) -> dict[str, PassCosts]:
    """Layer, embedding and head costs for one tp rank of `lay`, tp communication included."""
    parts = profile_schema.entry(profile, lay.micro_batch, lay.recompute)
    if parts is None:
        have = ", ".join(f"{b}/{r}" for b, r in profile_schema.settings(profile))
        raise profile_schema.ProfileError(f"the profile has no micro-batch size {lay.micro_batch} with recompute "
                                          f"{lay.recompute} (it has {have}); profile that setting")
    scaled = {name: c.scaled(slowdown / lay.tp, 1.0 / lay.tp) for name, c in parts.items()}
    if lay.tp == 1:
        return scaled
    comm = _comm(profile, "tensor-parallel all-reduces", True)
    message = profile["seq_length"] * lay.micro_batch * profile["model"]["hidden_size"] * \
        ELEMENT_BYTES[profile["dtype"]]
    one = allreduce_s(comm, message, lay.tp)
    forwards_in_b = 2 if lay.recompute == "full" else 1
    tp = {"layer": PassCosts(2 * one, 2 * one * forwards_in_b), "embedding": PassCosts(one, 0.0),
          "head": PassCosts(3 * comm["allreduce_latency_s"], one)}
    return {name: scaled[name] + tp[name] for name in scaled}


def layer_counts(profile: dict, lay: Layout) -> list[int]:
    ranges = stage_layer_ranges(profile["model"]["num_layers"], lay.pp, lay.vpp, layout=lay.pipeline_layout)
    return [end - start for start, end in ranges]


def rank_work(parts: dict[str, PassCosts], lay: Layout, counts: Sequence[int]) -> list[float]:
    """F + B + W of one microbatch on each pipeline rank (all its chunks) for a layer split."""
    costs = stage_costs(parts["layer"], parts["embedding"], parts["head"], counts, vocab_parallel=lay.vocab_parallel)
    work = [0.0] * lay.pp
    for stage, rank in enumerate(stage_ranks(lay)):
        st = costs.stages[stage]
        work[rank] += st.f + st.b + st.w
    if lay.vocab_parallel:
        shared = parts["head"] + parts["embedding"]
        work = [x + (shared.f + shared.b + shared.w) / lay.pp for x in work]
    return work


def embedding_passes_s(parts: dict[str, PassCosts], comm: dict, lay: Layout, m: int, message: float) -> float:
    """Vocabulary parallelism: every rank's embedding shard before the plan (its lookups, one all-reduce of the
    partial embeddings per microbatch) and after it (a broadcast of the input gradients, the shard's backward)."""
    if not lay.vocab_parallel:
        return 0.0
    emb = parts["embedding"]
    return m * ((emb.f + emb.b + emb.w) / lay.pp + 2 * allreduce_s(comm, message, lay.pp))


def balanced_counts(profile: dict, lay: Layout) -> list[int]:
    """The split of layers over virtual stages that minimises the busiest pipeline rank's work, by moving
    one layer at a time from a stage of the busiest rank to a stage of another rank (each keeps one layer)."""
    parts = component_costs(profile, lay, 1.0)
    layers, stages = profile["model"]["num_layers"], lay.pp * lay.vpp
    counts = [layers // stages + (s < layers % stages) for s in range(stages)]
    ranks = stage_ranks(lay)
    best = max(rank_work(parts, lay, counts))
    while True:
        work = rank_work(parts, lay, counts)
        busiest = work.index(max(work))
        moves = [(s, t) for s in range(stages) if ranks[s] == busiest and counts[s] > 1
                 for t in range(stages) if ranks[t] != busiest]
        trials = []
        for s, t in moves:
            trial = list(counts)
            trial[s], trial[t] = trial[s] - 1, trial[t] + 1
            trials.append((max(rank_work(parts, lay, trial)), trial))
        if not trials or min(trials)[0] >= best - 1e-12:
            return counts
        best, counts = min(trials)


def layout_string(counts: Sequence[int]) -> str:
    """A --pipeline-model-parallel-layout string for per-stage layer counts: [3, 5] -> "Et*3|t*5L"."""
    stages = [f"t*{n}" if n > 1 else "t" * n for n in counts]
    stages[0] = "E" + stages[0]
    stages[-1] += "L"
    return "|".join(stages)


def _plan(lay: Layout, m: int, costs: StageCosts, post_validation: bool):
    fitted = SPECS[lay.schedule].profiled
    uniform = uniform_costs(costs)
    plan = build(lay.schedule, lay.pp, lay.vpp, m, uniform if fitted else None, post_validation=post_validation,
                 vocab_parallel=False)
    if lay.vocab_parallel:      # placed as the executor places them (its default costs), then simulated at ours
        plan = with_vocab_parallel(plan)
    return plan


def predict(profile: dict, lay: Layout, global_batch: int, *, counts: Optional[Sequence[int]] = None,
            post_validation: bool = False, cores: Optional[int] = None,
            cpu_share: Optional[float] = None) -> Prediction:
    """Predicted step of `lay` (layer split `counts`, default the layout's own) at `global_batch` sequences.
    `cpu_share`: CPU seconds per second each rank gets, when measured (a machine shared with other work);
    default: this machine's cores over the ranks' threads, at most 1 (`oversubscription`)."""
    m = global_batch // (lay.micro_batch * lay.dp)
    slowdown = 1.0 / cpu_share if cpu_share else oversubscription(profile, lay.tp * lay.pp * lay.dp, cores)
    parts = component_costs(profile, lay, slowdown)
    counts = list(counts) if counts is not None else layer_counts(profile, lay)
    comm = _comm(profile, "p2p between pipeline ranks", lay.pp > 1 or lay.dp > 1)
    message = profile["seq_length"] * lay.micro_batch * profile["model"]["hidden_size"] * \
        ELEMENT_BYTES[profile["dtype"]] / lay.tp
    hop = comm["p2p_latency_s"] + message / comm["p2p_bandwidth_Bps"] if lay.pp > 1 else 0.0
    over = profile_schema.overhead(profile)
    costs = stage_costs(parts["layer"], parts["embedding"], parts["head"], counts, comm=hop,
                        vocab_parallel=lay.vocab_parallel, action_s=over["action_s"] * slowdown,
                        message_s=max(0.0, over["pipeline_action_s"] - over["action_s"]) * slowdown)
    result = simulate(_plan(lay, m, costs, post_validation), costs)
    pipeline = (max(result.span) if post_validation else result.makespan) + \
        embedding_passes_s(parts, comm, lay, m, message * lay.tp)
    model = profile_schema.model_of(profile)
    params = rank_params(model, dataclasses.replace(lay, pipeline_layout=layout_string(counts)))
    optimizer = max(params) / (lay.dp if lay.dist_opt else 1) * profile["optimizer_s_per_param"] * slowdown
    dp = allreduce_s(comm, 4 * max(params), lay.dp)
    outside = (over["iteration_s"] + over["param_s"] * max(params)) * slowdown
    return Prediction(step_s=pipeline + optimizer + dp + outside, pipeline_s=pipeline, busy_s=tuple(result.busy),
                      bubble=result.makespan_bubble_rate, optimizer_s=optimizer, dp_s=dp, overhead_s=outside,
                      layer_counts=tuple(counts), slowdown=slowdown)
