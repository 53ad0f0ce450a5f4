"""The model family registry and its second family, Qwen2 (q/k/v biases), against HF transformers'
Qwen2ForCausalLM (fp32, CPU, single process)."""
import pytest
import torch
import transformers

from llamapipe.model import families
from llamapipe.model.qwen2 import Qwen2Config, Qwen2Model
from llamapipe.model.qwen2.hf import from_hf, to_hf
from tests.hf_family import assert_grads_in_b_match_hf, assert_hf_round_trip

VOCAB = 1003


def _hf_model(tie: bool = False) -> transformers.Qwen2ForCausalLM:
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64,
                                   rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=tie,
                                   attn_implementation="sdpa")
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # HF starts biases at zero and norms at one: make both matter
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def _ours(hf: transformers.Qwen2ForCausalLM) -> Qwen2Model:
    config, state_dict = from_hf(hf.state_dict(), hf.config.to_dict())
    model = Qwen2Model(config)
    model.load_state_dict(state_dict)
    return model


@pytest.mark.parametrize("tie", [False, True])
def test_qwen2_logits_match_hf(tie):
    """Logits of the converted model equal HF Qwen2's (biases non-zero, GQA 8/2, odd vocab, theta 1e6)."""
    hf = _hf_model(tie)
    ours = _ours(hf)
    assert ours.layers["0"].attention.q_proj.bias is not None and ours.layers["0"].attention.o_proj.weight is not None
    ids = torch.randint(0, VOCAB, (2, 24))
    with torch.no_grad():
        expected = hf(input_ids=ids).logits
        got = ours(ids)
        no_bias = _ours(hf)
        for layer in no_bias.layers.values():
            layer.attention.k_proj.bias.zero_()
        without = no_bias(ids)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert (without - expected).abs().max() > 1e-3, "the k bias must change the logits (else the test is blind)"


def test_qwen2_bias_grads_match_hf_and_are_computed_in_b():
    """Bias gradients equal HF's; under a weight-gradient store (zero-bubble B/W split) they are already there
    after B, while the weights' wait for W."""
    hf = _hf_model()
    assert_grads_in_b_match_hf(hf, _ours(hf), torch.randint(0, VOCAB, (2, 20)),
                               {f"{p}_proj.bias": f"model.layers.1.self_attn.{p}_proj.bias" for p in "qkv"},
                               ("q_proj.weight", "model.layers.1.self_attn.q_proj.weight"))


@pytest.mark.parametrize("tie", [False, True])
def test_qwen2_to_hf_round_trip(tie):
    """to_hf(from_hf(x)) gives back exactly HF's tensors and a config transformers builds Qwen2 from."""
    config, state_dict, _ = assert_hf_round_trip(_hf_model(tie), from_hf, to_hf, "qwen2", "Qwen2ForCausalLM")
    assert isinstance(config, Qwen2Config) and config.family == "qwen2"
    assert "layers.0.attention.v_proj.bias" in state_dict


def test_qwen2_refuses_sliding_window():
    cfg = _hf_model().config.to_dict()
    cfg["use_sliding_window"] = True
    with pytest.raises(ValueError, match="sliding"):
        from_hf({}, cfg)


def test_every_preset_resolves_to_a_family_whose_count_equals_the_built_model():
    """Every --model preset has one family; each family's parameter count equals the parameters its chunk
    class builds (vocabulary padded for tp 1 and 2, on the meta device for the large presets)."""
    owners = {}
    for family in families.FAMILIES.values():
        for preset in family.presets:
            assert preset not in owners, f"preset {preset} is in two families"
            owners[preset] = family.name
    assert set(owners) == set(families.PRESETS) and {"tiny", "qwen2-tiny"} <= set(owners)
    for preset, name in owners.items():
        family = families.family_of_preset(preset)
        assert family.name == name
        config = family.config_class(**family.presets[preset])
        assert families.family_of(config) is family and config.family == name
        with torch.device("meta"):
            model = family.model_class(config)
        built = sum(p.numel() for p in model.parameters())
        assert family.parameters(config, 1) == built, preset
        assert families.model_parameters(config, 2) >= built
    assert families.model_parameters(Qwen2Config(**families.PRESETS["qwen2.5-0.5b"])) == 494_032_768  # published


def test_registry_lookups():
    assert families.family_of_hf({"model_type": "qwen2"}).model_class is Qwen2Model
    assert families.family_of_hf({}).name == "llama"
    with pytest.raises(ValueError, match="model_type 'mixtral' is not supported"):
        families.family_of_hf({"model_type": "mixtral"})
    qwen = Qwen2Config(num_layers=2)
    assert families.config_from_dict(dict(qwen.__dict__)) == qwen
    assert families.config_from_dict({"num_layers": 2}).family == "llama"   # a record from before families
    with pytest.raises(ValueError, match="not qwen2"):
        families.FAMILIES["llama"].config_class(family="qwen2")
    with pytest.raises(ValueError, match="--model nope is not a known preset"):
        families.family_of_preset("nope")


def test_flags_pick_the_family():
    """--model qwen2-tiny and Megatron's --add-qkv-bias (with shape flags or a LLaMA preset) give the qwen2
    family; a LLaMA preset alone gives llama."""
    from llamapipe.training.arguments.parser import build_parser, config_from_args

    def model(argv):
        return config_from_args(build_parser().parse_args(argv), 1).model

    shape = ["--mock-data", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             "--max-position-embeddings", "64", "--seq-length", "32", "--vocab-size", "128"]
    assert model(["--mock-data", "--model", "qwen2-tiny"]) == Qwen2Config(**families.PRESETS["qwen2-tiny"])
    qwen = model(shape + ["--add-qkv-bias", "--disable-bias-linear"])
    assert type(qwen) is Qwen2Config and qwen.rope_theta == 10000.0 and qwen.num_layers == 2   # Megatron defaults
    assert type(model(["--mock-data", "--model", "tiny", "--add-qkv-bias"])) is Qwen2Config
    assert model(["--mock-data", "--model", "tiny"]).family == "llama"
