"""The dry run's parameter and optimizer-state bytes against a real run's, exactly (issue 41).

Four small layouts run here for real (gloo, two ranks each): tp 2, pp 2 under ZB-V, dp 2 under ZeRO-3 (FSDP2) and
cp 2. Each rank builds its chunks and optimizer as the trainer does, runs one real step (so Adam's state exists)
and measures the distinct storages of its parameters (FSDP's local shards) and of Adam's moments and the fp32
masters that are not the parameters themselves, as allocated. The dry run builds the same ranks on fake process
groups and meta tensors; its role for each real rank (the same tp, cp and pp index) must report the same bytes.
"""
from __future__ import annotations

import torch

from tests.cli import TINY
from tests.harness import run_distributed

BASE = TINY + ["--train-iters", "1", "--global-batch-size", "8", "--micro-batch-size", "2", "--bf16"]
CASES = {
    "tp2": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2 zbv": ["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
                "--pipeline-schedule", "zbv"],
    "dp2 zero3": ["--data-parallel-sharding-strategy", "optim_grads_params"],
    "cp2": ["--context-parallel-size", "2"],
}


def _bytes(tensors) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def _measure(config, ps) -> dict:
    """One real step; the bytes of this rank's parameters and optimizer state."""
    from llamapipe.core.distributed.fsdp import local_tensor
    from llamapipe.core.distributed.grad_reduce import finalize_model_grads
    from llamapipe.core.optimizer import build_optimizer
    from llamapipe.core.pipeline_parallel import executor
    from llamapipe.core.pipeline_parallel.schedules import cached_plan
    from llamapipe.training.pretrain import set_seeds
    from llamapipe.training.setup import build_iterators, build_model_chunks, forward_step
    set_seeds(config.training.seed, ps.tp_rank)
    chunks, roles = build_model_chunks(config, config.model, ps, torch.device("cpu"))
    optimizer = build_optimizer(chunks, config.optimizer, ps)
    iterators, _ = build_iterators(config, config.model, ps, roles, consumed_samples=0)
    m = config.training.num_microbatches
    executor.run(cached_plan(config.parallel.pipeline_schedule, ps.pp_size, ps.vpp_size, m), model_chunks=chunks,
                 forward_step_func=forward_step, data_iterator=iterators, parallel_state=ps, num_microbatches=m)
    finalize_model_grads(chunks, ps, None, global_tokens=config.training.global_batch_size * config.training.seq_length)
    assert optimizer.step().update_successful
    params = [local_tensor(p) for c in chunks for p in c.parameters()]
    own = {p.untyped_storage().data_ptr() for p in params}
    state = [t for s in optimizer.inner.state.values() for k, t in s.items() if k != "step"]
    masters = [m for m in optimizer.mains if m.untyped_storage().data_ptr() not in own]
    return {"coords": (ps.tp_rank, ps.cp_rank, ps.pp_rank, ps.dp_rank), "params": _bytes(params),
            "optimizer": _bytes(state + masters)}


def worker(rank: int, world: int, cases: dict) -> dict:
    from llamapipe.core.parallel_state import destroy_model_parallel, initialize_model_parallel
    from llamapipe.training.arguments.parser import build_parser, config_from_args
    out = {}
    for name, flags in cases.items():
        config = config_from_args(build_parser().parse_args(BASE + flags), world)
        par = config.parallel
        ps = initialize_model_parallel(par.tp_size, par.pp_size, par.vpp_size, par.order, cp=par.cp_size)
        try:
            out[name] = _measure(config, ps)
        finally:
            destroy_model_parallel()
    return out


def test_meta_bytes_of_parameters_and_optimizer_state_equal_the_real_runs():
    from llamapipe.training.dry_run.main import build_parser, dry_run_config, run
    real = run_distributed(worker, 2, CASES, timeout=300)
    for name, flags in CASES.items():
        reports = run(dry_run_config(build_parser().parse_args(["--world-size", "2"] + BASE + flags))).reports
        for measured in (r[name] for r in real):
            tp, cp, pp, dp = measured["coords"]
            if dp:          # the role's dry run is its dp index 0 (ZeRO-3 pads every shard to the same size)
                continue
            report = next(r for r in reports if (r.role.coords["tp"], r.role.coords["cp"], r.role.coords["pp"])
                          == (tp, cp, pp))
            assert (report.params, report.optimizer) == (measured["params"], measured["optimizer"]), name
