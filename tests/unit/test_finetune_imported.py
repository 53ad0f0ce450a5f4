"""Fine-tuning an imported HF checkpoint (issue 39, item 4): a run whose model is not the checkpoint's gets one
line naming every field that differs, the flags, and --use-checkpoint-args (never the invalid `--model qwen2`);
--use-checkpoint-args takes the whole shape, the family (qwen2 and qwen3 too) and the context the model was
made for, so `--load DIR --use-checkpoint-args --finetune` needs nothing else."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from llamapipe.model.families import PRESETS
from llamapipe.tools import convert_hf
from llamapipe.training.arguments.checkpoint_args import check_saved_model
from llamapipe.training.arguments.parser import build_parser, config_from_args
from llamapipe.model.llama import LlamaConfig

transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=301, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=48, tie_word_embeddings=False)
HF = {"llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE)),
      "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SHAPE)),
      "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SHAPE, head_dim=16))}


@pytest.mark.parametrize("family", list(HF))
def test_use_checkpoint_args_takes_the_imported_models_shape_family_and_context(tmp_path, family):
    torch.manual_seed(0)
    HF[family]().save_pretrained(tmp_path / "hf", safe_serialization=True)
    convert_hf.import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"), 1, 1, None)
    args = build_parser().parse_args(["--mock-data", "--load", str(tmp_path / "ckpt"), "--use-checkpoint-args",
                                      "--finetune", "--global-batch-size", "2"])
    config = config_from_args(args, 1)
    m = config.model
    assert (m.family, m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_query_groups, m.vocab_size) == \
        (family, 2, 32, 48, 2, 301)
    assert config.training.seq_length == 48 == m.max_position_embeddings
    if family == "qwen3":
        assert m.head_dim == 16


def test_a_different_model_names_every_field_and_use_checkpoint_args():
    saved = {**dataclasses.asdict(LlamaConfig.from_name("tiny")), "family": "qwen2", "num_layers": 4, "hidden_size": 32}
    with pytest.raises(ValueError) as info:
        check_saved_model(saved, LlamaConfig.from_name("tiny"), "ckpt/iter_0000000")
    said = str(info.value)
    assert said == ("checkpoint ckpt/iter_0000000 was saved with family qwen2, num_layers 4, hidden_size 32 but "
                    "this run has llama, 8, 128; set --model with a qwen2 preset (qwen2-tiny, qwen2.5-0.5b) or "
                    "--add-qkv-bias, --num-layers 4, --hidden-size 32, or give --use-checkpoint-args to take the "
                    "model's shape from the checkpoint")
    for name in ("qwen2-tiny", "qwen2.5-0.5b"):       # what it suggests is accepted
        assert name in PRESETS
    assert "--model qwen2 " not in said and "qwen2" not in build_parser()._option_string_actions["--model"].choices
    check_saved_model(dataclasses.asdict(LlamaConfig.from_name("tiny")), LlamaConfig.from_name("tiny"), "same")
