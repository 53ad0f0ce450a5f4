"""The JSON profile `llamapipe profile` writes and `llamapipe plan --profile` and the trainer's --pipeline-profile
read: its schema, checks and look-ups, in one place so the writer and the readers cannot drift (here in the
application, which owns file formats, so that training reads it without importing the tools).

    {"schema": "llamapipe-profile/1", "device": "cpu", "threads": 1, "dtype": "fp32", "seq_length": 128,
     "model": {LlamaConfig fields},
     "entries": [{"micro_batch_size": 1, "recompute": "none",
                  "layer": {"f": s, "b": s, "w": s, "act_bytes": B, "w_bytes": B}, "embedding": {...}, "head": {...}}],
     "optimizer_s_per_param": s,
     "comm": null | {"world_size": n, "p2p_latency_s": s, "p2p_bandwidth_Bps": B/s, "allreduce_latency_s": s,
                     "allreduce_bus_bandwidth_Bps": B/s, ...},
     "overhead": {"action_s": s, "iteration_s": s, "param_s": s, "pipeline_action_s": s},   # optional
     "machine": {...}}

Times are seconds for one microbatch, `f`/`b`/`w` the forward, the input gradient and the weight gradients
(the embedding's weight gradient is part of its B, as in the trainer), bytes those one microbatch holds from
F to B (`act_bytes`) and from B to W (`w_bytes`). `layer` is one decoder layer, `head` the final norm, output
layer and loss. `overhead` (`profile_overhead`; profiles written before it have none, and the planner then
leaves that time out) is the step's time beyond these: per plan action, per iteration, and per parameter of
the rank outside the AdamW update; `pipeline_action_s` (written under torchrun) per action of a pipeline whose
stages exchange p2p messages, measured across the job's ranks.
"""
from __future__ import annotations

import json
import math
import os
import platform
from typing import Optional

from llamapipe.core.pipeline_parallel.profile_costs import PassCosts
from llamapipe.safe_files import replace_atomically
from llamapipe.model.llama import LlamaConfig

SCHEMA = "llamapipe-profile/1"
COMPONENTS = ("layer", "embedding", "head")
PASS_FIELDS = ("f", "b", "w", "act_bytes", "w_bytes")
COMM_FIELDS = ("world_size", "p2p_latency_s", "p2p_bandwidth_Bps", "allreduce_latency_s",
               "allreduce_bus_bandwidth_Bps")
OVERHEAD_FIELDS = ("action_s", "iteration_s", "param_s")


class ProfileError(ValueError):
    """A profile file that is not what `llamapipe profile` writes; the message names the file and the field."""


def make_profile(*, model: dict, seq_length: int, dtype: str, device: str, threads: int, entries: list,
                 optimizer_s_per_param: float, comm: Optional[dict],
                 overhead: Optional[dict] = None) -> dict:
    return {"schema": SCHEMA, "device": device, "threads": threads, "dtype": dtype, "seq_length": seq_length,
            "model": model, "entries": entries, "optimizer_s_per_param": optimizer_s_per_param, "comm": comm,
            "overhead": overhead, "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "loadavg_1min": os.getloadavg()[0]}}


def _number(where: str, value, positive: bool = False) -> None:
    """A measured figure: finite (JSON's NaN and Infinity parse, but no plan can be made from them) and >= 0."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ProfileError(f"{where} is {value!r}; expected a finite {'positive' if positive else 'non-negative'} "
                           "number")
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0 or (positive and value == 0):
        raise ProfileError(f"{where} is {value!r}; expected a {'positive' if positive else 'non-negative'} number")


# The model fields a profile's per-layer times depend on: a profile of another model does not predict this one
SAME_MODEL = ("hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "vocab_size", "family")


def check_same_model(profile: dict, model: LlamaConfig, said: str, whose: str = "this run's is",
                     vocab_hint: str = "") -> None:
    """ProfileError when `profile` was measured on a model that differs from `model` where times depend on it
    (the number of layers may differ: times are per layer); `vocab_hint`: the flag that gives `llamapipe profile`
    the run's vocabulary (its tokenizer), named when the vocabularies differ."""
    for field in SAME_MODEL:
        if profile["model"].get(field) != getattr(model, field):
            how = vocab_hint if field == "vocab_size" else ""
            raise ProfileError(f"{said} was made for a model with {field} {profile['model'].get(field)}, but "
                               f"{whose} {getattr(model, field)}; profile this model with `llamapipe profile{how}`")


def validate(profile: dict, name: str = "profile") -> dict:
    """`profile` if it follows the schema, else ProfileError naming the first field that does not."""
    if not isinstance(profile, dict) or profile.get("schema") != SCHEMA:
        got = profile.get("schema") if isinstance(profile, dict) else type(profile).__name__
        raise ProfileError(f"{name}: schema is {got!r}, expected {SCHEMA!r} (write it with `llamapipe profile`)")
    for key in ("model", "entries", "seq_length", "optimizer_s_per_param", "threads"):
        if key not in profile:
            raise ProfileError(f"{name}: no {key!r}")
    try:
        LlamaConfig(**profile["model"])
    except TypeError as e:
        raise ProfileError(f"{name}: model: {e}") from None
    _number(f"{name}: seq_length", profile["seq_length"], positive=True)
    _number(f"{name}: optimizer_s_per_param", profile["optimizer_s_per_param"])
    if not profile["entries"]:
        raise ProfileError(f"{name}: entries is empty; profile at least one micro-batch size")
    for i, entry in enumerate(profile["entries"]):
        where = f"{name}: entries[{i}]"
        _number(f"{where}.micro_batch_size", entry.get("micro_batch_size"), positive=True)
        if entry.get("recompute") not in ("none", "full"):
            raise ProfileError(f"{where}.recompute is {entry.get('recompute')!r}; expected 'none' or 'full'")
        for component in COMPONENTS:
            for field in PASS_FIELDS:
                _number(f"{where}.{component}.{field}", (entry.get(component) or {}).get(field))
    if profile.get("comm") is not None:
        for field in COMM_FIELDS:
            _number(f"{name}: comm.{field}", profile["comm"].get(field), positive=field.endswith(("Bps", "size")))
    if profile.get("overhead") is not None:
        for field in OVERHEAD_FIELDS:
            _number(f"{name}: overhead.{field}", profile["overhead"].get(field))
        if "pipeline_action_s" in profile["overhead"]:
            _number(f"{name}: overhead.pipeline_action_s", profile["overhead"]["pipeline_action_s"])
    return profile


def overhead(profile: dict) -> dict[str, float]:
    """The step's overhead figures; zeros for a profile written before they were measured (see `notice`).
    `pipeline_action_s` is `action_s` where no pipeline was measured."""
    measured = profile.get("overhead") or {}
    figures = {field: float(measured.get(field, 0.0)) for field in OVERHEAD_FIELDS}
    figures["pipeline_action_s"] = float(measured.get("pipeline_action_s", figures["action_s"]))
    return figures


def collective_sync_s(profile: dict) -> float:
    """What a blocking collective costs beyond its transfer on a CPU (a wait and a wake-up, measured as a
    pipelined action's overhead beyond a single-rank one); 0 on CUDA, whose collectives do not block the host."""
    if profile["device"] != "cpu":
        return 0.0
    figures = overhead(profile)
    return max(0.0, figures["pipeline_action_s"] - figures["action_s"])


def notice(profile: dict, name: str = "profile") -> Optional[str]:
    """One line for a profile without overhead figures, else None."""
    if profile.get("overhead") is None:
        return (f"{name} has no overhead figures (written before `llamapipe profile` measured them): predictions "
                "leave out the per-action and per-iteration time outside the passes; profile again to include it")
    return None


def run_threads() -> int:
    """Threads per process of a torchrun rank on this machine: OMP_NUM_THREADS when the environment sets it
    (torchrun keeps it), else torchrun's 1."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    return int(value) if value.isdigit() and int(value) > 0 else 1


def threads_mismatch(profile: dict, threads: int, name: str, run: str) -> Optional[str]:
    """One line when a CPU profile was timed with another thread count per process than the run computes with
    (`threads`; `run` says whose: "a torchrun rank ..."), whose passes then take other times; None when they
    agree (or on CUDA, where the kernels run on the device)."""
    if profile["device"] != "cpu" or profile["threads"] == threads:
        return None
    return (f"{name} was measured with {profile['threads']} thread(s) per process, but {run} computes with "
            f"{threads}; profile again with `llamapipe profile --threads {threads} ...`, or set OMP_NUM_THREADS="
            f"{profile['threads']} for both")


def load(path: str, flag: str = "--profile") -> dict:
    """Read and validate a profile given as `flag` (plan's --profile, the trainer's --pipeline-profile);
    one-line ProfileError naming the flag and the file for a missing or malformed one."""
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise ProfileError(f"{flag} {path}: cannot read it ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise ProfileError(f"{flag} {path}: not JSON ({e.msg} at line {e.lineno})") from None
    return validate(data, f"{flag} {path}")


def write(path: str, profile: dict) -> None:
    validate(profile, path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with replace_atomically(path, "w") as f:     # never through a link (llamapipe/safe_files)
        json.dump(profile, f, indent=2)


def model_of(profile: dict) -> LlamaConfig:
    return LlamaConfig(**profile["model"])


def entry(profile: dict, micro_batch_size: int, recompute: str) -> Optional[dict[str, PassCosts]]:
    """The three components' costs measured for one setting, or None if it was not profiled."""
    for e in profile["entries"]:
        if e["micro_batch_size"] == micro_batch_size and e["recompute"] == recompute:
            return {c: PassCosts(**{k: e[c][k] for k in PASS_FIELDS}) for c in COMPONENTS}
    return None


def settings(profile: dict) -> list[tuple[int, str]]:
    """(micro-batch size, recompute) of every entry."""
    return [(e["micro_batch_size"], e["recompute"]) for e in profile["entries"]]


def summary(profile: dict) -> str:
    """A few lines for the terminal: per setting, each component's F/B/W in ms and activation MiB."""
    lines = [f"profile of {profile['device']} ({profile['threads']} thread(s), {profile['dtype']}, seq "
             f"{profile['seq_length']}):"]
    for e in profile["entries"]:
        parts = [f"{c} F/B/W {e[c]['f'] * 1e3:.2f}/{e[c]['b'] * 1e3:.2f}/{e[c]['w'] * 1e3:.2f} ms "
                 f"{e[c]['act_bytes'] / 2 ** 20:.2f} MiB" for c in COMPONENTS]
        lines.append(f"  mbs {e['micro_batch_size']} recompute {e['recompute']}: " + "; ".join(parts))
    lines.append(f"  optimizer {profile['optimizer_s_per_param'] * 1e9:.2f} ns per parameter")
    if profile.get("overhead"):
        o = profile["overhead"]
        lines.append(f"  overhead {o['action_s'] * 1e3:.3f} ms per action, {o['iteration_s'] * 1e3:.2f} ms per "
                     f"iteration, {o['param_s'] * 1e9:.2f} ns per parameter" + (
                         f", {o['pipeline_action_s'] * 1e3:.3f} ms per pipelined action" if "pipeline_action_s" in o
                         else ""))
    comm = profile.get("comm")
    if comm:
        lines.append(f"  {comm['world_size']} ranks: p2p {comm['p2p_latency_s'] * 1e6:.0f} us + "
                     f"{comm['p2p_bandwidth_Bps'] / 1e9:.2f} GB/s, all-reduce {comm['allreduce_latency_s'] * 1e6:.0f} "
                     f"us + {comm['allreduce_bus_bandwidth_Bps'] / 1e9:.2f} GB/s (bus)")
    return "\n".join(lines)
