"""Our V-Half, written to torch's CSV format here (schedule_csv.to_csv), run by torch.distributed.pipelining's own
`_PipelineScheduleRuntime` (`_load_csv`, lowered to its send/recv actions, with its I/W split) on 2 gloo ranks:
it runs to the end, every deferred weight gradient runs once, and its per-microbatch losses equal our executor's
on the same plan (fp32, rel 1e-5), and so do every parameter's gradients (relative L2 1e-5). The model is our
LlamaModel behind torch's stage interface, as the schedule benchmark runs it (benchmarks/torch_adapter.py), with
the stages' input and output given (torch's static mode: its inference on the first step would run a backward on
uninitialized tensors, whose weight gradients our linears keep; tests/multiproc/test_torch_adapter_grads.py)."""
from __future__ import annotations

import os
import tempfile
from argparse import Namespace

import pytest
import torch

from tests.harness import run_distributed

pytestmark = pytest.mark.slow


def _worker(rank: int, world: int, csv_text: str, m: int) -> dict:
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    from benchmarks.schedules_real import llama_chunks, llama_config, loss_step
    from benchmarks.torch_adapter import CapturedWeightGrads, TorchStage, static_io
    from llamapipe.core.parallel_state import initialize_model_parallel
    from llamapipe.core.pipeline_parallel import executor
    from llamapipe.core.pipeline_parallel.schedule_csv import from_csv
    ps = initialize_model_parallel(1, world, 2)
    config = llama_config(Namespace(layers=4, hidden=64, seq=16))
    plan = from_csv(csv_text, name="v-half")
    g = torch.Generator().manual_seed(7)
    batches = [{"input_ids": torch.randint(0, 1024, (1, 16), generator=g),
                "labels": torch.randint(0, 1024, (1, 16), generator=g)} for _ in range(m)]
    ours = llama_chunks(config, ps, "v-half", 2)
    our_losses = executor.run(plan, model_chunks=ours, forward_step_func=loss_step,
                              data_iterator=[iter(batches) for _ in ours], parallel_state=ps, num_microbatches=m)

    tokens, labels = torch.cat([b["input_ids"] for b in batches]), torch.cat([b["labels"] for b in batches])
    theirs, dw = llama_chunks(config, ps, "v-half", 2), CapturedWeightGrads()
    stages = [PipelineStage(TorchStage(c), plan.stage_of(ps.pp_rank, i), 2 * world, torch.device("cpu"),
                            group=ps.pp_group, dw_builder=dw, **static_io(c, config, tokens, m))
              for i, c in enumerate(theirs)]

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), target.flatten(), reduction="sum")
    schedule = _PipelineScheduleRuntime(stages, m, loss_fn=loss_fn, scale_grads=False)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "v_half.csv")
        with open(path, "w") as fh:
            fh.write(csv_text)
        schedule._load_csv(path)
    lowered = [str(a) for a in schedule.pipeline_order_with_comms[ps.pp_rank]]
    first, last = any(c.pre_process for c in theirs), any(c.post_process for c in theirs)
    torch_losses: list = []
    with dw.capturing():           # asserts at the end that every deferred weight gradient ran
        schedule.step(*((tokens,) if first else ()), target=labels if last else None,
                      losses=torch_losses if last else None)
    grad_error = {key: float((p.grad - q.grad).norm() / q.grad.norm())
                  for mine, other in zip(ours, theirs)
                  for (key, q), (_, p) in zip(mine.named_parameters(), other.named_parameters())}
    return {"ours": [float(x["loss_sum"]) for x in our_losses], "torch": [float(x.detach()) for x in torch_losses],
            "lowered": lowered, "weight_passes": dw.count, "grad_error": grad_error}


def test_our_v_half_file_runs_in_torchs_runtime_with_our_losses():
    from llamapipe.core.pipeline_parallel.schedule_csv import to_csv
    from llamapipe.core.pipeline_parallel.schedule_specs import build
    m = 4
    csv_text = to_csv(build("v-half", 2, 2, m))
    results = run_distributed(_worker, 2, csv_text, m, timeout=300)
    for rank, r in enumerate(results):
        assert any(a.startswith(f"{3 - rank}SEND_") or "RECV_" in a for a in r["lowered"])   # torch lowered it
        assert r["weight_passes"] == 2 * m                     # one I (and its W) per microbatch and chunk
        worst = max(r["grad_error"].items(), key=lambda kv: kv[1] if kv[1] == kv[1] else float("inf"))
        assert len(r["grad_error"]) > 10 and worst[1] <= 1e-5, f"rank {rank}: torch's gradient off for {worst}"
    holders = [r for r in results if r["ours"]]
    assert len(holders) == 1 and len(holders[0]["ours"]) == m   # the last stage: rank 0's second chunk
    torch.testing.assert_close(torch.tensor(holders[0]["torch"]), torch.tensor(holders[0]["ours"]), rtol=1e-5,
                               atol=0)
