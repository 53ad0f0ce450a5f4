"""Our LlamaModel against HF transformers LlamaForCausalLM (fp32, CPU, single process)."""
import pytest
import torch
import torch.nn.functional as F
import transformers

from llamapipe.core.tensor_parallel.weight_grad_store import WeightGradStore
from llamapipe.model.llama import LlamaConfig
from llamapipe.model.llama.hf import from_hf, to_hf
from llamapipe.model.llama import LlamaModel
from tests.hf_family import exact_round_trip

VOCAB = 1003


def _hf_model(tie: bool = False) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64,
                                   rope_theta=50000.0, rms_norm_eps=1e-5, tie_word_embeddings=tie,
                                   attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # HF zero-inits nothing we care about, but make norms non-trivial
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _ours(hf: transformers.LlamaForCausalLM, **changes) -> LlamaModel:
    config, state_dict = from_hf(hf.state_dict(), hf.config)
    model = LlamaModel(config.replace(**changes))
    model.load_state_dict(state_dict)
    return model


@pytest.mark.parametrize("tie", [False, True])
def test_logits_match_hf(tie):
    """Logits of the converted model equal HF's (GQA 8 heads / 2 groups, odd vocab, rope_theta 5e4)."""
    hf = _hf_model(tie)
    ours = _ours(hf)
    ids = torch.randint(0, VOCAB, (2, 24))
    with torch.no_grad():
        expected = hf(input_ids=ids).logits
        got = ours(ids)
    assert got.shape == (2, 24, VOCAB)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_position_ids_match_hf():
    """Explicit (shifted) position ids go through RoPE like HF's."""
    hf, ids = _hf_model(), torch.randint(0, VOCAB, (2, 16))
    ours = _ours(hf)
    pos = torch.arange(5, 21).expand(2, 16)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, position_ids=pos), hf(input_ids=ids, position_ids=pos).logits,
                                   rtol=0, atol=1e-5)


@pytest.mark.parametrize("recompute", [None, "full", "selective"])
def test_loss_and_grads_match_hf(recompute):
    """Mean per-token loss on shifted labels equals HF's labels loss; embedding/q grads agree."""
    hf = _hf_model()
    ours = _ours(hf, recompute_granularity=recompute)
    ids = torch.randint(0, VOCAB, (2, 20))
    hf_loss = hf(input_ids=ids, labels=ids).loss
    losses = ours(ids[:, :-1], labels=ids[:, 1:])
    assert losses.shape == (2, 19) and losses.dtype == torch.float32
    torch.testing.assert_close(losses.mean(), hf_loss, rtol=1e-6, atol=1e-6)
    hf_loss.backward()
    losses.mean().backward()
    hf_params = dict(hf.named_parameters())
    torch.testing.assert_close(ours.layers["0"].attention.q_proj.weight.grad,
                               hf_params["model.layers.0.self_attn.q_proj.weight"].grad, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(ours.embedding.weight.grad[:VOCAB], hf_params["model.embed_tokens.weight"].grad,
                               rtol=1e-4, atol=1e-7)
    assert torch.count_nonzero(ours.output.weight.grad[VOCAB:]) == 0, "padding rows must not get gradient"


def test_vocab_padding_is_excluded_from_loss():
    """Large padding-row weights change nothing: loss equals F.cross_entropy on the unpadded logits."""
    hf = _hf_model()
    ours = _ours(hf)
    with torch.no_grad():
        ours.output.weight[VOCAB:] = 100.0
    ids = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        logits = ours(ids)
        losses = ours(ids, labels=ids)
    expected = F.cross_entropy(logits.reshape(-1, VOCAB), ids.reshape(-1), reduction="none").view(2, 12)
    torch.testing.assert_close(losses, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tie", [False, True])
def test_to_hf_round_trip(tie):
    """to_hf(from_hf(x)) gives back exactly HF's tensors and a config transformers accepts."""
    _, _, hf_sd, hf_cfg = exact_round_trip(_hf_model(tie), from_hf, to_hf)
    rebuilt = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_cfg))
    rebuilt.load_state_dict(hf_sd)
    assert rebuilt.config.rope_parameters["rope_theta"] == 50000.0


def test_from_hf_rejects_unknown_rope_scaling():
    """Llama 3.1's "llama3" type is converted (tests/unit/test_model_llama3.py); others are refused."""
    hf = _hf_model()
    cfg = hf.config.to_dict()
    cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 5e5, "factor": 8.0}
    with pytest.raises(ValueError, match="rope type"):
        from_hf(hf.state_dict(), cfg)


def test_init_is_seeded_by_name():
    """Same seed -> same weights; the output head starts with zero padding rows; different seeds differ."""
    config = LlamaConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                         num_query_groups=2, vocab_size=100)
    a, b, c = LlamaModel(config, seed=7), LlamaModel(config, seed=7), LlamaModel(config, seed=8)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.output.weight, c.output.weight)
    assert torch.count_nonzero(a.output.weight[100:]) == 0
    assert {n for n, _ in a.named_parameters()} >= {"embedding.weight", "layers.1.mlp.down_proj.weight",
                                                   "final_norm.weight", "output.weight"}


def test_weight_grad_seam():
    """Inside capture(key) linear weight grads stay None until run(key); then they equal the plain grads."""
    config = LlamaConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                         num_query_groups=2, vocab_size=100)
    plain, deferred = LlamaModel(config), LlamaModel(config)
    ids = torch.randint(0, 100, (2, 8))
    plain(ids, labels=ids).sum().backward()
    store = WeightGradStore()
    with store.capture("mb0"):
        deferred(ids, labels=ids).sum().backward()
    linear = [n for n, p in deferred.named_parameters() if p.ndim == 2 and "embedding" not in n]
    params = dict(deferred.named_parameters())
    assert len(linear) == 2 * 7 + 1
    assert all(params[n].grad is None for n in linear)
    assert params["embedding.weight"].grad is not None and params["final_norm.weight"].grad is not None
    assert store.run("mb0") == 2 * 4 + 1  # per layer: qkv, o, gate/up, down; plus the head
    store.assert_empty()
    for name, p in plain.named_parameters():
        assert torch.equal(params[name].grad, p.grad), name


def test_bf16_params_give_fp32_loss_close_to_fp32():
    """params_dtype bf16: same seeded weights, loss stays fp32 and close to the fp32 model's; grads are bf16."""
    config = LlamaConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                         num_query_groups=2, vocab_size=100)
    full, half = LlamaModel(config), LlamaModel(config, params_dtype=torch.bfloat16)
    ids = torch.randint(0, 100, (2, 8))
    losses = half(ids, labels=ids)
    assert losses.dtype == torch.float32
    torch.testing.assert_close(losses, full(ids, labels=ids), rtol=2e-2, atol=2e-2)
    losses.mean().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in half.parameters())


def test_rmsnorm_and_rope_functions_match_autograd_reference():
    """The hand-written RMSNorm and RoPE backward passes equal autograd over the textbook formulas."""
    from llamapipe.model.layers import RMSNorm
    from llamapipe.model.rotary import RotaryEmbedding, apply_rotary
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 2, 3, 16, generator=gen)
    grad = torch.randn(6, 2, 3, 16, generator=gen)
    norm = RMSNorm(16, 1e-5)
    with torch.no_grad():
        norm.weight.add_(0.1 * torch.randn(16, generator=gen))
    cos, sin = RotaryEmbedding(16, 8, 10000.0)(6, None, torch.float32)

    def reference(t):
        normed = norm.weight * (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-5))
        rotated = torch.cat([-normed[..., 8:], normed[..., :8]], dim=-1)
        return normed * cos + rotated * sin

    results = []
    for fn in (reference, lambda t: apply_rotary(norm(t), (cos, sin))):
        leaf = x.clone().requires_grad_()
        norm.weight.grad = None
        out = fn(leaf)
        out.backward(grad)
        results.append((out, leaf.grad, norm.weight.grad))
    for got, expected in zip(results[1], results[0]):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
