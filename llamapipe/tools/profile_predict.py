"""A step's time predicted from a measured profile (`llamapipe profile`), for `llamapipe plan --profile`.

Per virtual stage, the pass times are the sum of its parts as measured: its decoder layers, the embedding on
the first stage, the output layer and loss on the last (`profile_costs.stage_costs`), or with vocabulary
parallelism (arXiv 2411.05288) the output layer split over every rank as the S/T actions and the embedding's
shards run on every rank before and after the plan (`embedding_passes_s`, as `vocab_runtime` runs them). Under tensor
parallelism every part's compute is divided by tp and each pays its tp collectives one by one at the measured
all-reduce latency and bandwidth (`stage_balance.tp_parts`, with --sequence-parallel as plan prints it). The
schedule's plan (for zb-h2 the one fitted to the slowest stage's costs, as at run time) is simulated with these costs
and the measured p2p time of one activation message; the step is its makespan (with post-validation the
longest stage span), plus the optimizer step of the most loaded rank (measured seconds per parameter) and
the data-parallel gradient all-reduce (4 bytes per parameter, ring over dp at the measured bus bandwidth).
The runtime's overhead as `profile_overhead` measured it enters twice: its cost per action is part of every
simulated action (so it adds up along the critical path as at run time), plus, per p2p message the action
receives or sends to another rank, what an action of the measured pipeline cost beyond it; and its cost per iteration and per
parameter of the most loaded rank is added to the step (`overhead_s`).

On a CPU, ranks share the machine's cores: with more threads in all (ranks x the profile's threads per rank)
than cores (`oversubscription`), the simulated pipeline is stretched where its ranks compute at the same time
(`contended`: a rank waiting in the bubble does not compete), and what all ranks run at once (optimizer,
per-iteration overhead) by the whole ratio; each tensor-parallel collective also pays the profile's measured
cost of a blocking wait (`profile_schema.collective_sync_s`).

`balanced_counts` is the split of layers over the virtual stages that `plan` picks, `stage_balance`'s (shared
with --pipeline-model-parallel-layout auto at run time) from this layout's costs.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional, Sequence

from llamapipe.core.pipeline_parallel.layout import stage_layer_ranges
from llamapipe.core.pipeline_parallel.profile_costs import PassCosts, StageCosts, stage_costs, uniform_costs
from llamapipe.core.pipeline_parallel.schedule_specs import SPECS, build
from llamapipe.core.pipeline_parallel.simulator import Result, simulate
from llamapipe.core.pipeline_parallel.stage_balance import allreduce_s, layout_string, stage_ranks, tp_parts
from llamapipe.core.pipeline_parallel.stage_balance import balanced_counts as core_balanced_counts
from llamapipe.core.pipeline_parallel.vocab_parallel import with_vocab_parallel
from llamapipe.training import profile_schema
from llamapipe.tools.parallel_estimate import Layout, rank_params

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
    slowdown: float             # CPU oversubscription factor applied to the pipeline's compute


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


def component_costs(profile: dict, lay: Layout, slowdown: float) -> dict[str, PassCosts]:
    """Layer, embedding and head costs for one tp rank of `lay`, tp collectives included (the trainer's tp
    runs with --sequence-parallel, as `plan` prints it)."""
    parts = profile_schema.entry(profile, lay.micro_batch, lay.recompute)
    if parts is None:
        have = ", ".join(f"{b}/{r}" for b, r in profile_schema.settings(profile))
        raise profile_schema.ProfileError(f"the profile has no micro-batch size {lay.micro_batch} with recompute "
                                          f"{lay.recompute} (it has {have}); profile that setting")
    comm = _comm(profile, "tensor-parallel collectives", lay.tp > 1)
    return tp_parts(parts, lay.tp, slowdown, comm, message=_message(profile, lay) * lay.tp, sequence_parallel=True,
                    recompute=lay.recompute, gloo=profile["device"] == "cpu",
                    sync_s=profile_schema.collective_sync_s(profile))


def _message(profile: dict, lay: Layout) -> float:
    """Bytes of one activation message between pipeline stages (its sequence split over tp)."""
    return profile["seq_length"] * lay.micro_batch * profile["model"]["hidden_size"] * \
        ELEMENT_BYTES[profile["dtype"]] / lay.tp


def layer_counts(profile: dict, lay: Layout) -> list[int]:
    ranges = stage_layer_ranges(profile["model"]["num_layers"], lay.pp, lay.vpp, layout=lay.pipeline_layout)
    return [end - start for start, end in ranges]


def layout_ranks(lay: Layout) -> list[int]:
    return stage_ranks(lay.pp, lay.vpp, SPECS[lay.schedule].placement(lay.vpp))


def embedding_passes_s(parts: dict[str, PassCosts], comm: dict, lay: Layout, m: int, message: float) -> float:
    """Vocabulary parallelism: every rank's embedding shard before the plan (its lookups, one all-reduce of the
    partial embeddings per microbatch) and after it (a broadcast of the input gradients, the shard's backward)."""
    if not lay.vocab_parallel:
        return 0.0
    emb = parts["embedding"]
    return m * ((emb.f + emb.b + emb.w) / lay.pp + 2 * allreduce_s(comm, message, lay.pp))


def balanced_counts(profile: dict, lay: Layout) -> list[int]:
    """The split `stage_balance.balanced_counts` picks for `lay` from the profile's costs."""
    parts = component_costs(profile, lay, 1.0)
    return core_balanced_counts(parts, profile["model"]["num_layers"], layout_ranks(lay), lay.vocab_parallel)


def _plan(lay: Layout, m: int, costs: StageCosts, post_validation: bool):
    fitted = SPECS[lay.schedule].profiled
    uniform = uniform_costs(costs)
    plan = build(lay.schedule, lay.pp, lay.vpp, m, uniform if fitted else None, post_validation=post_validation,
                 vocab_parallel=False)
    if lay.vocab_parallel:      # placed as the executor places them (its default costs), then simulated at ours
        plan = with_vocab_parallel(plan)
    return plan


def _pipeline(profile: dict, lay: Layout, m: int, counts: Sequence[int], post_validation: bool,
              slowdown: float) -> tuple[float, Result]:
    """The simulated plan's makespan (span under post-validation) with compute stretched by `slowdown`."""
    parts = component_costs(profile, lay, slowdown)
    comm = _comm(profile, "p2p between pipeline ranks", lay.pp > 1)
    hop = comm["p2p_latency_s"] + _message(profile, lay) / comm["p2p_bandwidth_Bps"] if lay.pp > 1 else 0.0
    over = profile_schema.overhead(profile)
    costs = stage_costs(parts["layer"], parts["embedding"], parts["head"], counts, comm=hop,
                        vocab_parallel=lay.vocab_parallel, action_s=over["action_s"] * slowdown,
                        message_s=max(0.0, over["pipeline_action_s"] - over["action_s"]) * slowdown)
    result = simulate(_plan(lay, m, costs, post_validation), costs)
    return (max(result.span) if post_validation else result.makespan), result


def contended(result: Result, replicas: int, cores: float) -> float:
    """The simulated pipeline's time when its ranks share `cores` (processor sharing): each interval of the
    timeline of an uncontended run stretched by the ranks computing in it (`replicas` per pipeline rank: tp x
    dp processes run each) over the cores, at least 1. A rank waiting in the bubble does not compete, so a
    pp 4 pipeline on 2 cores is not simply twice as slow."""
    events = sorted((t, d * replicas) for row in result.timeline for s, e, _ in row for t, d in ((s, 1), (e, -1)))
    total, busy, last = 0.0, 0, events[0][0] if events else 0.0
    for t, delta in events:
        total += (t - last) * max(1.0, busy / cores)
        busy, last = busy + delta, t
    return total


def predict(profile: dict, lay: Layout, global_batch: int, *, counts: Optional[Sequence[int]] = None,
            post_validation: bool = False, cores: Optional[int] = None,
            cpu_share: Optional[float] = None) -> Prediction:
    """Predicted step of `lay` (layer split `counts`, default the layout's own) at `global_batch` sequences.
    `cpu_share`: CPU seconds per second each rank gets when all compute at once, when measured (a machine
    shared with other work); default: this machine's cores over the ranks' threads, at most 1
    (`oversubscription`). The pipeline's ranks share the cores as `contended` has it; what all ranks run at once
    (the split embedding's passes, the optimizer step, the per-iteration overhead) is stretched by the whole
    oversubscription."""
    m = global_batch // (lay.micro_batch * lay.dp)
    cap = 1.0 / cpu_share if cpu_share else oversubscription(profile, lay.tp * lay.pp * lay.dp, cores)
    counts = list(counts) if counts is not None else layer_counts(profile, lay)
    pipeline, result = _pipeline(profile, lay, m, counts, post_validation, 1.0)
    if cap > 1.0:
        shared = contended(result, lay.tp * lay.dp, lay.tp * lay.pp * lay.dp / cap)
        pipeline, slowdown = pipeline * shared / max(result.makespan, 1e-12), shared / max(result.makespan, 1e-12)
    else:
        slowdown = 1.0
    comm = _comm(profile, "the data-parallel all-reduce", lay.dp > 1)
    pipeline += embedding_passes_s(component_costs(profile, lay, cap), comm, lay, m, _message(profile, lay) * lay.tp)
    over = profile_schema.overhead(profile)
    model = profile_schema.model_of(profile)
    params = rank_params(model, dataclasses.replace(lay, pipeline_layout=layout_string(counts)))
    optimizer = max(params) / (lay.dp if lay.dist_opt else 1) * profile["optimizer_s_per_param"] * cap
    dp = allreduce_s(comm, 4 * max(params), lay.dp)
    outside = (over["iteration_s"] + over["param_s"] * max(params)) * cap
    return Prediction(step_s=pipeline + optimizer + dp + outside, pipeline_s=pipeline, busy_s=tuple(result.busy),
                      bubble=result.makespan_bubble_rate, optimizer_s=optimizer, dp_s=dp, overhead_s=outside,
                      layer_counts=tuple(counts), slowdown=slowdown)
