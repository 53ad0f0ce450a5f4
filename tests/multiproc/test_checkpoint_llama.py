"""Checkpoint resharding with the real LlamaModel and optimizer: save at tp=2 pp=2 after one AdamW step,
load into tp=1 pp=2 vpp=2 dp=2 (ZeRO-1) and into tp=1 pp=1; weights and optimizer state equal a
single-process reference bit for bit, and so does the forward loss."""
from __future__ import annotations

import pytest
import torch

from llamapipe.training.checkpointing.save_load import LoadResult, load_checkpoint, save_checkpoint
from llamapipe.core.config import OptimizerConfig
from llamapipe.training.config import Config
from llamapipe.core.optimizer import OptimizerParamScheduler, build_optimizer
from llamapipe.core.parallel_state import ParallelState, destroy_model_parallel, initialize_model_parallel
from llamapipe.core.pipeline_parallel.schedule_ir import stage_of
from llamapipe.model.llama import LlamaConfig, LlamaModel
from tests.harness import run_distributed

CFG = LlamaConfig(num_layers=4, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                  vocab_size=1001, make_vocab_size_divisible_by=96, max_position_embeddings=32)
CONFIG = Config(model=CFG)
OPT = OptimizerConfig(clip_grad=0.0)  # no clipping: a grad norm summed in another order could differ in the last bit


def build_chunks(ps: ParallelState, seed: int) -> list[LlamaModel]:
    stages = ps.pp_size * ps.vpp_size
    per = CFG.num_layers // stages
    chunks = []
    for chunk in range(ps.vpp_size):
        stage = stage_of(ps.pp_rank, chunk, ps.pp_size)
        chunks.append(LlamaModel(CFG, ps, layer_range=(stage * per, (stage + 1) * per), pre_process=stage == 0,
                                 post_process=stage == stages - 1, seed=seed))
    return chunks


def trained(chunks: list[LlamaModel], ps: ParallelState, opt_cfg: OptimizerConfig = OPT):
    """One AdamW step with gradient 0.1 x weight: a layout-independent update of every element."""
    with torch.no_grad():
        for p in (p for c in chunks for p in c.parameters()):
            p.mul_(1.5)
            p.grad = p.detach() * 0.1
    optimizer = build_optimizer(chunks, opt_cfg, ps)
    scheduler = OptimizerParamScheduler(optimizer, opt_cfg, 10)
    optimizer.step()
    scheduler.step()
    return optimizer, scheduler


def snapshot(chunks: list[LlamaModel], optimizer) -> dict:
    """Local params and optimizer state as numpy (tensors would cross processes through shared memory)."""
    state = optimizer.state_dict()
    return {"params": {n: p.detach().numpy().copy() for c in chunks for n, p in c.named_parameters()},
            "optim": {n: {f: t.numpy().copy() for f, t in d.items()} for n, d in state["param_state"].items()},
            "step": state["step"]}


def _save_tp2_pp2_load_tp1_pp2_vpp2(rank: int, world: int, save_dir: str) -> dict:
    ps = initialize_model_parallel(tp=2, pp=2)
    chunks = build_chunks(ps, seed=1234)
    optimizer, scheduler = trained(chunks, ps)
    save_checkpoint(save_dir, 1, model_chunks=chunks, optimizer=optimizer, scheduler=scheduler, parallel_state=ps,
                    config=CONFIG, consumed_samples=16)
    destroy_model_parallel()
    ps = initialize_model_parallel(tp=1, pp=2, vpp=2)
    chunks = build_chunks(ps, seed=99)
    opt_cfg = OptimizerConfig(clip_grad=0.0, use_distributed_optimizer=True)
    optimizer = build_optimizer(chunks, opt_cfg, ps)
    scheduler = OptimizerParamScheduler(optimizer, opt_cfg, 10)
    result = load_checkpoint(save_dir, model_chunks=chunks, optimizer=optimizer, scheduler=scheduler,
                             parallel_state=ps, config=CONFIG)
    destroy_model_parallel()
    return {"result": result, "num_steps": scheduler.state_dict()["num_steps"], **snapshot(chunks, optimizer)}


def loss(model: LlamaModel) -> torch.Tensor:
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, CFG.vocab_size, (2, 17), generator=gen)
    with torch.no_grad():
        return model(input_ids=ids[:, :-1], labels=ids[:, 1:]).mean()


def check_equal(snap: dict, reference: LlamaModel, ref_state: dict) -> None:
    assert snap["params"], "no parameters loaded"
    ref_params = dict(reference.named_parameters())
    for name, value in snap["params"].items():
        assert torch.equal(torch.from_numpy(value), ref_params[name].detach()), name
        for field, t in snap["optim"][name].items():
            assert torch.equal(torch.from_numpy(t), ref_state["param_state"][name][field]), f"{name}/{field}"
    assert snap["step"] == ref_state["step"] == 1


@pytest.mark.slow
def test_llama_tp2_pp2_reshards_to_tp1_layouts(tmp_path):
    reference = LlamaModel(CFG, seed=1234)
    ref_optimizer, ref_scheduler = trained([reference], ParallelState())
    ref_state = ref_optimizer.state_dict()
    results = run_distributed(_save_tp2_pp2_load_tp1_pp2_vpp2, 4, str(tmp_path), timeout=240)
    for snap in results:
        assert snap["result"] == LoadResult(1, 16) and snap["num_steps"] == ref_scheduler.state_dict()["num_steps"]
        check_equal(snap, reference, ref_state)
    assert set().union(*(s["params"] for s in results)) == set(dict(reference.named_parameters()))
    single = LlamaModel(CFG, seed=7)
    optimizer = build_optimizer([single], OPT, ParallelState())
    assert load_checkpoint(str(tmp_path), model_chunks=[single], optimizer=optimizer, scheduler=None,
                           parallel_state=None, config=CONFIG) == LoadResult(1, 16)
    check_equal(snapshot([single], optimizer), reference, ref_state)
    torch.testing.assert_close(loss(single), loss(reference), rtol=1e-5, atol=0)
