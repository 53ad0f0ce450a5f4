"""Llama 3.1/3.2/3.3: RoPE scaling (HF rope_type "llama3") against transformers' LlamaForCausalLM, in convert-hf's
config conversions both ways and under Megatron's flags; the presets' parameter counts against the published
figures and transformers' own count of a model of the same config (fp32, CPU, single process)."""
import pytest
import torch
import transformers

from llamapipe.model import families
from llamapipe.model.llama import LlamaConfig, LlamaModel
from llamapipe.model.llama.config import RopeScaling
from llamapipe.model.llama.hf import config_to_hf, from_hf, to_hf
from llamapipe.training.arguments.parser import ArgumentError, build_parser, config_from_args
from tests.hf_family import exact_round_trip

VOCAB, ORIGINAL = 1003, 64      # a context of 64 "trained" positions, scaled up to 512


def _hf(tie: bool, factor: float, head_dim: int = 16, original: int = ORIGINAL,
        bands: tuple[float, float] = (1.0, 4.0)) -> transformers.LlamaForCausalLM:
    """A random-weight HF model of Llama 3.1's (untied, factor 8) or 3.2's (tied, factor 32) kind, small: with
    rope_theta 5e5 and head dim 16 its frequencies fall in all three of the scaling's bands (kept, interpolated,
    divided by the factor)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=4 * head_dim, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=8 * original, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": factor, "low_freq_factor": bands[0],
                      "high_freq_factor": bands[1], "original_max_position_embeddings": original},
        rms_norm_eps=1e-5, tie_word_embeddings=tie, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _ours(hf: transformers.LlamaForCausalLM, **changes) -> LlamaModel:
    config, state_dict = from_hf(hf.state_dict(), hf.config)
    model = LlamaModel(config.replace(**changes)).eval()
    model.load_state_dict(state_dict)
    return model


@pytest.mark.parametrize("tie,factor,bands", [(False, 8.0, (1.0, 4.0)), (True, 32.0, (1.0, 4.0)),
                                             (False, 4.0, (2.0, 8.0))],
                         ids=["llama3.1-shaped", "llama3.2-tied", "own-bands"])
def test_logits_match_hf_beyond_the_original_context(tie, factor, bands):
    """Logits equal HF's within 1e-5 over 320 positions (5x the original context) and at explicit positions far
    beyond it; without the scaling they differ by 100 times the tolerance (so the comparison sees it). Band factors
    other than Megatron's 1 and 4 too (a checkpoint's own, which --use-checkpoint-args takes: issue 49)."""
    hf = _hf(tie, factor, bands=bands)
    ours = _ours(hf)
    config = ours.config
    assert (config.use_rope_scaling, config.rope_scaling_factor, config.tie_word_embeddings) == (True, factor, tie)
    assert config.rope_original_max_position_embeddings == ORIGINAL
    assert (config.rope_low_freq_factor, config.rope_high_freq_factor) == bands
    ids = torch.randint(0, VOCAB, (2, 5 * ORIGINAL), generator=torch.Generator().manual_seed(1))
    far = torch.arange(7 * ORIGINAL, 8 * ORIGINAL).expand(2, ORIGINAL)
    with torch.no_grad():
        expected, got = hf(input_ids=ids).logits, ours(ids)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
        torch.testing.assert_close(ours(ids[:, :ORIGINAL], position_ids=far),
                                   hf(input_ids=ids[:, :ORIGINAL], position_ids=far).logits, rtol=0, atol=1e-5)
        plain = _ours(hf, use_rope_scaling=False)(ids)
    assert (plain - expected)[:, ORIGINAL:].abs().max() > 1e-3     # 100x the tolerance


@pytest.mark.parametrize("tie,factor", [(False, 8.0), (True, 32.0)], ids=["llama3.1-shaped", "llama3.2-tied"])
def test_export_round_trip_is_bit_equal(tie, factor):
    """to_hf(from_hf(x)) gives back HF's tensors exactly (tied: one embedding tensor, lm_head its alias) and a
    config.json with Meta's rope_scaling dict, which transformers reads back as the same RoPE parameters."""
    hf = _hf(tie, factor)
    config, _, hf_sd, hf_cfg = exact_round_trip(hf, from_hf, to_hf)
    assert hf_cfg["rope_scaling"] == {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": ORIGINAL}
    assert hf_cfg["tie_word_embeddings"] is tie
    rebuilt = transformers.LlamaConfig(**hf_cfg)
    assert rebuilt.rope_parameters == hf.config.rope_parameters
    assert from_hf(hf_sd, hf_cfg)[0] == config     # and the config.json form imports to the same config


def test_meta_config_json_form_imports():
    """A config.json as Meta ships Llama 3.1 (rope_theta beside a rope_scaling dict) gives the same config as
    transformers' rope_parameters form."""
    hf = _hf(False, 8.0)
    as_dict = hf.config.to_dict()
    params = as_dict.pop("rope_parameters")
    shipped = dict(as_dict, rope_theta=params.pop("rope_theta"), rope_scaling=params)
    assert families.family_of_hf(shipped).config_from_hf(shipped) == from_hf(hf.state_dict(), hf.config)[0]


@pytest.mark.parametrize("rope,fragment", [
    ({"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}, "HF rope type 'yarn' is not supported"),
    ({"type": "linear", "factor": 2.0}, "HF rope type 'linear' is not supported"),
    ({"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5},
     "HF rope type 'llama3' needs low_freq_factor, high_freq_factor, original_max_position_embeddings"),
], ids=["yarn", "old-type-key", "llama3-incomplete"])
def test_other_rope_types_are_refused_in_one_line(rope, fragment):
    cfg = _hf(False, 8.0).config.to_dict()
    cfg.pop("rope_parameters")
    cfg["rope_scaling"] = rope
    with pytest.raises(ValueError) as info:
        from_hf({}, cfg)
    assert fragment in str(info.value) and "\n" not in str(info.value)


# Published parameter counts (Meta's model cards: 8.03B, 70.6B, 405.9B, 1.24B, 3.21B) to the parameter.
PUBLISHED = {"llama3.1-8b": 8_030_261_248, "llama3.1-70b": 70_553_706_496, "llama3.1-405b": 405_853_388_800,
             "llama3.2-1b": 1_235_814_400, "llama3.2-3b": 3_212_749_824, "llama3.3-70b": 70_553_706_496}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_preset_parameter_count_equals_published_and_hf(preset):
    """The preset's count (model/llama/counts.py) equals the published figure and the parameters of HF's
    LlamaForCausalLM built on the meta device from the preset's config.json (tied: the embedding counted once)."""
    config = LlamaConfig.from_name(preset)
    assert families.family_of_preset(preset).name == "llama"
    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config_to_hf(config)))
    hf_count = sum(p.numel() for p in hf.parameters())     # parameters() yields a tied weight once
    assert families.model_parameters(config) == hf_count == PUBLISHED[preset]
    assert hf.config.rope_parameters["rope_type"] == "llama3"
    assert hf.config.tie_word_embeddings is preset.startswith("llama3.2")


def cfg(argv):
    return config_from_args(build_parser().parse_args(["--mock-data", "--seq-length", "32"] + argv), 1)


SHAPE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--max-position-embeddings",
         "64", "--vocab-size", "128"]


def test_megatron_flags(llamapipe_log):
    """--use-rope-scaling with Megatron's default factor 8 and LLaMA 3.1's 1 / 4 / 8192; --rope-scaling-factor
    overrides a preset's; alone it has no effect (a notice, as in Megatron); a factor <= 0 is refused."""
    on = cfg(SHAPE + ["--use-rope-scaling"]).model
    assert on.rope_scaling == RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                          original_max_position_embeddings=8192)
    assert cfg(SHAPE).model.rope_scaling is None
    small = cfg(["--model", "llama3.2-1b", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8",
                 "--num-query-groups", "2", "--ffn-hidden-size", "128", "--rope-scaling-factor", "16"]).model
    assert (small.rope_scaling_factor, small.tie_word_embeddings, small.rope_theta) == (16.0, True, 500000.0)
    off = cfg(SHAPE + ["--rope-scaling-factor", "32"]).model
    assert off.rope_scaling is None and off.rope_scaling_factor == 8.0
    assert any("--rope-scaling-factor 32 has no effect without --use-rope-scaling" in line for line in llamapipe_log)
    with pytest.raises(ArgumentError, match="--rope-scaling-factor 0 must be positive"):
        cfg(SHAPE + ["--use-rope-scaling", "--rope-scaling-factor", "0"])


def test_use_checkpoint_args_takes_the_rope_scaling(tmp_path):
    """--use-checkpoint-args forces the checkpoint's RoPE scaling (as Megatron forces the RoPE base and percent),
    and a run whose scaling differs from the checkpoint's is refused at load naming the flag."""
    import dataclasses
    from llamapipe.training.checkpointing.resharding import model_specs
    from llamapipe.training.checkpointing.io import write_layout
    from llamapipe.training.arguments.checkpoint_args import check_saved_model
    saved = LlamaConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
                        vocab_size=128, max_position_embeddings=64, use_rope_scaling=True, rope_scaling_factor=32.0)
    state = {name: p.detach() for name, p in LlamaModel(saved).named_parameters()}
    write_layout(str(tmp_path), 3, state, model_specs(saved, 1), dataclasses.asdict(saved), tp=1, pp=1)
    taken = cfg(["--use-checkpoint-args", "--load", str(tmp_path)] + SHAPE).model
    assert taken.rope_scaling == saved.rope_scaling
    with pytest.raises(ValueError, match="set --use-rope-scaling True"):
        check_saved_model(dataclasses.asdict(saved), saved.replace(use_rope_scaling=False), "ckpt")


def test_convert_hf_import_at_tp2_pp2_and_export_give_the_directory_back(tmp_path):
    """A Llama-3.2-shaped HF directory (tied, scaled RoPE) through `convert-hf import` at tp 2 x pp 2 and `export`:
    the exported weights equal the original tensors bit for bit (one embedding tensor, no lm_head), config.json
    keeps the rope_scaling dict and tie_word_embeddings true, and transformers' logits of it equal the original's."""
    import json
    from safetensors.torch import load_file
    from llamapipe.tools.convert_hf import export_hf, import_hf
    hf = _hf(True, 32.0, original=8192)    # the original context training sets (an import refuses others: issue 51)
    hf.save_pretrained(tmp_path / "hf")
    import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"), 2, 2, None)
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "out"))
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert "lm_head.weight" not in exported
    original = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    assert set(exported) == set(original) and all(torch.equal(exported[k], v) for k, v in original.items())
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["rope_scaling"]["factor"] == 32.0
    reloaded = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    ids = torch.randint(0, VOCAB, (1, 3 * ORIGINAL), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, hf(ids).logits, rtol=0, atol=1e-5)
