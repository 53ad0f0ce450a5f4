"""`llamapipe convert-hf`: a tiny random HF LLaMA (GQA, odd vocabulary) imported into tp=2 pp=2 and exported
back gives the identical HF state dict and logits; the checkpoint loads into our model; bad input exits 2."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import transformers
from safetensors.torch import load_file

from llamapipe.model.llama import LlamaConfig
from llamapipe.training.checkpointing import io as cio
from llamapipe.training.checkpointing.save_load import LoadResult, load_checkpoint
from llamapipe.training.config import Config
from tests.harness import ROOT

transformers = pytest.importorskip("transformers")
from llamapipe.tools import convert_hf

SCRIPT = ["-m", "llamapipe", "convert-hf"]


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """A random 4-layer GQA LlamaForCausalLM saved as model.safetensors + config.json."""
    cfg = transformers.LlamaConfig(vocab_size=1001, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   rms_norm_eps=1e-5, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms start at 1.0; make them random so a mix-up would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    hf_dir = tmp_path_factory.mktemp("hf")
    model.save_pretrained(hf_dir, safe_serialization=True)
    return model, str(hf_dir)


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *SCRIPT, *args], capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_import_tp2_pp2_export_roundtrip(hf_model, tmp_path):
    model, hf_dir = hf_model
    proc = run_script("import", "--hf-dir", hf_dir, "--save", str(tmp_path / "ckpt"),
                      "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2")
    assert proc.returncode == 0, proc.stderr
    ckpt = tmp_path / "ckpt" / "iter_0000000"
    meta = json.loads((ckpt / "metadata.json").read_text())
    assert meta["layout"]["tp"] == 2 and meta["layout"]["pp"] == 2
    assert sorted(f for f in meta["files"] if f.startswith("model_")) == sorted([
        cio.shard_name("model", t, p) for p in range(2) for t in range(2)])
    proc = run_script("export", "--load", str(tmp_path / "ckpt"), "--hf-dir", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    original = model.state_dict()
    assert set(exported) == set(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    reloaded = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    ids = torch.randint(0, 1001, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # same weights, same architecture: logits compared bit for bit
        assert torch.equal(reloaded(ids).logits, model(ids).logits)


def test_imported_checkpoint_loads_into_llama_model(hf_model, tmp_path):
    """Our model, loaded from a tp=2 pp=2 vpp=2 import, reproduces HF's logits (fp32, 1e-5)."""
    from llamapipe.model.llama.hf import config_from_hf
    from llamapipe.model.llama import LlamaModel
    model, hf_dir = hf_model
    convert_hf.import_hf(hf_dir, str(tmp_path), 2, 2, 1)
    assert json.loads((tmp_path / "iter_0000000" / "metadata.json").read_text())["layout"]["vpp"] == 2
    convert_hf.import_hf(hf_dir, str(tmp_path / "by_chunks"), 2, 2, None, virtual_stages=2)   # newer Megatron's flag
    assert json.loads((tmp_path / "by_chunks" / "iter_0000000" / "metadata.json").read_text())["layout"]["vpp"] == 2
    with pytest.raises(ValueError, match="--num-virtual-stages-per-pipeline-rank 3"):
        convert_hf.import_hf(hf_dir, str(tmp_path / "bad"), 2, 2, None, virtual_stages=3)
    config = config_from_hf(model.config)
    ours = LlamaModel(config).eval()
    result = load_checkpoint(str(tmp_path), model_chunks=[ours], optimizer=None, scheduler=None,
                             parallel_state=None, config=Config(model=config), finetune=True)
    assert result == LoadResult(0, 0)
    ids = torch.randint(0, 1001, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=ids), model(ids).logits, rtol=1e-5, atol=1e-5)


def test_sharded_pytorch_bin_is_read_weights_only(hf_model, tmp_path):
    """A pytorch_model.bin.index.json over three .bin shards (written here, as older transformers did)."""
    model, hf_dir = hf_model
    original = model.state_dict()
    names = sorted(original)
    weight_map = {}
    for i in range(3):
        fname = f"pytorch_model-{i + 1:05d}-of-00003.bin"
        torch.save({n: original[n].clone() for n in names[i::3]}, tmp_path / fname)
        weight_map.update({n: fname for n in names[i::3]})
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (tmp_path / "config.json").write_text(open(os.path.join(hf_dir, "config.json")).read())
    state_dict, hf_config = convert_hf.read_hf_dir(str(tmp_path))
    assert hf_config["num_key_value_heads"] == 2
    assert set(state_dict) == set(original)
    assert all(torch.equal(state_dict[k], v) for k, v in original.items())


@pytest.mark.parametrize("argv, words", [
    (["export", "--load", "{tmp}/nothing", "--hf-dir", "{tmp}/out"], "holds no complete checkpoint"),
    (["import", "--hf-dir", "{tmp}", "--save", "{tmp}/ckpt"], "has no config.json"),
    (["import", "--hf-dir", "{hf}", "--save", "{tmp}/ckpt", "--tensor-model-parallel-size", "3"],
     "--tensor-model-parallel-size 3"),
    (["import", "--hf-dir", "{hf}", "--save", "{tmp}/ckpt", "--pipeline-model-parallel-size", "3"],
     "--num-layers 4 is not divisible"),
])
def test_bad_input_is_one_line_and_exit_2(hf_model, tmp_path, capsys, argv, words):
    argv = [a.format(tmp=tmp_path, hf=hf_model[1]) for a in argv]
    with pytest.raises(SystemExit) as info:
        convert_hf.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1, err


def _edited(hf_dir, tmp_path, change=None, config_text=None, extra=None) -> str:
    """A copy of `hf_dir` whose config.json is changed (`change(config)`, or replaced by `config_text`) and whose
    weights hold `extra` tensors too."""
    from safetensors.torch import save_file
    out = tmp_path / "edited"
    out.mkdir()
    config = json.loads(open(os.path.join(hf_dir, "config.json")).read())
    if change is not None:
        change(config)
    (out / "config.json").write_text(config_text if config_text is not None else json.dumps(config))
    weights = load_file(os.path.join(hf_dir, "model.safetensors"))
    save_file({**weights, **(extra or {})}, str(out / "model.safetensors"))
    return str(out)


def _old_rope(config: dict, **keys) -> None:
    """`keys` as the RoPE settings of config.json in the form Meta's checkpoints ship (rope_theta and rope_scaling
    at the top, transformers < 5), in place of transformers 5's rope_parameters."""
    config.pop("rope_parameters", None)
    config.update(keys)


@pytest.mark.parametrize("case, edit, says", [
    ("fewer layers", dict(change=lambda c: c.update(num_hidden_layers=2)),
     "{cfg} gives num_hidden_layers 2 but the weights hold layers 0-3"),
    ("more vocabulary", dict(change=lambda c: c.update(vocab_size=2000)),
     "{cfg} does not match the weights: model.embed_tokens.weight is [1001, 32], but vocab_size 2000 makes it "
     "[2000, 32]"),
    ("wider", dict(change=lambda c: c.update(hidden_size=64)),
     "{cfg} does not match the weights: model.embed_tokens.weight is [1001, 32], but hidden_size 64 makes it "
     "[1001, 64]"),
    ("no heads", dict(change=lambda c: c.update(num_attention_heads=0)),
     "{cfg} gives num_attention_heads 0; it must be a positive whole number"),
    ("negative width", dict(change=lambda c: c.update(hidden_size=-128)),
     "{cfg} gives hidden_size -128; it must be a positive whole number"),
    ("layer 99", dict(extra={"model.layers.99.mlp.up_proj.weight": torch.zeros(48, 32)}),
     "{cfg} gives num_hidden_layers 4 but the weights hold layers 0-3 and 99"),
    ("unknown tensor", dict(extra={"model.vision_tower.weight": torch.zeros(2, 2)}),
     "the weights hold model.vision_tower.weight, which {cfg} does not describe"),
    ("cut short", dict(config_text='{"model_type": "llama", "hidden_si'), "{cfg} is not valid JSON (Unterminated string"),
    # issue 51: the key that sizes the tensor is named, not another of the same value (48 is intermediate_size too)
    ("head_dim", dict(change=lambda c: c.update(head_dim=12)),
     "{cfg} does not match the weights: model.layers.0.self_attn.q_proj.weight is [32, 32], but num_attention_heads "
     "4 x head_dim 12 makes it [48, 32]"),
    ("eps a string", dict(change=lambda c: c.update(rms_norm_eps="abc")),
     "{cfg} gives rms_norm_eps 'abc'; it must be a number"),
    ("rope_scaling a string", dict(change=lambda c: c.update(rope_scaling="llama3")),
     "{cfg} gives rope_scaling 'llama3'; it must be an object"),
    ("theta 0", dict(change=lambda c: _old_rope(c, rope_theta=0)),
     "{cfg} gives rope_theta 0.0; it must be a finite positive number, or training refuses the imported checkpoint"),
    ("theta NaN", dict(change=lambda c: _old_rope(c, rope_theta=float("nan"))),
     "{cfg} gives rope_theta nan; it must be"),
    ("original 0", dict(change=lambda c: _old_rope(c, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=0))),
     "{cfg} gives rope_scaling original_max_position_embeddings 0; it must be a finite positive number, or training "
     "refuses the imported checkpoint"),
    ("bands crossed", dict(change=lambda c: _old_rope(c, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=4.0, high_freq_factor=2.0, original_max_position_embeddings=32))),
     "{cfg} gives rope_scaling high_freq_factor 2.0; it must be larger than rope_low_freq_factor (4)"),
])
def test_import_refuses_a_config_that_disagrees_with_the_weights_and_writes_nothing(
        hf_model, tmp_path, capsys, case, edit, says):
    """Issue 40: each of these wrote a checkpoint (layers dropped, rows zero-padded, shapes inconsistent, zero heads,
    a tensor ignored) or ended in a traceback."""
    hf_dir = _edited(hf_model[1], tmp_path, **edit)
    with pytest.raises(SystemExit) as info:
        convert_hf.main(["import", "--hf-dir", hf_dir, "--save", str(tmp_path / "ckpt")])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("convert_hf.py: error: "), err
    assert says.format(cfg=os.path.join(hf_dir, "config.json")) in err, err
    assert not (tmp_path / "ckpt").exists(), "nothing may be written"


@pytest.mark.slow
def test_an_import_with_its_own_rope_scaling_trains_under_use_checkpoint_args(tmp_path):
    """Issue 49: a Llama-3-style model whose RoPE scaling has its own bands and original context (no flag sets
    them) trains with --use-checkpoint-args, which takes them; without it the one line says to give it."""
    cfg = transformers.LlamaConfig(vocab_size=1001, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                   rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 2.0,
                                                 "high_freq_factor": 8.0, "original_max_position_embeddings": 32})
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "hf", safe_serialization=True)
    convert_hf.import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"), 1, 1, None)
    run = ["pretrain_llama.py", "--load", str(tmp_path / "ckpt"), "--no-load-optim", "--mock-data", "--seq-length",
           "64", "--train-iters", "2", "--micro-batch-size", "1", "--global-batch-size", "2", "--lr", "1e-4",
           "--eval-iters", "0", "--num-workers", "0"]
    shape = ["--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size", "48", "--num-attention-heads", "4",
             "--group-query-attention", "--num-query-groups", "2", "--max-position-embeddings", "128",
             "--vocab-size", "1001", "--rotary-base", "500000", "--use-rope-scaling", "--rope-scaling-factor", "4"]
    refused = subprocess.run([sys.executable, *run, *shape], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-2000:]
    assert ("rope_original_max_position_embeddings 32 but this run has 1.0, 4.0, 8192; give --use-checkpoint-args, "
            "which takes rope_low_freq_factor, rope_high_freq_factor, rope_original_max_position_embeddings") \
        in refused.stderr
    proc = subprocess.run([sys.executable, *run, "--use-checkpoint-args", "--save", str(tmp_path / "out"),
                           "--save-interval", "2"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("RoPE scaling's low_freq_factor 2, high_freq_factor 8, original_max_position_embeddings 32"
            in proc.stdout + proc.stderr)
    saved = json.loads((tmp_path / "out" / "iter_0000002" / "metadata.json").read_text())["model_config"]
    assert (saved["rope_low_freq_factor"], saved["rope_high_freq_factor"], saved["rope_scaling_factor"],
            saved["rope_original_max_position_embeddings"]) == (2.0, 8.0, 4.0, 32)


def test_export_refuses_a_link_in_the_output_directory_and_leaves_its_target(hf_model, tmp_path, capsys):
    convert_hf.import_hf(hf_model[1], str(tmp_path / "ckpt"), 1, 1, None)
    capsys.readouterr()     # the import's progress bar
    out, victim = tmp_path / "out", tmp_path / "victim.txt"
    out.mkdir()
    victim.write_text("precious")
    (out / "config.json").symlink_to(victim)
    with pytest.raises(SystemExit) as info:
        convert_hf.main(["export", "--load", str(tmp_path / "ckpt"), "--hf-dir", str(out)])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == f"convert_hf.py: error: {out / 'config.json'} is a symbolic link; llamapipe writes only regular " \
                  "files, never through a link (remove it or choose another path)"
    assert victim.read_text() == "precious" and sorted(os.listdir(out)) == ["config.json"]


def test_export_gives_every_file_the_same_mode(hf_model, tmp_path):
    """Issue 51: model.safetensors was 0600 (safetensors' own writer) while config.json was 0666 less the umask."""
    convert_hf.import_hf(hf_model[1], str(tmp_path / "ckpt"), 1, 1, None)
    convert_hf.export_hf(str(tmp_path / "ckpt"), str(tmp_path / "out"))
    modes = {name: os.stat(tmp_path / "out" / name).st_mode & 0o777 for name in ("model.safetensors", "config.json")}
    assert modes["model.safetensors"] == modes["config.json"], modes
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out")
    torch.testing.assert_close(reloaded.lm_head.weight, hf_model[0].lm_head.weight, rtol=0, atol=0)


# --- a trained run exported whole: every vocabulary row, the tokenizer, generation (issue 33) -----------------

RUN_SHAPE = ["--model", "tiny", "--num-layers", "2", "--seq-length", "64", "--micro-batch-size", "2",
             "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-3", "--log-interval", "1",
             "--split", "98,2,0", "--eval-iters", "0", "--num-workers", "0", "--seed", "1234"]


@pytest.fixture(scope="module")
def trained_tp2(tmp_path_factory):
    """The tiny preset (vocabulary 1024) trained 2 iterations at tp 2 with a 2048-piece sentencepiece
    tokenizer, as the quickstart does, and saved."""
    from llamapipe.tools import make_sample_corpus, preprocess_data, train_tokenizer
    from tests.cli import torchrun
    tmp = tmp_path_factory.mktemp("run")
    corpus, prefix, save = str(tmp / "corpus"), str(tmp / "data" / "c"), str(tmp / "ckpt")
    assert make_sample_corpus.main(["--out", corpus, "--max-mb", "0.5"]) == 0
    assert train_tokenizer.main(["--input", corpus, "--vocab-size", "2048", "--model-prefix", str(tmp / "tok")]) == 0
    tok = str(tmp / "tok.model")
    assert preprocess_data.main(["--input", corpus, "--output-prefix", prefix, "--tokenizer-model", tok,
                                 "--workers", "1", "--append-eod", "--no-progress"]) == 0
    proc = torchrun(2, RUN_SHAPE + ["--tensor-model-parallel-size", "2", "--data-path", prefix + "_text_document",
                                    "--tokenizer-model", tok, "--save", save, "--save-interval", "2"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tok, save


def test_trained_tp2_run_exports_every_vocabulary_row_and_its_tokenizer(trained_tp2, tmp_path):
    from llamapipe.data.tokenizer import build_tokenizer
    from llamapipe.model.llama import LlamaModel
    tok, save = trained_tp2
    with open(os.path.join(save, "iter_0000002", "metadata.json")) as fh:
        meta = json.load(fh)
    assert meta["model_config"]["vocab_size"] == 2048 and meta["tensors"]["model:embedding.weight"]["shape"][0] == 2048
    out = str(tmp_path / "hf")
    proc = run_script("export", "--load", save, "--hf-dir", out)
    assert proc.returncode == 0, proc.stderr
    exported = load_file(os.path.join(out, "model.safetensors"))
    assert exported["model.embed_tokens.weight"].shape[0] == exported["lm_head.weight"].shape[0] == 2048
    # the rows of tp rank 1 (ids 1024..2047) are the trained ones, not padding
    assert exported["lm_head.weight"][1024:].abs().sum() > 0

    ours_tok = build_tokenizer(tok)
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)      # from the export directory alone
    text = "def parse_args(argv):\n    return {'x': 1.5}  # Unicode: ü"
    assert hf_tok(text).input_ids == ours_tok.encode(text)
    model = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    config = LlamaConfig(**meta["model_config"])
    ours = LlamaModel(config).eval()
    load_checkpoint(save, model_chunks=[ours], optimizer=None, scheduler=None, parallel_state=None,
                    config=Config(model=config), finetune=True)
    tokens = torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():   # the same weights in both: fp32 logits over all 2048 ids agree
        torch.testing.assert_close(model(tokens).logits, ours(input_ids=tokens), rtol=1e-5, atol=1e-5)
        prompt = hf_tok("import os\ndef main(", return_tensors="pt").input_ids
        generated = model.generate(prompt, max_new_tokens=6, do_sample=False)
        greedy = prompt       # the reference: greedy decoding with our model
        for _ in range(generated.shape[1] - prompt.shape[1]):
            greedy = torch.cat([greedy, ours(input_ids=greedy)[:, -1:].argmax(-1)], 1)
    assert generated.shape[1] > prompt.shape[1] and torch.equal(generated, greedy)


def test_import_into_a_used_or_locked_save_directory_is_refused(hf_model, tmp_path, capsys):
    """Issue 51: an import into a directory holding training checkpoints exited 0 and moved the tracker to 0,
    and a later --load resumed the old iteration 4 anyway (the import silently lost); an import ignored the lock
    of a training run writing the same directory. Now both are refused in one line; --overwrite-save deletes the
    earlier checkpoints first."""
    from llamapipe.training.checkpointing import catalog
    from tests.unit.test_checkpoint_integrity import save
    from tests.unit.test_save_lock import _holder
    ckpt = tmp_path / "ckpt"
    save(ckpt, 4)
    capsys.readouterr()
    argv = ["import", "--hf-dir", hf_model[1], "--save", str(ckpt)]
    with pytest.raises(SystemExit) as info:
        convert_hf.main(argv)
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and err == (
        f"convert_hf.py: error: --save {ckpt} already holds 1 checkpoint(s) of an earlier run, the newest iteration "
        "4; give another --save, or --overwrite-save to delete them first (mixing two runs' checkpoints would make "
        "a later --load resume the wrong one)"), err
    assert catalog.list_iterations(str(ckpt)) == [4] and catalog.read_tracker(str(ckpt)) == 4
    holder = _holder(ckpt)
    try:
        with pytest.raises(SystemExit):
            convert_hf.main(argv + ["--overwrite-save"])
        assert f"--save {ckpt} is in use by another run (host" in capsys.readouterr().err
        assert catalog.list_iterations(str(ckpt)) == [4]
    finally:
        holder.kill()
        holder.wait()
    convert_hf.main(argv + ["--overwrite-save"])
    assert catalog.list_iterations(str(ckpt)) == [0] and catalog.read_tracker(str(ckpt)) == 0
