"""The third model family, Qwen3 (per-head q/k RMSNorm before RoPE, a head dim apart from hidden / heads, no
q/k/v biases), against HF transformers' Qwen3ForCausalLM (fp32, CPU, single process), built from a config by
hand (no hub)."""
import pytest
import torch
import transformers

from llamapipe.core.tensor_parallel.weight_grad_store import WeightGradStore
from llamapipe.model import families
from llamapipe.model.qwen3 import Qwen3Config, Qwen3Model
from llamapipe.model.qwen3.hf import from_hf, to_hf

VOCAB = 1003


def _hf_model(tie: bool = False) -> transformers.Qwen3ForCausalLM:
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                   max_position_embeddings=64, rope_theta=1e6, rms_norm_eps=1e-6,
                                   tie_word_embeddings=tie, attn_implementation="sdpa")
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():  # HF starts norms at one: make every norm, the q/k ones included, matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _ours(hf: transformers.Qwen3ForCausalLM) -> Qwen3Model:
    config, state_dict = from_hf(hf.state_dict(), hf.config.to_dict())
    model = Qwen3Model(config)
    model.load_state_dict(state_dict)
    return model


@pytest.mark.parametrize("tie", [False, True])
def test_qwen3_logits_match_hf(tie):
    """Logits of the converted model equal HF Qwen3's within 1e-5 (head dim 32 with 4 heads of a 64-wide model,
    GQA 4/2, odd vocabulary, theta 1e6), and the k norm changes them (else the test would be blind to it)."""
    hf = _hf_model(tie)
    ours = _ours(hf)
    attention = ours.layers["0"].attention
    assert attention.q_proj.bias is None and attention.q_norm.weight.shape == (32,)
    assert ours.config.head_dim == 32 and ours.config.kv_channels == 32
    ids = torch.randint(0, VOCAB, (2, 24))
    with torch.no_grad():
        expected = hf(input_ids=ids).logits
        got = ours(ids)
        unnormed = _ours(hf)
        for layer in unnormed.layers.values():
            layer.attention.k_norm.weight.fill_(1.0)
        without = unnormed(ids)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert (without - expected).abs().max() > 1e-3, "the k norm's scale must change the logits"


def test_qwen3_qk_norm_grads_match_hf_and_are_computed_in_b():
    """q/k norm gradients equal HF's; under a weight-gradient store (zero-bubble B/W split) they are there after
    B, while the projections' weights wait for W."""
    hf = _hf_model()
    ours = _ours(hf)
    ids = torch.randint(0, VOCAB, (2, 20))
    hf(input_ids=ids, labels=ids).loss.backward()
    store = WeightGradStore()
    with store.capture("mb0"):
        ours(ids[:, :-1], labels=ids[:, 1:]).mean().backward()
    attention = ours.layers["1"].attention
    assert attention.q_proj.weight.grad is None, "the weight gradient is deferred to W"
    hf_params = dict(hf.named_parameters())
    for p in "qk":
        torch.testing.assert_close(getattr(attention, f"{p}_norm").weight.grad,
                                   hf_params[f"model.layers.1.self_attn.{p}_norm.weight"].grad, rtol=1e-4, atol=1e-7)
    store.run("mb0")
    torch.testing.assert_close(attention.k_proj.weight.grad, hf_params["model.layers.1.self_attn.k_proj.weight"].grad,
                               rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("tie", [False, True])
def test_qwen3_to_hf_round_trip(tie):
    """to_hf(from_hf(x)) gives back exactly HF's tensors and a config transformers builds Qwen3 from."""
    hf = _hf_model(tie)
    config, state_dict = from_hf(hf.state_dict(), hf.config.to_dict())
    assert isinstance(config, Qwen3Config) and config.family == "qwen3" and config.tie_word_embeddings == tie
    assert "layers.0.attention.q_norm.weight" in state_dict
    hf_sd, hf_cfg = to_hf(config, state_dict)
    original = hf.state_dict()
    assert set(hf_sd) == set(original)
    for name, tensor in original.items():
        assert torch.equal(hf_sd[name], tensor), name
    assert hf_cfg["model_type"] == "qwen3" and hf_cfg["architectures"] == ["Qwen3ForCausalLM"]
    rebuilt = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**hf_cfg))
    assert type(rebuilt).__name__ == "Qwen3ForCausalLM" and rebuilt.config.head_dim == 32
    rebuilt.load_state_dict(hf_sd)


@pytest.mark.parametrize("change, words", [({"use_sliding_window": True, "sliding_window": 16}, "sliding"),
                                           ({"attention_bias": True}, "attention_bias")])
def test_qwen3_refuses_what_ours_does_not_have(change, words):
    cfg = transformers.Qwen3Config(num_hidden_layers=2, **change).to_dict()
    with pytest.raises(ValueError, match=words):
        from_hf({}, cfg)


def test_qwen3_registry_and_flags():
    """The registry finds qwen3 by HF model_type and by preset; qwen3-0.6b counts the parameters of HF's
    Qwen3ForCausalLM of the published shape (built on the meta device, tied embeddings counted once)."""
    from llamapipe.training.arguments.parser import build_parser, config_from_args
    family = families.family_of_hf({"model_type": "qwen3"})
    assert family.model_class is Qwen3Model and family.spec.qk_norm and not family.spec.qkv_bias
    assert families.qkv_bias_family().name == "qwen2"
    preset = Qwen3Config(**families.PRESETS["qwen3-0.6b"])
    hf_config = transformers.Qwen3Config(**family.config_to_hf(preset))
    with torch.device("meta"):
        published = transformers.Qwen3ForCausalLM(hf_config)
    assert families.model_parameters(preset) == published.num_parameters() == 596_049_920
    qwen = Qwen3Config(num_layers=2, kv_channels=24)
    assert families.config_from_dict(dict(qwen.__dict__)) == qwen
    args = build_parser().parse_args(["--mock-data", "--model", "qwen3-tiny"])
    assert config_from_args(args, 1).model == Qwen3Config(**families.PRESETS["qwen3-tiny"])
