"""How the decoder layers split over virtual pipeline stages (Megatron-LM's even, uneven and accounted splits,
and its --pipeline-model-parallel-layout string).

Argument checks, model building and checkpoint resharding all read the split from here, so it has one home.
The layout grammar is Megatron-LM's (megatron/core/transformer/pipeline_parallel_layer_layout.py): `E` the
embedding, `t` one decoder layer, `L` the LM head and loss, `|` between virtual stages (in layer order), `x*N`
and `(...)*N` repeat, commas and spaces are cosmetic. Example: "Et*3|(tt|)*2,tL" is 4 stages of 3, 2, 2, 1 layers.
"""
from __future__ import annotations

import re
from typing import Optional

from llamapipe.core.config import ConfigError

_FIRST_LAST = "first_stage_layers/last_stage_layers"     # the uneven split's two fields, said together
_GROUP = re.compile(r"\(([^()]*)\)\*(\d+)")
_SINGLE = re.compile(r"([^()|*\d])\*(\d+)")


def parse_layout(text: str) -> list[str]:
    """The virtual stages of a layout string, each as its expanded letters: "Et*2|tL" -> ["Ett", "tL"]."""
    expanded = re.sub(r"[\s,]", "", text)
    while _GROUP.search(expanded):
        expanded = _GROUP.sub(lambda g: g[1] * int(g[2]), expanded)
    expanded = _SINGLE.sub(lambda g: g[1] * int(g[2]), expanded)
    unknown = sorted(set(expanded) - set("EtL|"))
    if unknown:
        raise ConfigError(f"pipeline_layout {text!r} contains {' '.join(unknown)}; it knows E (embedding), t "
                          "(decoder layer), L (loss), | between virtual stages, x*N and (...)*N to repeat",
                          "pipeline_layout")
    return expanded.split("|")


def layout_layer_counts(text: str, num_layers: int, pp_size: int) -> list[int]:
    """Decoder layers of each virtual stage of a layout string, checked against the model and pipeline size."""
    stages, said = parse_layout(text), f"pipeline_layout {text!r}"
    if len(stages) % pp_size:
        raise ConfigError(f"{said} has {len(stages)} virtual stages, which is not a multiple of pp_size {pp_size}",
                          "pipeline_layout", "pp_size")
    letters = "".join(stages)
    if letters.count("E") != 1 or not stages[0].startswith("E"):
        raise ConfigError(f"{said} must place the embedding E once, at the start of the first virtual stage",
                          "pipeline_layout")
    if letters.count("L") != 1 or not stages[-1].endswith("L"):
        raise ConfigError(f"{said} must place the loss L once, at the end of the last virtual stage",
                          "pipeline_layout")
    empty = [i for i, stage in enumerate(stages) if not stage]
    if empty:
        raise ConfigError(f"{said} leaves virtual stage {empty[0]} empty; give every stage a t, E or L",
                          "pipeline_layout")
    if letters.count("t") != num_layers:
        raise ConfigError(f"{said} places {letters.count('t')} decoder layers (t), but num_layers is {num_layers}",
                          "pipeline_layout", "num_layers")
    return [stage.count("t") for stage in stages]


def stage_layer_ranges(num_layers: int, pp_size: int, vpp_size: int = 1, first: int | None = None,
                       last: int | None = None, *, embedding: bool = False,
                       loss: bool = False, layout: Optional[str] = None) -> list[tuple[int, int]]:
    """[start, end) layer range of each virtual stage, in stage order.

    Even split by default (docs/design.md: stage v owns layers [v*L/S, (v+1)*L/S)). `first` / `last` are
    Megatron-LM's --decoder-first/last-pipeline-num-layers: the layers of the first / last pipeline stage
    (one chunk per rank), the rest split evenly over the stages between, e.g. to give the stage with the
    LM head and the loss fewer layers. `embedding` / `loss` are Megatron-LM's
    --account-for-embedding/loss-in-pipeline-split: the embedding (first stage) or the head and loss (last
    stage) count as one layer in an even split over all virtual stages, V placement included. `layout` is a
    --pipeline-model-parallel-layout string, which gives every stage's count itself (the other split flags are
    checked against it in training/arguments/pipeline.py)."""
    stages = pp_size * vpp_size
    if layout is not None:
        counts = layout_layer_counts(layout, num_layers, pp_size)
        if len(counts) != stages:
            raise ConfigError(f"pipeline_layout {layout!r} has {len(counts)} virtual stages, but pp_size {pp_size} "
                              f"x {vpp_size} model chunks is {stages}", "pipeline_layout", "pp_size")
    elif embedding or loss:
        counts = _accounted_counts(num_layers, pp_size, vpp_size, first, last, embedding, loss)
    elif first is None and last is None:
        if num_layers % stages:
            raise ConfigError(f"num_layers {num_layers} is not divisible by pipeline-model-parallel size "
                              f"({pp_size}) x virtual stages per rank ({vpp_size})", "num_layers")
        counts = [num_layers // stages] * stages
    else:
        if vpp_size != 1 or pp_size < 2:
            raise ConfigError(f"{_FIRST_LAST} need pp_size > 1 and one model chunk per rank (got pp {pp_size}, "
                              f"{vpp_size} chunks per rank)", "first_stage_layers", "last_stage_layers", "pp_size")
        given = {field: n for field, n in (("first_stage_layers", first), ("last_stage_layers", last))
                 if n is not None}
        for field, n in given.items():
            if n < 1:
                raise ConfigError(f"{field} {n} must be at least 1", field)
        middle_stages, middle_layers = pp_size - len(given), num_layers - sum(given.values())
        said = " and ".join(f"{field} {n}" for field, n in given.items())
        if middle_stages == 0 and middle_layers:
            raise ConfigError(f"{said} must add up to num_layers {num_layers} with pp_size {pp_size}", *given,
                              "num_layers", "pp_size")
        if middle_layers < 0:
            raise ConfigError(f"{said} {'are' if len(given) > 1 else 'is'} more than num_layers {num_layers}",
                              *given, "num_layers")
        if middle_layers < middle_stages or (middle_stages and middle_layers % middle_stages):
            raise ConfigError(f"{said} {'leave' if len(given) > 1 else 'leaves'} {middle_layers} of num_layers "
                              f"{num_layers} for the other " + (
                                  f"{middle_stages} pipeline stages, which must all get the same number of "
                                  "layers, at least 1 each" if middle_stages > 1 else
                                  "pipeline stage, which needs at least 1"), *given, "num_layers")
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
    fields = [field for field, on in (("account_for_embedding", embedding), ("account_for_loss", loss)) if on]
    said = " and ".join(fields)
    if first is not None or last is not None:
        raise ConfigError(f"{said} cannot be combined with {_FIRST_LAST}", *fields, "first_stage_layers",
                          "last_stage_layers")
    stages, units = pp_size * vpp_size, num_layers + embedding + loss
    if units % stages:
        raise ConfigError(f"num_layers {num_layers} plus {said} ({units} layers) is not divisible by "
                          f"pipeline-model-parallel size ({pp_size}) x virtual stages per rank ({vpp_size})",
                          "num_layers", *fields)
    counts = [units // stages] * stages
    counts[0] -= embedding
    counts[-1] -= loss
    if min(counts) < 1:
        raise ConfigError(f"num_layers {num_layers} with {said} over {stages} stages leaves a stage without a "
                          "transformer layer; use fewer stages or more layers", "num_layers", *fields)
    return counts
