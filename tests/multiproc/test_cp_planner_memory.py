"""Activation memory per rank under context parallelism at a long sequence (issue 30): measured on the real
trainer pieces at 8192 tokens, cp 2 holds at most 0.55x and cp 4 at most 0.30x of cp 1's activation peak, and
the planner's prediction (tools/parallel_estimate.rank_memory with Layout.cp) is within 10% of each measured
peak. Measured as tests/multiproc/test_planner_memory.py measures (its LiveActivations: the storages autograd
saves behind each forward, the ring's and all-gather's saved q, k, v, output and log-sum-exp included), over
one forward-backward step of one microbatch, both comm types."""
from __future__ import annotations

import pytest
import torch

from tests.cli import TINY
from tests.harness import run_distributed
from llamapipe.core.pipeline_parallel.runtime import RuntimeOptions
from tests.multiproc.test_planner_memory import LiveActivations

pytestmark = pytest.mark.slow

SEQ = 8192
BASE = TINY + ["--num-layers", "2", "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ),
               "--train-iters", "1", "--global-batch-size", "1", "--micro-batch-size", "1"]


def activation_worker(rank: int, world: int, flags: list[str]) -> int:
    """This rank's activation peak over one forward-backward step, in bytes."""
    from llamapipe.core.parallel_state import destroy_model_parallel, initialize_model_parallel
    from llamapipe.core.pipeline_parallel import executor
    from llamapipe.core.pipeline_parallel.schedules import cached_plan
    from llamapipe.training.arguments.parser import build_parser, config_from_args
    from llamapipe.training.pretrain import set_seeds
    from llamapipe.training.setup import build_iterators, build_model_chunks, forward_step
    config = config_from_args(build_parser().parse_args(BASE + flags), world)
    par = config.parallel
    ps = initialize_model_parallel(par.tp_size, par.pp_size, par.vpp_size, par.order, cp=par.cp_size)
    try:
        set_seeds(config.training.seed, ps.tp_rank)
        chunks, roles = build_model_chunks(config, config.model, ps, torch.device("cpu"))
        iterators, _ = build_iterators(config, config.model, ps, roles, consumed_samples=0)
        live = LiveActivations(chunks)
        executor.run(cached_plan(par.pipeline_schedule, 1, 1, 1), model_chunks=chunks,
                     forward_step_func=forward_step, data_iterator=iterators, parallel_state=ps,
                     num_microbatches=1, options=RuntimeOptions(observers=(live,)))
        return live.peak
    finally:
        destroy_model_parallel()


def predicted(cp: int, comm: str) -> float:
    from llamapipe.tools.parallel_estimate import Layout, rank_memory
    from llamapipe.training.arguments.parser import build_parser, config_from_args
    config = config_from_args(build_parser().parse_args(BASE), 1)
    (rank,) = rank_memory(config.model, Layout(1, 1, 1, 1, "1f1b", 1, "none", False, "fp32", cp=cp, cp_comm=comm),
                          SEQ, 1)
    return rank.activations


def test_activation_memory_per_rank_falls_with_cp_as_the_planner_predicts():
    measured = {(1, "p2p"): max(run_distributed(activation_worker, 1, [], timeout=300))}
    for cp, comm in ((2, "p2p"), (2, "allgather"), (4, "p2p"), (4, "allgather")):
        flags = ["--context-parallel-size", str(cp), "--cp-comm-type", comm]
        measured[cp, comm] = max(run_distributed(activation_worker, cp, flags, timeout=300))
    one = measured[1, "p2p"]
    lines = [f"cp {cp} {comm:<9} measured {m / 2**20:8.2f} MiB ({m / one:.3f}x cp 1), predicted "
             f"{predicted(cp, comm) / 2**20:8.2f} MiB (ratio {predicted(cp, comm) / m:.3f})"
             for (cp, comm), m in measured.items()]
    print("\n".join(lines))
    for (cp, comm), m in measured.items():
        assert m <= {1: 1.0, 2: 0.55, 4: 0.30}[cp] * one, lines
        assert abs(predicted(cp, comm) - m) <= 0.10 * m, lines
