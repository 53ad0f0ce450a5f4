"""How the decoder layers split over virtual pipeline stages (Megatron-LM's even, uneven and accounted splits).

Argument checks, model building and checkpoint resharding all read the split from here, so it has one home.
"""
from __future__ import annotations


def stage_layer_ranges(num_layers: int, pp_size: int, vpp_size: int = 1, first: int | None = None,
                       last: int | None = None, *, embedding: bool = False,
                       loss: bool = False) -> list[tuple[int, int]]:
    """[start, end) layer range of each virtual stage, in stage order.

    Even split by default (docs/design.md: stage v owns layers [v*L/S, (v+1)*L/S)). `first` / `last` are
    Megatron-LM's --decoder-first/last-pipeline-num-layers: the layers of the first / last pipeline stage
    (one chunk per rank), the rest split evenly over the stages between, e.g. to give the stage with the
    LM head and the loss fewer layers. `embedding` / `loss` are Megatron-LM's
    --account-for-embedding/loss-in-pipeline-split: the embedding (first stage) or the head and loss (last
    stage) count as one layer in an even split over all virtual stages, V placement included."""
    stages = pp_size * vpp_size
    if embedding or loss:
        counts = _accounted_counts(num_layers, pp_size, vpp_size, first, last, embedding, loss)
    elif first is None and last is None:
        if num_layers % stages:
            raise ValueError(f"--num-layers {num_layers} is not divisible by pipeline-model-parallel size "
                             f"({pp_size}) x virtual stages per rank ({vpp_size})")
        counts = [num_layers // stages] * stages
    else:
        if vpp_size != 1 or pp_size < 2:
            raise ValueError("--decoder-first/last-pipeline-num-layers need --pipeline-model-parallel-size > 1 "
                             f"and one model chunk per rank (got pp {pp_size}, {vpp_size} chunks per rank)")
        given = {f"--decoder-{end}-pipeline-num-layers": n for end, n in (("first", first), ("last", last))
                 if n is not None}
        for flag, n in given.items():
            if n < 1:
                raise ValueError(f"{flag} {n} must be at least 1")
        middle_stages, middle_layers = pp_size - len(given), num_layers - sum(given.values())
        flags = " and ".join(f"{flag} {n}" for flag, n in given.items())
        if middle_stages == 0 and middle_layers:
            raise ValueError(f"{flags} must add up to --num-layers {num_layers} with "
                             f"--pipeline-model-parallel-size {pp_size}")
        if middle_layers < 0:
            raise ValueError(f"{flags} {'are' if len(given) > 1 else 'is'} more than --num-layers {num_layers}")
        if middle_layers < middle_stages or (middle_stages and middle_layers % middle_stages):
            raise ValueError(f"{flags} {'leave' if len(given) > 1 else 'leaves'} {middle_layers} of --num-layers "
                             f"{num_layers} for the other " + (
                                 f"{middle_stages} pipeline stages, which must all get the same number of "
                                 "layers, at least 1 each" if middle_stages > 1 else
                                 "pipeline stage, which needs at least 1"))
        even = middle_layers // middle_stages if middle_stages else 0
        counts = [even] * pp_size
        if first is not None:
            counts[0] = first
        if last is not None:
            counts[-1] = last
    starts = [sum(counts[:s]) for s in range(stages)]
    return [(start, start + n) for start, n in zip(starts, counts)]


def _accounted_counts(num_layers: int, pp_size: int, vpp_size: int, first: int | None, last: int | None,
                      embedding: bool, loss: bool) -> list[int]:
    flags = " and ".join(f"--account-for-{part}-in-pipeline-split" for part, on in
                         (("embedding", embedding), ("loss", loss)) if on)
    if first is not None or last is not None:
        raise ValueError(f"{flags} cannot be combined with --decoder-first/last-pipeline-num-layers")
    stages, units = pp_size * vpp_size, num_layers + embedding + loss
    if units % stages:
        raise ValueError(f"--num-layers {num_layers} plus {flags} ({units} layers) is not divisible by "
                         f"pipeline-model-parallel size ({pp_size}) x virtual stages per rank ({vpp_size})")
    counts = [units // stages] * stages
    counts[0] -= embedding
    counts[-1] -= loss
    if min(counts) < 1:
        raise ValueError(f"--num-layers {num_layers} with {flags} over {stages} stages leaves a stage "
                         "without a transformer layer; use fewer stages or more layers")
    return counts
