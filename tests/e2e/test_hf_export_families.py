"""Every family's export with every tokenizer kind loads through transformers' Auto classes alone (issue 39,
item 2): for llama, qwen2 and qwen3 checkpoints with a sentencepiece model and with a byte-level BPE
tokenizer.json, `AutoTokenizer` on the export directory gives the ids our tokenizer gives (the ids training
saw) and `AutoModelForCausalLM.generate` gives our model's greedy continuation of the same prompt."""
from __future__ import annotations

import pytest
import torch

from llamapipe.data.tokenizer import build_tokenizer
from llamapipe.model.families import config_from_dict, family_of
from llamapipe.tools import convert_hf, make_sample_corpus, train_tokenizer
from llamapipe.training.checkpointing import io as cio
from llamapipe.training.checkpointing.save_load import load_checkpoint
from llamapipe.training.config import Config

transformers = pytest.importorskip("transformers")

VOCAB = 512
TEXTS = ["def parse_args(argv):\n    return {'x': 1.5}  # Unicode: ü", "hello  world\n\n\ttabs 1234567",
         "caf\u00e9 cafe\u0301 \u00fcber"]
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
HF_CONFIGS = {"llama": lambda: transformers.LlamaConfig(**SHAPE),
              "qwen2": lambda: transformers.Qwen2Config(**SHAPE, rope_theta=1e6),
              "qwen3": lambda: transformers.Qwen3Config(**SHAPE, head_dim=8, rope_theta=1e6)}
HF_MODELS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """A sentencepiece model and a tokenizer.json directory, each of VOCAB ids, trained on the sample corpus."""
    tmp = tmp_path_factory.mktemp("tok")
    assert make_sample_corpus.main(["--out", str(tmp / "corpus"), "--max-mb", "0.2"]) == 0
    common = ["--input", str(tmp / "corpus"), "--vocab-size", str(VOCAB)]
    assert train_tokenizer.main(common + ["--model-prefix", str(tmp / "sp")]) == 0
    assert train_tokenizer.main(common + ["--model-prefix", str(tmp / "bpe"), "--tokenizer-type",
                                          "HuggingFaceTokenizer"]) == 0
    return {"sentencepiece": str(tmp / "sp.model"), "tokenizer.json": str(tmp / "bpe")}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Per family, a random HF model of VOCAB ids imported into a llamapipe checkpoint."""
    out = {}
    for family, make_config in HF_CONFIGS.items():
        tmp = tmp_path_factory.mktemp(family)
        torch.manual_seed(0)
        model = getattr(transformers, HF_MODELS[family])(make_config()).eval()
        with torch.no_grad():   # HF starts norms at one and biases at zero: random ones make a mix-up show
            for name, p in model.named_parameters():
                if "norm" in name or name.endswith("bias"):
                    p.uniform_(0.5, 1.5)
        model.save_pretrained(tmp / "hf", safe_serialization=True)
        convert_hf.import_hf(str(tmp / "hf"), str(tmp / "ckpt"), 1, 1, None)
        out[family] = str(tmp / "ckpt")
    return out


def _ours(ckpt: str) -> torch.nn.Module:
    config = config_from_dict(cio.CheckpointReader(cio.latest_checkpoint(ckpt)[1]).meta["model_config"])
    model = family_of(config).model_class(config).eval()
    load_checkpoint(ckpt, model_chunks=[model], optimizer=None, scheduler=None, parallel_state=None,
                    config=Config(model=config), finetune=True)
    return model


@pytest.mark.parametrize("kind", ["sentencepiece", "tokenizer.json"])
@pytest.mark.parametrize("family", list(HF_CONFIGS))
def test_auto_classes_give_our_ids_and_our_greedy_continuation(tokenizers, checkpoints, tmp_path, family, kind):
    out = str(tmp_path / "hf")
    convert_hf.export_hf(checkpoints[family], out, tokenizers[kind])
    ours_tok = build_tokenizer(tokenizers[kind])
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)          # the export directory alone
    for text in TEXTS:
        assert hf_tok(text, add_special_tokens=False).input_ids == ours_tok.encode(text), (type(hf_tok), text)
        assert hf_tok.decode(ours_tok.encode(text)) == ours_tok.decode(ours_tok.encode(text))
    if kind == "sentencepiece":     # as the data was preprocessed: no bos in front
        assert hf_tok(TEXTS[0]).input_ids == ours_tok.encode(TEXTS[0])
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(model).__name__ == HF_MODELS[family]
    ours = _ours(checkpoints[family])
    prompt = hf_tok("import os\ndef main(", return_tensors="pt").input_ids
    with torch.no_grad():
        generated = model.generate(prompt, max_new_tokens=6, do_sample=False)
        greedy = prompt     # the reference: greedy decoding with our model on the checkpoint
        for _ in range(generated.shape[1] - prompt.shape[1]):
            greedy = torch.cat([greedy, ours(input_ids=greedy)[:, -1:].argmax(-1)], 1)
    assert generated.shape[1] > prompt.shape[1] and torch.equal(generated, greedy), (generated, greedy)
