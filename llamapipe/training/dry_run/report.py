"""The dry run's report: each role's memory against the device, and the job's totals.

Roles whose numbers are all the same (the tp ranks of one stage, and under context parallelism its cp ranks)
share one row, which names them. Memory per rank is what the run holds at the plan's activation peak:
parameters, gradients, optimizer state, activations (measured while the plan ran on meta, `step`) and the
communication buffers beside them (`rank._comm_bytes`), against `--gpu-memory-gb`. The parameter count summed
over the job's distinct shards is checked against the model's own count (`model.families.model_parameters`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from llamapipe.model.families import model_parameters
from llamapipe.training.config import Config
from llamapipe.training.dry_run.rank import RoleReport

GIB = 2 ** 30


@dataclass(frozen=True)
class JobResult:
    """Everything the dry run found for one job."""
    reports: list[RoleReport]
    problems: list[str]          # messages whose two sides disagree
    steps: int                   # steps run on meta (one per distinct shard)
    seconds: float

    def parameters(self) -> int:
        """Parameters summed over the job's distinct (tp, pp) shards (cp and dp ranks hold copies)."""
        return sum(r.own_params for r in self.reports if r.role.coords.get("cp", 0) == 0)


def expected_parameters(config: Config) -> int:
    """The model's parameter count as this layout holds it (the vocabulary padded for tp, or for tp x pp when
    the vocabulary is split over the pipeline too)."""
    model, par = config.model, config.parallel
    if par.vocab_parallel:
        model = dataclasses.replace(model, make_vocab_size_divisible_by=model.make_vocab_size_divisible_by * par.pp_size)
    return model_parameters(model, par.tp_size)


def size(n: float) -> str:
    """Bytes for a person: GiB, or MiB below one GiB."""
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2 ** 20:.2f} MiB"


def ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    out, ranks = [], sorted(ranks)
    start = prev = ranks[0]
    for r in ranks[1:] + [None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ", ".join(out)


def _row_key(r: RoleReport) -> tuple:
    return (r.role.coords["pp"], r.params, r.grads, r.optimizer, r.activations, r.comm, tuple(r.layers))


def _gib(n: float) -> str:
    return f"{n / GIB:7.2f}"


def role_rows(result: JobResult) -> list[str]:
    """One row per group of roles with the same numbers."""
    groups: dict[tuple, list[RoleReport]] = {}
    for r in result.reports:
        groups.setdefault(_row_key(r), []).append(r)
    head = (f"{'pp':>3} {'stages':<9} {'layers':<9} {'params':>7} {'grads':>7} {'optim':>7} {'activ':>7} {'units':>6} "
            f"{'comm':>7} {'total':>7}  ranks (GiB per rank)")
    lines = [head, "-" * len(head)]
    for key, rs in sorted(groups.items()):
        r = rs[0]
        who = {axis: sorted({x.role.coords.get(axis, 0) for x in rs}) for axis in ("tp", "cp")}
        names = ", ".join(f"{axis} {ranges(v)}" for axis, v in who.items() if len(v) > 1 or v != [0])
        count = sum(len(x.role.ranks) for x in rs)
        lines.append(f"{key[0]:>3} {','.join(map(str, r.stages)):<9} {'+'.join(map(str, r.layers)):<9} "
                     f"{_gib(r.params)} {_gib(r.grads)} {_gib(r.optimizer)} {_gib(r.activations)} "
                     f"{r.step.peak_units:>6.2f} {_gib(r.comm)} {_gib(r.total)}  {count} ranks"
                     + (f" ({names})" if names else ""))
    return lines


RANKS_PER_NODE = 8      # a node as torchrun starts it with --nproc-per-node 8 (rank // 8)


def offload_lines(result: JobResult) -> list[str]:
    """With --cpu-offload: the most activations a rank holds in host memory, and what the fullest node needs."""
    per_rank = {rank: r.step.offloaded for r in result.reports for rank in r.role.ranks}
    if not any(per_rank.values()):
        return []
    nodes: dict[int, int] = {}
    for rank, nbytes in per_rank.items():
        nodes[rank // RANKS_PER_NODE] = nodes.get(rank // RANKS_PER_NODE, 0) + nbytes
    node, most = max(nodes.items(), key=lambda kv: (kv[1], -kv[0]))
    worst = max(result.reports, key=lambda r: r.step.offloaded)
    return [f"offload: {worst.role.name()} holds up to {size(worst.step.offloaded)} of activations in host memory "
            f"(the 'activ' column is what stays on the GPU); node {node} ({RANKS_PER_NODE} ranks) needs "
            f"{size(most)} of host memory for them"]


def over_memory(result: JobResult, memory: float) -> list[RoleReport]:
    """The roles whose ranks need more than `memory` bytes."""
    return [r for r in result.reports if r.total > memory]


def summary(config: Config, result: JobResult, memory: float) -> list[str]:
    """The job's lines: parameters against the model, the most loaded rank, the checkpoint, the resume."""
    found, expected = result.parameters(), expected_parameters(config)
    same = "= the model's" if found == expected else f"!= the model's {expected:,}"
    worst = max(result.reports, key=lambda r: r.total)
    lines = [f"parameters: {found:,} summed over the shards {same}",
             f"memory: the most loaded rank ({worst.role.name()}) needs {size(worst.total)} of "
             f"{memory / GIB:g} GiB; {worst.zero}"]
    files = [(name, size) for r in result.reports for name, size in r.files]
    dp_ranks = {r.role.rank: len(r.role.ranks) for r in result.reports}
    rng = sum(size * (dp_ranks[r.role.rank] - 1) for r in result.reports for name, size in r.files
              if name.startswith("rng_"))           # the other dp ranks of a role write their own rng file
    total = sum(size for _, size in files) + rng
    largest = max(files, key=lambda f: f[1])
    lines.append(f"checkpoint: each save writes {len(files) + sum(n - 1 for n in dp_ranks.values())} files, "
                 f"{size(total)} (largest {largest[0]}, {size(largest[1])}), metadata.json aside")
    lines += offload_lines(result)
    resumes = [r for r in result.reports if r.resume is not None]
    if resumes:
        heaviest = max(resumes, key=lambda r: r.resume.read)
        lines.append(f"resume: the heaviest rank ({heaviest.role.name()}) {heaviest.resume.text(size)}")
    return lines
