"""`llamapipe profile`: measure what `llamapipe plan --profile` predicts a step from, on this device.

    llamapipe profile --model tiny --seq-length 128 --micro-batch-size 1 2 --recompute none full --out prof.json
    torchrun --nproc-per-node 2 -m llamapipe.tools.profile_model --model tiny --out prof_2ranks.json   # + communication

It computes with the threads a torchrun rank uses (`profile_schema.run_threads`: 1 unless OMP_NUM_THREADS says
otherwise) and records them; with more than one it refuses a machine where other processes leave too few idle
cores (`profile_machine.load_refusal`), since it then times in wall time. An existing --out is kept unless --force.

For each micro-batch size and recompute setting it times F, B (input gradient) and W (the deferred weight
gradients, `weight_grad_store`) of a decoder layer (the mean over `--layers` run as one chunk: on a CPU a layer
alone keeps its weights in cache and runs up to 18% faster than in an 8-layer stage), of the embedding, and of
the output layer with its loss,
as the executor runs them, and measures the activation bytes each holds from F to B and from B to W
(`activation_memory.ActivationProbe`). The times go through the one path that `auto`'s in-run profiling uses
(`profile_costs.pass_medians`). It also times the optimizer step (the trainer's AdamW and grad norm) per
parameter, and the runtime's overhead beyond the passes per action, per iteration and per parameter
(`profile_overhead`). Under torchrun with several ranks, `profile_comm` adds p2p latency and bandwidth and all-reduce
bandwidth between the ranks. Rank 0 writes one JSON profile (`profile_schema`).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from typing import Callable, Optional

import torch

from llamapipe.core.config import ArgumentError, OptimizerConfig
from llamapipe.training.flag_names import flag_message
from llamapipe.training.flag_parser import FlagParser
from llamapipe.core.optimizer.adamw import make_adamw
from llamapipe.core.optimizer.clip_grads import local_squared_norm
from llamapipe.core.pipeline_parallel.activation_memory import ActivationProbe
from llamapipe.core.pipeline_parallel.profile_costs import PassCosts, pass_medians
from llamapipe.core.pipeline_parallel.schedule_ir import Action
from llamapipe.core.tensor_parallel.weight_grad_store import WeightGradStore
from llamapipe.model.llama import LlamaConfig
from llamapipe.model.families import family_of
from llamapipe.model.llama import LlamaModel
from llamapipe.safe_files import UnsafePathError, check_target
from llamapipe.tools import profile_comm, profile_machine, profile_overhead
from llamapipe.training import profile_schema
from llamapipe.training.arguments.flags_model import add_model_flags
from llamapipe.data.tokenizer import TOKENIZER_TYPES
from llamapipe.training.arguments.model_args import model_config, run_seq_length, run_tokenizer, run_vocab_size

RECOMPUTE = ("none", "full")


def build_parser() -> argparse.ArgumentParser:
    p = FlagParser(prog="llamapipe profile", description=__doc__.split("\n")[0])
    add_model_flags(p)
    p.add_argument("--seq-length", type=int, default=None, help="tokens per sequence; None: the preset's")
    p.add_argument("--micro-batch-size", type=int, nargs="+", default=[1], help="micro-batch sizes to measure")
    p.add_argument("--recompute", choices=RECOMPUTE, nargs="+", default=["none"],
                   help="activation recompute settings to measure (full: --recompute-granularity full)")
    p.add_argument("--layers", type=int, default=None,
                   help="decoder layers timed together, the per-layer cost being their mean (None: the model's, at "
                        "most 8): a layer in a deep stage runs slower than one alone, whose weights stay in cache")
    p.add_argument("--bf16", action="store_true", help="bf16 parameters and activations")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per process; None: a torchrun rank's (OMP_NUM_THREADS when set, else 1), which "
                        "`plan --profile` and --pipeline-profile require of the run")
    p.add_argument("--repeats", type=int, default=5,
                   help="timed repeats of 4 microbatches per pass (after 1 warm-up repeat)")
    p.add_argument("--out", required=True, help="the JSON profile to write (an existing file only with --force)")
    p.add_argument("--force", action="store_true", help="replace an existing --out")
    p.add_argument("--tokenizer-model", default=None,
                   help="the run's tokenizer, whose vocabulary the embedding and output layer then have (as in "
                        "training)")
    p.add_argument("--tokenizer-type", default=None, choices=TOKENIZER_TYPES, help="kind of --tokenizer-model")
    p.set_defaults(tensor_model_parallel_size=1)
    return p


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], object], device: torch.device) -> tuple[object, float]:
    """`fn()` and its seconds: on a CPU with one torch thread the main thread's CPU time, which other processes
    sharing the cores do not inflate (on a shared machine wall time measures the neighbours' load), else wall
    time between device synchronisations."""
    _sync(device)
    clock = time.thread_time if device.type == "cpu" and torch.get_num_threads() == 1 else time.perf_counter
    start = clock()
    out = fn()
    _sync(device)
    return out, clock() - start


def measure_chunk(chunk: LlamaModel, make_batch: Callable[[], dict], repeats: int, device: torch.device,
                  block: int = 4) -> PassCosts:
    """F, B, W medians of `chunk` and the bytes it holds F->B and B->W, run as the executor runs a split B/W.
    Each repeat times `block` microbatches' F, then their B, then their W back to back (one record per pass:
    the block's mean), so a record spans several scheduler time slices, as a training step does; the first
    repeat is warm-up."""
    store, probe = WeightGradStore(), ActivationProbe([chunk])
    records: list[tuple[Action, float]] = []
    with store.active():
        for i in range(repeats + 1):
            keys = [(0, i * block + k) for k in range(block)]
            outs, f = [], 0.0
            for key in keys:
                batch = make_batch()
                out, seconds = _timed(lambda: chunk(**batch), device)
                probe.forward_done(key, out)
                outs.append(out)
                f += seconds
            b = 0.0
            for key, out in zip(keys, outs):
                with store.capture(key):
                    b += _timed(lambda: torch.autograd.backward(out, torch.ones_like(out)), device)[1]
            del outs, out
            for key in keys:
                probe.backward_done(key, True, store.held_tensors(key))
            w = sum(_timed(lambda: store.run(key), device)[1] for key in keys)
            if i >= 1:
                records += [(Action(kind, 0, i), t / block) for kind, t in (("F", f), ("B", b), ("W", w))]
    store.assert_empty()
    med = pass_medians(records)
    units = probe.units[block:] or probe.units
    act = statistics.median(units) if units else 0.0
    held = statistics.median(probe.held_shares) * act if probe.held_shares else 0.0
    return PassCosts(med["F"], med["B"], med["W"], act, held)


def _chunks(m: LlamaConfig, layers: int, dtype: torch.dtype, device: torch.device) -> dict[str, LlamaModel]:
    kw, chunk_class = dict(params_dtype=dtype), family_of(m).model_class
    chunks = {"layer": chunk_class(m, layer_range=(0, layers), pre_process=False, post_process=False, **kw),
              "embedding": chunk_class(m, layer_range=(0, 0), pre_process=True, post_process=False, **kw),
              "head": chunk_class(m, layer_range=(m.num_layers, m.num_layers), pre_process=False, post_process=True,
                                  **kw)}
    return {name: chunk.to(device) for name, chunk in chunks.items()}


def measure_entry(m: LlamaConfig, seq: int, mbs: int, recompute: str, dtype: torch.dtype, device: torch.device,
                  repeats: int, layers: int = 1) -> dict:
    """One micro-batch size and recompute setting: the three components' costs (a decoder layer's: the mean
    over `layers` run as one chunk)."""
    config = m.replace(recompute_granularity="full" if recompute == "full" else None, recompute_num_layers=None)
    chunks = _chunks(config, layers, dtype, device)

    def ids() -> torch.Tensor:
        return torch.randint(0, m.vocab_size, (mbs, seq), device=device)

    def with_input(chunk: LlamaModel, labels: bool) -> Callable[[], dict]:
        def make() -> dict:
            chunk.set_input_tensor(torch.randn(seq, mbs, m.hidden_size, dtype=dtype, device=device,
                                               requires_grad=True))     # (s, b, h)
            return {"labels": ids()} if labels else {}
        return make
    costs = {"layer": measure_chunk(chunks["layer"], with_input(chunks["layer"], False), repeats,
                                    device).scaled(1 / layers, 1 / layers),
             "embedding": measure_chunk(chunks["embedding"], lambda: {"input_ids": ids()}, repeats, device),
             "head": measure_chunk(chunks["head"], with_input(chunks["head"], True), repeats, device)}
    return {"micro_batch_size": mbs, "recompute": recompute,
            **{name: dataclasses.asdict(c) for name, c in costs.items()}}


def measure_optimizer(m: LlamaConfig, dtype: torch.dtype, device: torch.device, repeats: int) -> float:
    """Seconds per parameter of the trainer's AdamW step plus its grad norm, on one decoder layer's weights."""
    layer = family_of(m).model_class(m, layer_range=(0, 1), pre_process=False, post_process=False,
                                     params_dtype=dtype).to(device)
    params = [p for p in layer.parameters()]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = make_adamw([p for p in params if p.dim() > 1], [p for p in params if p.dim() == 1], OptimizerConfig())

    def step() -> None:
        local_squared_norm([p.grad for p in params])
        opt.step()
    times = [_timed(step, device)[1] for _ in range(repeats + 2)][2:]
    return statistics.median(times) / sum(p.numel() for p in params)


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def profile(args: argparse.Namespace, m: LlamaConfig, seq: int) -> dict:
    """The whole profile (compute on this rank; communication when torch.distributed is up with >1 rank)."""
    device = _device()
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    # compute is measured on rank 0 alone, so no other rank competes for its cores
    if rank0 and device.type == "cpu":
        refusal = profile_machine.load_refusal(torch.get_num_threads(), profile_machine.busy_cores())
        if refusal is not None:
            raise SystemExit(f"llamapipe profile: {refusal}")
    layers = min(args.layers or 8, m.num_layers)
    entries = [measure_entry(m, seq, mbs, rc, dtype, device, args.repeats, layers)
               for mbs in args.micro_batch_size for rc in args.recompute] if rank0 else []
    optimizer = measure_optimizer(m, dtype, device, args.repeats) if rank0 else 0.0
    overhead = profile_overhead.measure(m, seq, args.micro_batch_size[0], dtype, device, args.repeats,
                                        measure_chunk) if rank0 else None
    comm = profile_comm.measure(device, seq * max(args.micro_batch_size) * m.hidden_size * (2 if args.bf16 else 4))
    pipeline = profile_overhead.measure_pipeline(m, seq, args.micro_batch_size[0], dtype, device, args.repeats, comm,
                                                 measure_chunk)
    if overhead is not None and pipeline is not None:
        overhead["pipeline_action_s"] = pipeline
    return profile_schema.make_profile(
        model=dataclasses.asdict(m), seq_length=seq, dtype="bf16" if args.bf16 else "fp32",
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        threads=torch.get_num_threads(), entries=entries,
        optimizer_s_per_param=optimizer, overhead=overhead, comm=comm)


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.repeats < 1 or min(args.micro_batch_size) < 1 or (args.layers is not None and args.layers < 1):
        raise SystemExit(f"llamapipe profile: --repeats {args.repeats}, --micro-batch-size "
                         f"{' '.join(map(str, args.micro_batch_size))} and --layers {args.layers} must be at least 1")
    if args.threads is not None and args.threads < 1:
        raise SystemExit(f"llamapipe profile: --threads {args.threads} must be at least 1")
    if os.path.exists(args.out) and not args.force:
        raise SystemExit(f"llamapipe profile: --out {args.out} exists; give another path, or --force to replace it")
    try:
        check_target(args.out)      # before the measurement: a link is refused, not written through
    except UnsafePathError as err:
        raise SystemExit(f"llamapipe profile: --out: {err}") from None
    torch.set_num_threads(args.threads or profile_schema.run_threads())
    try:
        m = run_vocab_size(args, model_config(args, []), [], run_tokenizer(args))
        seq = run_seq_length(args)
    except ArgumentError as err:
        sys.stderr.write(f"llamapipe profile: {flag_message(err)}\n")
        return 2
    if seq > m.max_position_embeddings:
        m = m.replace(max_position_embeddings=seq)
    distributed = profile_comm.init_if_launched()
    result = profile(args, m, seq)
    if not distributed or torch.distributed.get_rank() == 0:
        profile_schema.write(args.out, result)
        print(profile_schema.summary(result))
    if distributed:
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
