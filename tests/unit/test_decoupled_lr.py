"""--decoupled-lr / --decoupled-min-lr with Megatron's meaning (issue 39, item 7): the embedding and the output
layer learn at their own peak rate on the same warmup and decay, down to --decoupled-min-lr (default --min-lr);
every other parameter follows --lr. Checked against Megatron's formula per param group and against torch's
AdamW with that rate per group, through the flags, and on resume."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from llamapipe.core.config import ConfigError, OptimizerConfig
from llamapipe.core.optimizer import OptimizerParamScheduler, build_optimizer
from llamapipe.core.parallel_state import ParallelState
from llamapipe.model.llama import LlamaConfig, LlamaModel
from llamapipe.training.arguments.parser import build_parser, config_from_args
from tests.unit.test_optimizer import _megatron_lr

CFG = OptimizerConfig(lr=1e-3, min_lr=1e-4, decoupled_lr=5e-3, decoupled_min_lr=2e-4, lr_warmup_iters=2,
                      lr_decay_iters=10, lr_decay_style="cosine", weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95,
                      clip_grad=0.0)
MODEL = LlamaConfig(num_layers=1, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=4,
                    vocab_size=64, max_position_embeddings=16)


def _groups(optimizer, model) -> dict[str, float]:
    """Each parameter name -> the lr of the param group holding its main tensor."""
    names = dict(zip((id(m) for m in optimizer.mains), optimizer.names))
    return {names[id(p)]: g["lr"] for g in optimizer.param_groups for p in g["params"] if id(p) in names}


@pytest.mark.parametrize("decoupled_min_lr, floor", [(2e-4, 2e-4), (None, 1e-4)])
def test_each_group_follows_megatrons_formula_with_its_own_peak_and_floor(decoupled_min_lr, floor):
    model = LlamaModel(MODEL)
    opt = build_optimizer([model], replace(CFG, decoupled_min_lr=decoupled_min_lr), ParallelState())
    sched = OptimizerParamScheduler(opt, replace(CFG, decoupled_min_lr=decoupled_min_lr), train_iters=12)
    for n in range(13):
        lrs = _groups(opt, model)
        assert set(lrs) == {name for name, _ in model.named_parameters()}
        for name, lr in lrs.items():
            want = (_megatron_lr(n, 2, 10, "cosine", 5e-3, floor) if name in ("embedding.weight", "output.weight")
                    else _megatron_lr(n, 2, 10, "cosine", 1e-3, 1e-4))
            assert lr == pytest.approx(want, rel=1e-12, abs=1e-18), (n, name)
        sched.step()


def test_without_the_flag_every_parameter_follows_lr():
    model = LlamaModel(MODEL)
    cfg = replace(CFG, decoupled_lr=None, decoupled_min_lr=None)
    opt = build_optimizer([model], cfg, ParallelState())
    sched = OptimizerParamScheduler(opt, cfg, train_iters=12)
    sched.step(3)
    want = _megatron_lr(3, 2, 10, "cosine", 1e-3, 1e-4)
    assert all(lr == pytest.approx(want, rel=1e-12) for lr in _groups(opt, model).values())
    assert not any(g.get("decoupled_lr") and g["params"] for g in opt.param_groups)


def test_a_step_updates_each_parameter_as_torch_adamw_at_its_groups_rate():
    torch.manual_seed(0)
    model = LlamaModel(MODEL)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: torch.randn(p.shape, generator=torch.Generator().manual_seed(i))
             for i, (n, p) in enumerate(model.named_parameters())}
    cfg = replace(CFG, lr_warmup_iters=0)
    opt = build_optimizer([model], cfg, ParallelState())
    OptimizerParamScheduler(opt, cfg, train_iters=12)          # step 0: the peak rates
    for n, p in model.named_parameters():
        p.grad = grads[n].clone()
    opt.step()
    for n, p in model.named_parameters():
        ref = torch.nn.Parameter(before[n].clone())
        lr = 5e-3 if n in ("embedding.weight", "output.weight") else 1e-3
        ref.grad = grads[n].clone()
        torch.optim.AdamW([ref], lr=lr, betas=(0.9, 0.95), eps=cfg.adam_eps,
                          weight_decay=0.1 if p.dim() > 1 else 0.0).step()
        torch.testing.assert_close(p.detach(), ref.detach(), rtol=1e-6, atol=1e-9, msg=n)
    params = dict(model.named_parameters())     # Adam's first step moves each element by about its lr
    moved = {n: (params[n] - before[n]).abs().max().item() for n in ("embedding.weight", "layers.0.mlp.up_proj.weight")}
    assert moved["embedding.weight"] > 4 * moved["layers.0.mlp.up_proj.weight"], moved


def test_the_flags_set_it_and_a_lone_decoupled_min_lr_says_it_does_nothing(llamapipe_log):
    args = ["--mock-data", "--lr", "1e-3", "--decoupled-lr", "5e-3", "--decoupled-min-lr", "1e-5"]
    opt = config_from_args(build_parser().parse_args(args), 1).optimizer
    assert (opt.decoupled_lr, opt.decoupled_min_lr) == (5e-3, 1e-5)
    assert not any("--decoupled" in line for line in llamapipe_log)
    config_from_args(build_parser().parse_args(["--mock-data", "--decoupled-min-lr", "1e-5"]), 1)
    assert "notice: --decoupled-min-lr 1e-05 has no effect without --decoupled-lr (as in Megatron-LM): the " \
           "embedding and output layer follow --lr and --min-lr" in llamapipe_log


def test_resume_checks_the_decoupled_schedule_like_the_others():
    holder = torch.nn.Linear(1, 1)
    saved = OptimizerParamScheduler(torch.optim.SGD(holder.parameters(), lr=1.0), CFG, train_iters=12)
    saved.step(4)
    other = OptimizerParamScheduler(torch.optim.SGD(holder.parameters(), lr=1.0), replace(CFG, decoupled_lr=1e-2),
                                    train_iters=12)
    with pytest.raises(ConfigError, match="decoupled_lr gives the embedding and output layer's learning rate 0.01"):
        other.load_state_dict(saved.state_dict())
    other.load_state_dict(saved.state_dict(), use_checkpoint=True)
    assert other.decoupled_max_lr == 5e-3 and other.num_steps == 4
    plain = OptimizerParamScheduler(torch.optim.SGD(holder.parameters(), lr=1.0),
                                    replace(CFG, decoupled_lr=None, decoupled_min_lr=None), train_iters=12)
    plain.load_state_dict(saved.state_dict())         # a run without the flag: its own groups, no decoupled ones
    assert plain.get_lr() == pytest.approx(_megatron_lr(4, 2, 10, "cosine", 1e-3, 1e-4), rel=1e-12)
