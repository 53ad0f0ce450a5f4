"""Partial recompute (model/recompute.py): Megatron's --recompute-modules and the fork's --recompute-lgd give the
gradients of the run without them bit for bit, and save the bytes the formula counts (within 10%), measured with the
activation probe; the flags' mistakes are one line each."""
import dataclasses

import pytest
import torch

from llamapipe.core.pipeline_parallel.activation_memory import saved_storages
from llamapipe.model.llama import LlamaConfig, LlamaModel
from llamapipe.model.recompute import saved_bytes_per_token
from llamapipe.training.arguments.parser import ArgumentError, build_parser, config_from_args

CONFIG = LlamaConfig(num_layers=2, hidden_size=64, ffn_hidden_size=176, num_attention_heads=4, num_query_groups=2,
                     vocab_size=256, max_position_embeddings=64)
BATCH, SEQ = 2, 32
CASES = [(("core_attn",), "selective"), (("mlp",), "selective"), (("layernorm",), "selective"),
         (("core_attn", "mlp"), "selective"), (("layernorm", "act"), None), (("core_attn", "mlp", "layernorm"), "selective")]


def _step(modules: tuple, granularity):
    torch.manual_seed(0)
    model = LlamaModel(dataclasses.replace(CONFIG, recompute_modules=modules, recompute_granularity=granularity))
    g = torch.Generator().manual_seed(1)
    ids, labels = (torch.randint(0, 256, (BATCH, SEQ), generator=g) for _ in range(2))
    out = model(input_ids=ids, labels=labels)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = sum(s.nbytes() for s in saved_storages(out, params).values())
    out.float().sum().backward()
    return saved, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("modules,granularity", CASES)
def test_partial_recompute_keeps_the_gradients_and_saves_the_formulas_bytes(modules, granularity):
    base_saved, base_grads = _step((), None)
    saved, grads = _step(modules, granularity)
    for name, grad in base_grads.items():
        assert torch.equal(grad, grads[name]), f"{modules}: {name} differs from the run without recompute"
    formula = saved_bytes_per_token(CONFIG, frozenset(modules), 4) * BATCH * SEQ * CONFIG.num_layers
    assert abs((base_saved - saved) - formula) <= 0.10 * formula, (modules, base_saved - saved, formula)


BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters",
        "3", "--mock-data", "--vocab-size", "256"]


def test_flags_become_the_models_modules():
    def modules(*flags):
        return config_from_args(build_parser().parse_args(BASE + list(flags)), 1).model.recompute_modules
    assert modules("--recompute-granularity", "selective") == ("core_attn",)          # Megatron's default
    assert modules("--recompute-activations", "--recompute-modules", "mlp", "layernorm") == ("mlp", "layernorm")
    assert modules("--recompute-lgd") == ("layernorm", "act")
    assert modules("--recompute-granularity", "selective", "--recompute-lgd") == ("core_attn", "layernorm", "act")
    assert modules() == ()


@pytest.mark.parametrize("flags, words", [
    (["--recompute-modules", "mlp"], "--recompute-modules mlp needs --recompute-granularity selective"),
    (["--recompute-granularity", "selective", "--recompute-modules", "moe_act"], "mixture-of-experts or MLA"),
    (["--recompute-granularity", "selective", "--recompute-modules", "attn"], "is not one of Megatron's modules"),
    (["--recompute-granularity", "full", "--recompute-lgd"], "already recomputes whole"),
    (["--recompute-lgd", "--compile"], "--recompute-lgd frees and refills"),
])
def test_recompute_flag_mistakes_are_one_line(flags, words):
    with pytest.raises(ArgumentError) as err:
        config_from_args(build_parser().parse_args(BASE + flags), 1)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_weight_grads_defer_through_checkpointed_mlp_and_freed_outputs():
    """Under the B/W split the recomputed parts' linears still queue their weight gradients (the checkpointed
    MLP's, and the GEMMs after a freed norm or activation output), which then equal the immediate ones."""
    from llamapipe.core.tensor_parallel.weight_grad_store import WeightGradStore
    torch.manual_seed(0)
    plain = LlamaModel(CONFIG)
    torch.manual_seed(0)
    deferred = LlamaModel(dataclasses.replace(CONFIG, recompute_granularity="selective",
                                              recompute_modules=("mlp", "layernorm", "act")))
    ids = torch.randint(0, 256, (2, 16))
    plain(input_ids=ids, labels=ids).sum().backward()
    store = WeightGradStore()
    with store.active():
        out = deferred(input_ids=ids, labels=ids)
    with store.capture("mb0"):
        out.sum().backward()
    params = dict(deferred.named_parameters())
    assert params["layers.0.mlp.down_proj.weight"].grad is None
    assert store.run("mb0") == CONFIG.num_layers * 4 + 1    # per layer: qkv, o, gate/up, down; and the head
    store.assert_empty()
    for name, p in plain.named_parameters():
        torch.testing.assert_close(params[name].grad, p.grad, rtol=0, atol=0, msg=name)
