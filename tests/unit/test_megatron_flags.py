"""Megatron-LM's flags: defaults pinned against Megatron's own parser, its rules for the model shape, training
length, data split and evaluation, the tables of flags with no effect or refused, --use-checkpoint-args, and
--kv-channels / --rotary-percent checked numerically against HF transformers' Phi3 (LLaMA with fused
projections, a free head_dim and partial_rotary_factor)."""
import dataclasses
import signal

import numpy as np
import pytest
import torch

from llamapipe.core.config import TrainingConfig
from llamapipe.training.arguments.megatron_compat import NOTICES, REFUSED
from llamapipe.training.arguments.parser import ArgumentError, build_parser, config_from_args
from llamapipe.training.arguments.zb_fork_flags import FLAGS as FORK_FLAGS
from llamapipe.training.config import Config

# What Megatron itself requires (arguments.py, validate_args), small.
SHAPE = {"--num-layers": "2", "--hidden-size": "64", "--num-attention-heads": "4", "--max-position-embeddings": "64",
         "--seq-length": "32", "--vocab-size": "128"}


def base(**changes) -> list[str]:
    """--mock-data and the required shape flags, e.g. base(hidden_size=66)."""
    values = dict(SHAPE, **{"--" + k.replace("_", "-"): str(v) for k, v in changes.items()})
    return ["--mock-data"] + [item for flag, value in values.items() for item in (flag, value)]


BASE = base()

# Defaults of NVIDIA/Megatron-LM at tag core_v0.19.0 (its megatron/core/package_info.py reads 0.19.1), read
# from the parser that megatron/training/arguments.py add_megatron_arguments() builds (many groups come from
# the dataclasses in megatron/training/config/*.py and megatron/core/transformer/transformer_config.py).
MEGATRON_DEFAULTS = {
    "--tensor-model-parallel-size": 1, "--pipeline-model-parallel-size": 1,
    "--context-parallel-size": 1, "--cp-comm-type": ["p2p"], "--hierarchical-context-parallel-sizes": None,
    "--num-layers-per-virtual-pipeline-stage": None, "--num-virtual-stages-per-pipeline-rank": None,
    "--decoder-first-pipeline-num-layers": None, "--decoder-last-pipeline-num-layers": None,
    "--account-for-embedding-in-pipeline-split": False, "--account-for-loss-in-pipeline-split": False,
    "--pipeline-model-parallel-layout": None, "--microbatch-group-size-per-virtual-pipeline-stage": None,
    "--sequence-parallel": False, "--distributed-timeout-minutes": 10, "--use-distributed-optimizer": False,
    "--overlap-grad-reduce": False, "--ddp-bucket-size": None, "--data-parallel-sharding-strategy": "no_shard",
    "--use-torch-fsdp2": False, "--optimizer-cpu-offload": False,
    "--num-layers": None, "--hidden-size": None, "--ffn-hidden-size": None, "--num-attention-heads": None,
    "--kv-channels": None, "--group-query-attention": False, "--max-position-embeddings": None,
    "--rotary-percent": 1.0, "--use-rope-scaling": False, "--vocab-size": None, "--untie-embeddings-and-output-weights": False,
    "--swiglu": False, "--use-rotary-position-embeddings": False, "--recompute-granularity": None,
    "--recompute-method": None, "--recompute-num-layers": None, "--recompute-activations": False,
    "--use-flash-attn": False, "--add-qkv-bias": False,
    "--global-batch-size": None, "--rampup-batch-size": None, "--train-iters": None, "--train-samples": None,
    "--seq-length": None, "--seed": 1234, "--eval-iters": 100,
    "--eval-interval": None,     # None since core_v0.17 (ValidationConfig); 1000 up to core_v0.16
    "--calculate-per-token-loss": False, "--exit-interval": None, "--exit-duration-in-mins": None,
    "--exit-signal-handler": False, "--exit-signal": signal.SIGTERM, "--manual-gc": False, "--manual-gc-interval": 0, "--no-manual-gc-eval": True,
    "--optimizer": "adam", "--min-lr": 0.0, "--decoupled-lr": None, "--decoupled-min-lr": None,
    "--lr-decay-style": "linear", "--lr-warmup-iters": 0,
    "--lr-warmup-samples": 0, "--lr-warmup-fraction": None, "--lr-decay-iters": None, "--lr-decay-samples": None,
    "--weight-decay": 0.01, "--adam-beta1": 0.9, "--adam-beta2": 0.999, "--adam-eps": 1e-8, "--clip-grad": 1.0,
    "--bf16": False, "--fp16": False, "--loss-scale": None, "--initial-loss-scale": 2.0 ** 32,
    "--min-loss-scale": 1.0, "--loss-scale-window": 1000, "--hysteresis": 2,
    "--data-path": None, "--train-data-path": None, "--valid-data-path": None, "--test-data-path": None,
    "--tokenizer-model": None, "--tokenizer-type": None, "--mock-data": False, "--data-cache-path": None,
    "--reset-position-ids": False, "--reset-attention-mask": False, "--eod-mask-loss": False,
    "--num-workers": 2, "--save": None, "--save-interval": None, "--load": None, "--use-checkpoint-args": False,
    "--finetune": False, "--override-opt_param-scheduler": False, "--use-checkpoint-opt_param-scheduler": False,
    "--async-save": False, "--log-interval": 100, "--profile-step-start": 10, "--profile-step-end": 12, "--timing-log-level": 0, "--timing-log-option": "minmax", "--log-straggler": False, "--straggler-minmax-count": 1, "--log-throughput": False, "--log-params-norm": False,
    "--log-num-zeros-in-grad": False, "--tensorboard-dir": None, "--wandb-project": None,
    "--wandb-exp-name": None, "--wandb-save-dir": None,
    "--fine-grained-activation-offloading": False, "--offload-modules": None, "--activation-offload-fraction": 1.0,
    "--min-offloaded-tensor-size": 1024 * 1024, "--delta-offload-bytes-across-pp-ranks": 0,
    "--use-tp-pp-dp-mapping": None,      # store_const into --parallel-order's destination: unset unless given
    "--recompute-modules": None,         # None: ["core_attn"] under selective recompute
}
# Megatron's parser default is None (not given) here; the value it then uses, and where ours ends up
# (read from the config of BASE plus a flag where the value matters only with it).
MEGATRON_EFFECTIVE = {
    "--num-query-groups": (1, lambda c: cfg(BASE + ["--group-query-attention"]).model.num_query_groups),
    "--rotary-base": (10000, lambda c: c.model.rope_theta),
    "--rope-scaling-factor": (8.0, lambda c: cfg(BASE + ["--use-rope-scaling"]).model.rope_scaling_factor),
    "--norm-epsilon": (1e-5, lambda c: c.model.norm_epsilon),
    "--make-vocab-size-divisible-by": (128, lambda c: c.model.make_vocab_size_divisible_by),
    "--init-method-std": (0.02, lambda c: c.model.init_method_std),
    "--split": ("969,30,1", lambda c: c.data.split),                    # '969, 30, 1' with --data-path
    "--no-load-optim": (False, lambda c: c.checkpoint.no_load_optim),    # Megatron's None is falsy
    "--no-load-rng": (False, lambda c: c.checkpoint.no_load_rng),
}
# Deliberate differences: (Megatron's default, ours, why).
DIVERGENCES = {
    "--ckpt-format": ("torch_dist", "torch", "llamapipe's own checkpoints by default; torch_dist writes Megatron's "
                      "copy beside them (docs/megatron_checkpoints.md)"),
    "--micro-batch-size": (None, 1, "Megatron asserts it is given; 1 keeps short commands working"),
    "--lr": (None, 3e-4, "Megatron has no usable default (its scheduler fails on None)"),
    "--distributed-backend": ("nccl", None, "None picks nccl on CUDA and gloo on CPU"),
    "--attention-dropout": (0.1, 0.0, "LLaMA pretraining uses no dropout; only 0 is accepted"),
    "--hidden-dropout": (0.1, 0.0, "LLaMA pretraining uses no dropout; only 0 is accepted"),
    "--normalization": ("LayerNorm", "RMSNorm", "the model is LLaMA"),
    "--position-embedding-type": ("learned_absolute", "rope", "the model is LLaMA"),
    "--profile-ranks": ([0], None, "with --pipeline-trace every rank records by default: the trace is of all ranks"),
}
# Megatron adds biases unless --disable-bias-linear is given; the model here has none but --add-qkv-bias's.
ALWAYS_ON = ("--disable-bias-linear",)
# The zero-bubble fork's activation offload flags, implemented with the fork's defaults (offload_args.py) except
# --offload-chunk-num (None: 1 under --cpu-offload; the fork's 0 is an assertion) and --offload-time (None: 0).
FORK_OFFLOAD = ("--cpu-offload", "--offload-chunk-num", "--offload-time", "--auto-offload-time", "--offload-overlap-sr",
                "--recompute-lgd")
LLAMAPIPE_ONLY = ("--model", "--offload-weight-grad-inputs", "--parallel-order", "--pipeline-trace", "--pipeline-schedule", "--pipeline-memory-limit",
                  "--pipeline-profile-iters", "--release-host-memory", "--skip-nonfinite-steps", "--keep-last-n",
                  "--metrics-jsonl", "--tie-embeddings-and-output-weights", "--compile",
                  "--enable-optimizer-post-validation", "--enable-vocab-parallel",
                  "--pipeline-schedule-file", "--pipeline-profile", "--allow-tokenizer-change", "--dry-run",
                  "--overwrite-save", "--straggler-threshold", "--hang-report-seconds",
                  "--hang-report-keep-waiting", "--seq1f1b-balance-method", "--num-seq-splits")   # the last: the zb fork's


def cfg(argv, world=1) -> Config:
    return config_from_args(build_parser().parse_args(argv), world)


def rejects(argv, *fragments, world=1) -> str:
    with pytest.raises(ArgumentError) as info:
        cfg(argv, world)
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message
    return message


def _action(parser, flag):
    (action,) = [a for a in parser._actions if flag in a.option_strings]
    return action


def test_defaults_match_megatron():
    parser = build_parser()
    wrong = {flag: (_action(parser, flag).default, want) for flag, want in MEGATRON_DEFAULTS.items()
             if _action(parser, flag).default != want}
    assert not wrong, f"(ours, Megatron's): {wrong}"
    config = cfg(BASE)
    assert {flag: read(config) for flag, (_, read) in MEGATRON_EFFECTIVE.items()} == \
        {flag: want for flag, (want, _) in MEGATRON_EFFECTIVE.items()}
    for flag, (megatron, ours, _) in DIVERGENCES.items():
        assert _action(parser, flag).default == ours != megatron, flag


def test_every_flag_is_pinned_classified_or_in_a_compatibility_table():
    classified = (set(MEGATRON_DEFAULTS) | set(MEGATRON_EFFECTIVE) | set(DIVERGENCES) | set(ALWAYS_ON)
                  | set(LLAMAPIPE_ONLY) | {e.flag for e in NOTICES + REFUSED} | set(FORK_FLAGS) | set(FORK_OFFLOAD))
    flags = {a.option_strings[0] for a in build_parser()._actions if a.option_strings[0] != "-h"}
    assert flags == classified


def test_effective_training_defaults_follow_megatron():
    config = cfg(BASE)
    opt, training = config.optimizer, config.training
    assert (opt.weight_decay, opt.adam_beta2, opt.lr_decay_style) == (0.01, 0.999, "linear")
    assert (training.eval_iters, config.logging.log_interval, config.data.num_workers) == (100, 100, 2)
    assert config.model.num_query_groups == 4          # MHA without --group-query-attention


# --- the model shape -------------------------------------------------------------------------------------

@pytest.mark.parametrize("hidden,swiglu,want", [(4096, True, 10880), (4096, False, 16384), (64, True, 128),
                                                (2048, True, 5440)])
def test_missing_ffn_hidden_size_is_megatrons_rule(hidden, swiglu, want):
    """By hand: int(4 * 4096 * 2 / 3 / 64) * 64 = int(170.67) * 64 = 10880; 4 * 64 * 2 / 3 / 64 = 2.67 -> 128."""
    config = cfg(base(hidden_size=hidden) + (["--swiglu"] if swiglu else []))
    assert config.model.hidden_size == hidden and config.model.ffn_hidden_size == want


def test_a_preset_supplies_its_own_ffn_size_and_seq_length():
    config = cfg(["--mock-data", "--model", "llama2-7b", "--hidden-size", "2048", "--num-attention-heads", "16"])
    assert (config.model.ffn_hidden_size, config.model.hidden_size, config.training.seq_length) == (11008, 2048, 128)
    assert config.model.num_query_groups == 16     # an MHA preset stays MHA when the heads change


@pytest.mark.parametrize("argv,groups", [
    (["--num-query-groups", "2"], 4),                            # ignored without --group-query-attention
    (["--group-query-attention", "--num-query-groups", "2"], 2),
    (["--group-query-attention"], 1),                            # Megatron's --num-query-groups default
])
def test_num_query_groups_only_with_group_query_attention(argv, groups):
    assert cfg(BASE + argv).model.num_query_groups == groups


def test_a_gqa_preset_keeps_its_query_groups_and_an_ignored_flag_gets_a_notice(llamapipe_log):
    assert cfg(["--mock-data", "--model", "llama3-8b", "--num-attention-heads", "16"]).model.num_query_groups == 8
    assert _notices(BASE + ["--num-query-groups", "2"], llamapipe_log) == [
        "notice: --num-query-groups 2 is ignored without --group-query-attention (as in Megatron-LM): every head "
        "has its own keys and values"]


def test_required_shape_flags_unless_a_preset_or_none_at_all():
    rejects(["--mock-data", "--num-layers", "2", "--hidden-size", "64"],
            "--num-attention-heads, --max-position-embeddings, --seq-length are required", "or a --model preset")
    rejects(BASE[:-2], "--vocab-size is required without --tokenizer-model")
    newcomer = cfg(["--mock-data"])       # no model flags at all: the tiny preset, with a notice
    assert (newcomer.model.num_layers, newcomer.model.hidden_size, newcomer.training.seq_length) == (8, 128, 128)


def test_kv_channels_and_rotary_percent_reach_the_model():
    model = cfg(BASE + ["--kv-channels", "24", "--rotary-percent", "0.5"]).model
    assert (model.head_dim, model.rotary_dim, model.kv_channels) == (24, 12, 24)
    assert cfg(BASE + ["--kv-channels", "16"]).model.kv_channels is None    # the default head dim, one spelling
    assert cfg(base(hidden_size=66) + ["--kv-channels", "16"]).model.head_dim == 16   # 66 / 4 heads is no int
    rejects(base(hidden_size=66), "--hidden-size 66 is not divisible by --num-attention-heads (4)", "--kv-channels")
    assert cfg(BASE + ["--rotary-percent", "0.3"]).model.rotary_dim == 4            # int(16 * 0.3), as Megatron
    rejects(BASE + ["--rotary-percent", "0.1"], "--rotary-percent 0.1 must be in (0, 1]", "head dim 16 it rotates 1")
    rejects(BASE + ["--rotary-percent", "1.5"], "--rotary-percent 1.5 must be in (0, 1]")


def test_recompute_activations_is_selective_recompute():
    assert cfg(BASE + ["--recompute-activations"]).model.recompute_granularity == "selective"
    rejects(BASE + ["--recompute-activations", "--recompute-granularity", "full"], "--recompute-activations")
    rejects(BASE + ["--recompute-activations", "--recompute-method", "block"], "--recompute-method block")


def test_use_flash_attn_is_a_notice_on_cpu_and_needs_half_precision_on_cuda(monkeypatch, llamapipe_log):
    lines = _notices(BASE + ["--use-flash-attn"], llamapipe_log)
    assert lines == ["notice: --use-flash-attn has no effect on CPU: SDPA's FlashAttention kernel is CUDA-only"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    rejects(BASE + ["--use-flash-attn", "--distributed-backend", "nccl"], "--use-flash-attn needs --bf16 or --fp16")
    assert cfg(BASE + ["--use-flash-attn", "--bf16", "--distributed-backend", "nccl"]).model.use_flash_attn


# --- training length, schedule, evaluation ---------------------------------------------------------------

def test_train_samples_sets_iterations_and_excludes_iteration_flags():
    config = cfg(BASE + ["--train-samples", "100", "--global-batch-size", "8", "--lr-warmup-samples", "16",
                         "--lr-decay-samples", "80"])
    assert (config.training.train_iters, config.training.train_samples) == (12, 100)     # 100 // 8
    assert (config.optimizer.lr_warmup_samples, config.optimizer.lr_decay_samples) == (16, 80)
    rejects(BASE + ["--train-iters", "5", "--train-samples", "100"], "--train-iters 5 and --train-samples 100")
    rejects(BASE + ["--train-iters", "5", "--lr-warmup-samples", "4"], "--lr-warmup-samples 4 needs sample-based",
            "--lr-warmup-iters")
    rejects(BASE + ["--train-iters", "5", "--lr-decay-samples", "4"], "--lr-decay-samples 4 needs sample-based")
    rejects(BASE + ["--train-samples", "100", "--lr-warmup-iters", "2"], "--lr-warmup-iters 2 is iteration-based",
            "use --lr-warmup-samples")
    rejects(BASE + ["--train-samples", "100", "--lr-decay-iters", "9"], "--lr-decay-iters 9 is iteration-based")
    rejects(BASE + ["--train-samples", "4", "--global-batch-size", "8"], "less than one global batch (8)")


def test_lr_warmup_fraction_is_exclusive_with_warmup_lengths():
    assert cfg(BASE + ["--train-iters", "10", "--lr-warmup-fraction", "0.1"]).optimizer.lr_warmup_fraction == 0.1
    rejects(BASE + ["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "2"], "give one")
    rejects(BASE + ["--train-samples", "64", "--lr-warmup-fraction", "0.1", "--lr-warmup-samples", "8"], "give one")
    rejects(BASE + ["--lr-warmup-fraction", "1.5"], "between 0 and 1")


def test_rampup_batch_size_only_with_train_samples():
    config = cfg(BASE + ["--train-samples", "40", "--global-batch-size", "12", "--rampup-batch-size", "2", "2", "20"],
                 world=2)
    # ramp 2 2 4 6 8 (22 samples, Megatron's update_train_iters), then (40 - 22) // 12 = 1 full batch
    assert (config.training.train_iters, config.training.rampup_batch_size) == (6, (2, 2, 20))
    rejects(BASE + ["--train-iters", "10", "--global-batch-size", "12", "--rampup-batch-size", "2", "2", "20"],
            "--rampup-batch-size 2 2 20 needs sample-based training")
    rejects(BASE + ["--train-samples", "40", "--global-batch-size", "12", "--rampup-batch-size", "3", "3", "20"],
            "--rampup-batch-size 3 3 20", world=2)


def test_eval_iters_minus_one_and_missing_validation_data(llamapipe_log):
    assert cfg(BASE + ["--eval-iters", "-1"]).training.eval_iters == 0
    rejects(BASE + ["--eval-iters", "-2"], "--eval-iters -2")
    rejects(BASE + ["--eval-iters", "0", "--eval-interval", "5"], "--eval-interval 5 needs --eval-iters > 0")
    lines = _notices(BASE + ["--split", "100"], llamapipe_log)
    assert lines == ["notice: no evaluation: --split 100,0,0 gives the validation set weight 0"]
    assert cfg(BASE + ["--split", "100"]).training.eval_iters == 0
    rejects(BASE + ["--split", "100", "--eval-interval", "5"], "--eval-interval 5 needs validation data")


def test_manual_gc_and_logging_flags_reach_the_configs():
    config = cfg(BASE + ["--manual-gc", "--manual-gc-interval", "5", "--no-manual-gc-eval", "--calculate-per-token-loss",
                         "--log-throughput", "--log-params-norm", "--log-num-zeros-in-grad", "--wandb-project", "p",
                         "--wandb-exp-name", "e", "--wandb-save-dir", "d"])
    t, log = config.training, config.logging
    assert (t.manual_gc, t.manual_gc_interval, t.manual_gc_eval, t.calculate_per_token_loss) == (True, 5, False, True)
    assert (log.log_throughput, log.log_params_norm, log.log_num_zeros_in_grad) == (True, True, True)
    assert (log.wandb_project, log.wandb_exp_name, log.wandb_save_dir) == ("p", "e", "d")
    assert cfg(BASE + ["--disable-manual-gc-eval"]).training.manual_gc_eval is False


# --- data ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("split,want", [("99,1", "99,1,0"), ("100", "100,0,0"), ("'99,1,0'", "99,1,0"),
                                        ("969, 30, 1", "969,30,1"), ("0.7,0.2,0.1", "0.7,0.2,0.1")])
def test_split_is_read_as_megatron_reads_it(split, want):
    assert cfg(BASE + ["--split", split]).data.split == want


def _dataset(tmp_path, name):
    for ext in (".bin", ".idx"):
        (tmp_path / (name + ext)).write_bytes(b"")
    (tmp_path / "tok.model").write_bytes(b"")
    return str(tmp_path / name)


def test_data_sources_per_split_paths_and_suffix_hint(tmp_path):
    shape = [a for a in BASE if a != "--mock-data"]
    tok = ["--tokenizer-type", "NullTokenizer"]     # a --tokenizer-model is read when the flags are parsed
    train, valid = _dataset(tmp_path, "a"), _dataset(tmp_path, "b")
    data = cfg(shape + tok + ["--train-data-path", train, "--valid-data-path", "2", valid]).data
    assert (data.train_data_path, data.valid_data_path, data.test_data_path) == ((train,), ("2", valid), ())
    assert (data.has_split(0), data.has_split(1), data.has_split(2)) == (True, True, False)
    rejects(shape + tok + ["--data-path", train + ".bin"], f"--data-path {train}.bin: give the prefix without "
            f".bin/.idx, e.g. --data-path {train}")
    rejects(shape + tok + ["--data-path", train, "--train-data-path", train], "--data-path and --train-data-path",
            "give one")
    rejects(BASE + ["--data-path", train] + tok, "--mock-data and --data-path")
    rejects(shape + tok + ["--train-data-path", train, "--split", "9,1"], "--split 9,1", "used whole")
    rejects(shape + ["--data-path", train], "needs --tokenizer-model")
    assert cfg(shape + ["--data-path", train, "--tokenizer-type", "NullTokenizer"]).data.vocab_size == 128


# --- the compatibility tables ----------------------------------------------------------------------------

def _notices(argv, log) -> list[str]:
    log.clear()
    cfg(argv)
    return [line for line in log if line.startswith("notice:")]


def _given(entry) -> list[str]:
    if entry.type is None:
        return [entry.flag]
    return [entry.flag, {int: "2", float: "0.5", str: "x"}[entry.type]]


@pytest.mark.parametrize("entry", NOTICES, ids=[e.flag for e in NOTICES])
def test_a_flag_with_no_effect_gets_one_notice_line(entry, llamapipe_log):
    assert _notices(BASE + _given(entry), llamapipe_log) == [f"notice: {' '.join(_given(entry))} has no effect here: "
                                                      f"{entry.why}"]


@pytest.mark.parametrize("entry", REFUSED, ids=[e.flag for e in REFUSED])
def test_a_refused_flag_stops_with_its_reason(entry):
    rejects(BASE + _given(entry), f"{' '.join(_given(entry))} is not supported: {entry.why}")


def test_refused_flags_pass_at_the_value_that_means_off(llamapipe_log):
    assert _notices(BASE + ["--context-parallel-size", "1", "--expert-model-parallel-size", "1",
                            "--num-experts", "0"], llamapipe_log) == []


# --- --use-checkpoint-args -------------------------------------------------------------------------------

def test_use_checkpoint_args_fills_the_shape_and_forces_the_architecture(tmp_path):
    from llamapipe.model.llama import LlamaConfig, LlamaModel
    from llamapipe.training.checkpointing.resharding import model_specs
    from llamapipe.training.checkpointing.io import write_layout
    saved = LlamaConfig(num_layers=3, hidden_size=48, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
                        vocab_size=100, max_position_embeddings=80, rope_theta=5e5, kv_channels=16,
                        rotary_percent=0.5)
    state = {name: p.detach() for name, p in LlamaModel(saved).named_parameters()}
    write_layout(str(tmp_path), 7, state, model_specs(saved, 1), dataclasses.asdict(saved), tp=1, pp=1,
                 config=dataclasses.asdict(Config(model=saved, training=TrainingConfig(seq_length=40))))
    taken = cfg(["--mock-data", "--use-checkpoint-args", "--load", str(tmp_path)])
    assert taken.model == saved and taken.training.seq_length == 40
    given = cfg(["--mock-data", "--use-checkpoint-args", "--load", str(tmp_path), "--seq-length", "20",
                 "--rotary-base", "10000"])
    assert given.training.seq_length == 20 and given.model.rope_theta == 5e5    # filled only if not given; forced
    rejects(["--mock-data", "--use-checkpoint-args"], "--use-checkpoint-args needs --load")


# --- numerics: kv-channels and rotary-percent against HF transformers --------------------------------------

def _phi3_from_ours(model, config):
    """HF Phi3ForCausalLM holding our weights: q|k|v and gate|up concatenated, as Phi3 stores them."""
    transformers = pytest.importorskip("transformers")
    hf_config = transformers.Phi3Config(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.ffn_hidden_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_query_groups, head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.norm_epsilon,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta,
                         "partial_rotary_factor": config.rotary_percent},
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    hf = transformers.Phi3ForCausalLM(hf_config).eval()
    ours = dict(model.named_parameters())
    weights = {"model.embed_tokens.weight": ours["embedding.weight"][:config.vocab_size],
               "model.norm.weight": ours["final_norm.weight"],
               "lm_head.weight": ours["output.weight"][:config.vocab_size]}
    for i in range(config.num_layers):
        p, h = f"layers.{i}.", f"model.layers.{i}."
        weights[h + "self_attn.qkv_proj.weight"] = torch.cat([ours[p + f"attention.{n}_proj.weight"] for n in "qkv"])
        weights[h + "self_attn.o_proj.weight"] = ours[p + "attention.o_proj.weight"]
        weights[h + "mlp.gate_up_proj.weight"] = torch.cat([ours[p + "mlp.gate_proj.weight"],
                                                            ours[p + "mlp.up_proj.weight"]])
        weights[h + "mlp.down_proj.weight"] = ours[p + "mlp.down_proj.weight"]
        weights[h + "input_layernorm.weight"] = ours[p + "input_norm.weight"]
        weights[h + "post_attention_layernorm.weight"] = ours[p + "post_attention_norm.weight"]
    missing, unexpected = hf.load_state_dict({k: v.detach().clone() for k, v in weights.items()}, strict=True)
    assert not missing and not unexpected
    return hf


@pytest.mark.parametrize("kv_channels,rotary_percent", [(24, 1.0), (24, 0.5), (None, 0.25), (8, 0.75)])
def test_kv_channels_and_rotary_percent_logits_match_hf_phi3(kv_channels, rotary_percent):
    """fp32 logits of our model vs transformers' Phi3ForCausalLM (head_dim, partial_rotary_factor): the same
    function, so they agree to float rounding (atol 1e-5, rtol 1e-4 on logits of size ~1)."""
    from llamapipe.model.llama import LlamaConfig, LlamaModel
    config = LlamaConfig(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
                         vocab_size=200, max_position_embeddings=64, rope_theta=500000.0, kv_channels=kv_channels,
                         rotary_percent=rotary_percent, init_method_std=0.1)
    model = LlamaModel(config, seed=3).eval()
    assert model.layers["0"].attention.q_proj.weight.shape == (4 * config.head_dim, 64)
    hf = _phi3_from_ours(model, config)
    tokens = torch.randint(0, 200, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)


def test_partial_rotary_backward_matches_autograd_of_hf_rope():
    """Our RoPE's hand-written backward on a partial rotation vs autograd through HF Phi3's apply_rotary_pos_emb."""
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb
    from llamapipe.model.rotary import RotaryEmbedding, apply_rotary
    rope = RotaryEmbedding(rotary_dim=6, max_positions=16, theta=10000.0)
    cos, sin = rope(16, None, torch.float32)                        # (s, 1, 1, 6)
    x = torch.randn(16, 2, 3, 10, dtype=torch.float64, requires_grad=True)    # (s, b, heads, d): 4 dims pass
    grad = torch.randn(16, 2, 3, 10, dtype=torch.float64)
    ours = apply_rotary(x, (cos.double(), sin.double()))
    (ours_grad,) = torch.autograd.grad(ours, x, grad)
    xt = x.permute(1, 2, 0, 3)                                        # HF layout (b, heads, s, d)
    hf_cos, hf_sin = cos[:, 0, 0].double()[None], sin[:, 0, 0].double()[None]   # (1, s, 6)
    theirs, _ = apply_rotary_pos_emb(xt, xt, hf_cos, hf_sin)
    (theirs_grad,) = torch.autograd.grad(theirs.permute(2, 0, 1, 3), x, grad)
    torch.testing.assert_close(ours, theirs.permute(2, 0, 1, 3), atol=1e-12, rtol=0)
    torch.testing.assert_close(ours_grad, theirs_grad, atol=1e-12, rtol=0)
    assert torch.equal(ours[..., 6:], x[..., 6:])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_use_flash_attn_runs_sdpas_flash_kernel_and_matches_the_default_path():
    from llamapipe.model.llama import LlamaConfig, LlamaModel
    base = LlamaConfig(num_layers=2, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4, num_query_groups=2,
                       vocab_size=256, max_position_embeddings=128)
    tokens = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(0)).cuda()
    outs = []
    for flash in (False, True):
        model = LlamaModel(base.replace(use_flash_attn=flash), params_dtype=torch.bfloat16).cuda()
        with torch.no_grad():
            outs.append(model(tokens).float())
    torch.testing.assert_close(outs[1], outs[0], atol=3e-2, rtol=3e-2)   # bf16 kernels, different summation order


def test_per_split_data_paths_use_each_dataset_whole(tmp_path):
    """--train-data-path A --valid-data-path 1 B 3 C: train is all of A's documents, valid blends B and C
    1:3, there is no test set; told apart by their token ranges (A < 1000 <= B < 5000 <= C)."""
    from llamapipe.core.config import DataConfig
    from llamapipe.data.gpt_dataset import build_gpt_datasets
    from llamapipe.data.sampler import build_data_iterators
    from tests.unit.test_data_gpt_dataset import write_docs
    a, b, c = (write_docs(tmp_path / n, 20, seed=i, base=base)[0] for i, (n, base) in
               enumerate((("a", 0), ("b", 1000), ("c", 5000))))
    train, valid, test = build_gpt_datasets((), "969,30,1", [30, 400, 0], 8, 1, str(tmp_path / "cache"),
                                            per_split_paths=((a,), ("1", b, "3", c), ()))
    assert sorted(set(np.asarray(train.doc_idx).tolist())) == list(range(20)) and test is None
    assert all(int(train[i]["tokens"].max()) < 1000 for i in range(len(train)))
    from_c = sum(int(valid[i]["tokens"].min()) >= 5000 for i in range(400))
    assert sum(int(valid[i]["tokens"].max()) < 5000 for i in range(400)) + from_c == 400
    assert from_c == 300            # the blend puts round(3/4 * 400) samples from C, +-1 (here exactly)
    data = DataConfig(train_data_path=(a,), valid_data_path=(b,), data_cache_path=str(tmp_path / "cache"))
    loaders = build_data_iterators(data, TrainingConfig(micro_batch_size=2, global_batch_size=2, seq_length=8,
                                                        train_iters=2, eval_iters=1, seed=1), dp_rank=0, dp_size=1,
                                   vocab_size=6000)
    assert loaders[1] is not None and loaders[2] is None
    assert int(next(loaders[1])["tokens"].min()) >= 1000
