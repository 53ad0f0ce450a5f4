"""The third model family, Qwen3 (per-head q/k RMSNorm before RoPE, a head dim apart from hidden / heads, no
q/k/v biases), against HF transformers' Qwen3ForCausalLM (fp32, CPU, single process), built from a config by
hand (no hub)."""
import pytest
import torch
import transformers

from llamapipe.model import families
from llamapipe.model.qwen3 import Qwen3Config, Qwen3Model
from llamapipe.model.qwen3.hf import from_hf, to_hf
from tests.hf_family import assert_grads_in_b_match_hf, assert_hf_round_trip

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
    assert_grads_in_b_match_hf(hf, _ours(hf), torch.randint(0, VOCAB, (2, 20)),
                               {f"{p}_norm.weight": f"model.layers.1.self_attn.{p}_norm.weight" for p in "qk"},
                               ("k_proj.weight", "model.layers.1.self_attn.k_proj.weight"))


@pytest.mark.parametrize("tie", [False, True])
def test_qwen3_to_hf_round_trip(tie):
    """to_hf(from_hf(x)) gives back exactly HF's tensors and a config transformers builds Qwen3 from."""
    config, state_dict, rebuilt = assert_hf_round_trip(_hf_model(tie), from_hf, to_hf, "qwen3", "Qwen3ForCausalLM")
    assert isinstance(config, Qwen3Config) and config.family == "qwen3" and config.tie_word_embeddings == tie
    assert "layers.0.attention.q_norm.weight" in state_dict and rebuilt.config.head_dim == 32


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
