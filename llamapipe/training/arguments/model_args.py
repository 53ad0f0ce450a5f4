"""The model config from the flags: a --model preset with overrides, or Megatron's required shape flags.

Megatron requires --num-layers, --hidden-size, --num-attention-heads, --max-position-embeddings and
--seq-length, computes a missing --ffn-hidden-size (4h, or int(4h * 2/3 / 64) * 64 under --swiglu) and a
missing --kv-channels (h / heads), and uses --num-query-groups only under --group-query-attention. Here a
--model preset may supply the shape instead (its own ffn size and query groups; --seq-length then defaults
to 128), and a run given neither a preset nor any shape flag trains the tiny preset, so that
`pretrain_llama.py --mock-data` works for a newcomer.
"""
from __future__ import annotations

import argparse
from typing import Optional

import torch

from llamapipe.core.config import ArgumentError, ParallelConfig
from llamapipe.data.tokenizers.base import Tokenizer
from llamapipe.model.recompute import LGD, MEGATRON_MODULES, NOT_DENSE
from llamapipe.model import families
from llamapipe.model.llama import LlamaConfig
from llamapipe.model.llama.config import SCALING_FIELDS, trainable_defect
from llamapipe.model.families import PRESETS
from llamapipe.training.arguments.pipeline import check_layer_split

FALLBACK_PRESET = "tiny"
PRESET_SEQ_LENGTH = 128
REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings", "seq_length")
_SHAPE = REQUIRED[:4]
_OVERRIDES = {"num_layers": "num_layers", "hidden_size": "hidden_size", "ffn_hidden_size": "ffn_hidden_size",
              "num_attention_heads": "num_attention_heads", "vocab_size": "vocab_size",
              "max_position_embeddings": "max_position_embeddings", "rope_theta": "rotary_base",
              "norm_epsilon": "norm_epsilon", "make_vocab_size_divisible_by": "make_vocab_size_divisible_by",
              "init_method_std": "init_method_std", "kv_channels": "kv_channels",
              "recompute_num_layers": "recompute_num_layers", "rope_scaling_factor": "rope_scaling_factor"}


def _flags(names) -> str:
    return ", ".join("--" + n.replace("_", "-") for n in names)


def megatron_ffn_hidden_size(hidden_size: int, swiglu: bool) -> int:
    """Megatron's default MLP width (megatron/training/arguments.py, validate_args)."""
    return int((4 * hidden_size * 2 / 3) / 64) * 64 if swiglu else 4 * hidden_size


def preset_name(args: argparse.Namespace) -> Optional[str]:
    """The preset in effect: --model, the fallback when neither it nor any shape flag is given, else None."""
    if args.model is None and not any(getattr(args, n) is not None for n in _SHAPE):
        return FALLBACK_PRESET
    return args.model


def run_seq_length(args: argparse.Namespace) -> int:
    """--seq-length, which a preset run may leave out (Megatron requires it with the shape flags)."""
    if args.seq_length is None:
        assert preset_name(args) is not None, "model_config requires --seq-length without a preset"
        return PRESET_SEQ_LENGTH
    return args.seq_length


def _base_fields(args: argparse.Namespace, notices: list[str]) -> dict:
    """The preset's fields, or those Megatron derives from the required shape flags."""
    preset = preset_name(args)
    if preset is not None:
        if args.model is None:
            notices.append(f"notice: no --model and no model shape flags: training the {preset} preset "
                           f"(--model {preset}); give --model or Megatron's shape flags for another")
        return dict(PRESETS[preset])
    missing = [n for n in REQUIRED if getattr(args, n) is None]
    if missing:
        raise ArgumentError(f"{_flags(missing)} {'is' if len(missing) == 1 else 'are'} required with the other "
                            "model shape flags (as in Megatron-LM); give them, or a --model preset")
    if args.vocab_size is None and args.tokenizer_model is None:
        raise ArgumentError("--vocab-size is required without --tokenizer-model (or a --model preset)")
    fields = {"ffn_hidden_size": megatron_ffn_hidden_size(args.hidden_size, args.swiglu)}
    if args.vocab_size is None:     # a placeholder: run_vocab_size takes the tokenizer's vocabulary
        fields["vocab_size"] = LlamaConfig.vocab_size
    return fields


def _query_groups(args: argparse.Namespace, heads: int, notices: list[str]) -> int:
    """Megatron's rule; a preset of a GQA model (llama3-8b) counts as --group-query-attention."""
    preset = PRESETS.get(preset_name(args), {})
    preset_gqa = preset.get("num_query_groups", heads) != preset.get("num_attention_heads", heads)
    if args.group_query_attention or preset_gqa:
        if args.num_query_groups is not None:
            return args.num_query_groups
        return preset["num_query_groups"] if preset_gqa else 1     # Megatron's --num-query-groups default
    if args.num_query_groups is not None and args.num_query_groups != heads:
        notices.append(f"notice: --num-query-groups {args.num_query_groups} is ignored without "
                       "--group-query-attention (as in Megatron-LM): every head has its own keys and values")
    return heads


def model_config(args: argparse.Namespace, notices: list[str]) -> LlamaConfig:
    """Build the LlamaConfig from the preset in effect and the shape flags (`args` stays as parsed)."""
    fields = _base_fields(args, notices)
    fields.update({field: getattr(args, flag) for field, flag in _OVERRIDES.items()
                   if getattr(args, flag) is not None})
    fields["num_query_groups"] = _query_groups(args, fields["num_attention_heads"], notices)
    if fields.get("kv_channels") is not None and fields["kv_channels"] * fields["num_attention_heads"] == \
            fields["hidden_size"]:
        fields["kv_channels"] = None    # one spelling of the default head dim, so checkpoint configs compare
    if args.use_rope_scaling:
        fields["use_rope_scaling"] = True
        # Llama 3 scaling's bands and original context: no flag; --use-checkpoint-args puts the checkpoint's here
        fields.update({f: getattr(args, f) for f in SCALING_FIELDS if getattr(args, f, None) is not None})
    if args.rope_scaling_factor is not None and not fields.get("use_rope_scaling"):
        del fields["rope_scaling_factor"]   # the factor of a scaling that is off: the config keeps the default
        notices.append(f"notice: --rope-scaling-factor {args.rope_scaling_factor:g} has no effect without "
                       "--use-rope-scaling (as in Megatron-LM)")
    if args.untie_embeddings_and_output_weights:
        fields["tie_word_embeddings"] = False
    if args.tie_embeddings_and_output_weights:
        fields["tie_word_embeddings"] = True
    granularity = args.recompute_granularity
    if args.recompute_activations:
        if granularity == "full":
            raise ArgumentError("--recompute-activations (selective recompute) contradicts "
                                "--recompute-granularity full; give one")
        granularity = "selective"
    fields["recompute_granularity"] = granularity
    fields["recompute_modules"] = _recompute_modules(args, granularity)
    if args.recompute_method == "uniform":
        fields["recompute_num_layers"] = None   # Megatron uniform, 1 layer per group: every layer
    if args.use_flash_attn:
        _check_flash_attn(args, notices)
    config_class = _family(args).config_class
    return config_class(**fields, rotary_percent=args.rotary_percent, use_flash_attn=args.use_flash_attn)


def _family(args: argparse.Namespace) -> families.ModelFamily:
    """The preset's family; --add-qkv-bias (Megatron's Qwen2 flag) asks for the family with q/k/v biases;
    --use-checkpoint-args takes the checkpoint's, as it does the other architecture switches."""
    recorded = getattr(args, "checkpoint_family", None)
    if recorded is not None:
        return families.family_named(recorded)
    preset = preset_name(args)
    family = families.family_of_preset(preset) if preset is not None else families.FAMILIES["llama"]
    biased = families.qkv_bias_family()
    if getattr(args, "add_qkv_bias", False) and family is not biased:
        if args.model is not None and family.name != "llama":
            raise ArgumentError(f"--add-qkv-bias asks for the {biased.name} family but --model "
                                f"{args.model} is a {family.name} model")
        family = biased
    return family


def run_tokenizer(args: argparse.Namespace) -> Optional[Tokenizer]:
    """The run's tokenizer (None without --tokenizer-model or NullTokenizer); built after data_config checked its
    flags."""
    from llamapipe.data.tokenizer import build_tokenizer   # sentencepiece/tokenizers: imported only here
    if args.tokenizer_model is None and args.tokenizer_type != "NullTokenizer":
        return None
    try:
        return build_tokenizer(args.tokenizer_model, args.tokenizer_type, vocab_size=args.vocab_size)
    except ValueError as err:
        raise ArgumentError(str(err)) from None


def run_vocab_size(args: argparse.Namespace, model: LlamaConfig, notices: list[str],
                   tokenizer: Optional[Tokenizer]) -> LlamaConfig:
    """`model` with the run's vocabulary (`data.tokenizer.model_vocab_size`, the one rule), which the model pads,
    the checkpoint records and export writes; `tokenizer` is `run_tokenizer`'s."""
    from llamapipe.data.tokenizer import model_vocab_size
    try:
        vocab = model_vocab_size(tokenizer, args.vocab_size, model.vocab_size)
    except ValueError as err:
        raise ArgumentError(str(err)) from None
    if tokenizer is not None:
        source = (f"--tokenizer-model {args.tokenizer_model}" if args.tokenizer_model is not None else
                  f"--tokenizer-type NullTokenizer (ids 0..{args.vocab_size - 1} and eod {tokenizer.eod})")
        if vocab > tokenizer.vocab_size:
            source = f"--vocab-size (larger than the {tokenizer.vocab_size} ids of {source})"
        notices.append(f"vocabulary size {vocab} from {source}, padded to "
                       f"{model.replace(vocab_size=vocab).padded_vocab_size(args.tensor_model_parallel_size)} "
                       f"rows for --tensor-model-parallel-size {args.tensor_model_parallel_size}")
    return model.replace(vocab_size=vocab)


def _check_flash_attn(args: argparse.Namespace, notices: list[str]) -> None:
    if not torch.cuda.is_available() or args.distributed_backend == "gloo":
        notices.append("notice: --use-flash-attn has no effect on CPU: SDPA's FlashAttention kernel is CUDA-only")
    elif not (args.bf16 or args.fp16):
        raise ArgumentError("--use-flash-attn needs --bf16 or --fp16: FlashAttention computes in half precision")


def check_model(args: argparse.Namespace, m: LlamaConfig, par: ParallelConfig, seq_length: int) -> None:
    tp = par.tp_size
    check_layer_split(args, m.num_layers, par)
    if m.kv_channels is None and m.hidden_size % m.num_attention_heads:
        raise ArgumentError(f"--hidden-size {m.hidden_size} is not divisible by --num-attention-heads "
                            f"({m.num_attention_heads}); give --kv-channels for another head dim")
    if not 0 < m.rotary_percent <= 1 or m.rotary_dim % 2 or m.rotary_dim == 0:
        raise ArgumentError(f"--rotary-percent {m.rotary_percent} must be in (0, 1] and leave RoPE a positive even "
                            f"number of dims; of the head dim {m.head_dim} it rotates {m.rotary_dim}")
    for name, value in (("--num-attention-heads", m.num_attention_heads), ("--num-query-groups", m.num_query_groups),
                        ("--ffn-hidden-size", m.ffn_hidden_size)):
        if value % tp:
            raise ArgumentError(f"{name} {value} is not divisible by --tensor-model-parallel-size ({tp})")
    if m.num_attention_heads % m.num_query_groups:
        raise ArgumentError(f"--num-query-groups {m.num_query_groups} does not divide "
                            f"--num-attention-heads ({m.num_attention_heads})")
    if seq_length > m.max_position_embeddings:
        raise ArgumentError(f"--seq-length {seq_length} is larger than "
                            f"--max-position-embeddings ({m.max_position_embeddings})")
    if par.sequence_parallel and seq_length % tp:
        raise ArgumentError(f"--seq-length {seq_length} is not divisible by --tensor-model-parallel-size "
                            f"({tp}), which --sequence-parallel needs")
    _check_context_parallel_length(par, seq_length)
    _check_a2a_heads(m, par)
    for flag in ("attention_dropout", "hidden_dropout"):
        if getattr(args, flag):
            raise ArgumentError(f"--{flag.replace('_', '-')} {getattr(args, flag)} is not supported: LLaMA "
                                "pretraining here uses no dropout (accepted only as 0 for Megatron scripts)")
    _check_recompute(args, m)
    if m.use_rope_scaling and m.rope_scaling_factor <= 0:
        raise ArgumentError(f"--rope-scaling-factor {m.rope_scaling_factor:g} must be positive")
    defect = trainable_defect(m)     # the check convert-hf import makes too
    if defect is not None:
        field, value, must = defect
        raise ArgumentError(f"the model's {field} is {value!r}; it must be {must}")


def _check_a2a_heads(m: LlamaConfig, par: ParallelConfig) -> None:
    """a2a context parallelism gives each rank of the a2a level whole query groups of its TP rank's."""
    if par.cp_size == 1 or par.cp_comm_type not in ("a2a", "a2a+p2p"):
        return
    a2a, groups = par.cp_a2a_size or par.cp_size, m.num_query_groups // par.tp_size
    if groups % a2a:
        level = ("--context-parallel-size" if par.cp_comm_type == "a2a"
                 else "the first of --hierarchical-context-parallel-sizes")
        raise ArgumentError(f"--cp-comm-type {par.cp_comm_type}: --num-query-groups {m.num_query_groups} / "
                            f"--tensor-model-parallel-size ({par.tp_size}) = {groups} query groups per rank are not "
                            f"divisible by the all-to-all size ({level}, {a2a})")


def _check_context_parallel_length(par: ParallelConfig, seq_length: int) -> None:
    """Each CP rank holds 2 of 2 x cp equal chunks; under --sequence-parallel its s/cp tokens split over tp."""
    cp, tp = par.cp_size, par.tp_size if par.sequence_parallel else 1
    if cp > 1 and seq_length % (2 * cp):
        raise ArgumentError(f"--seq-length {seq_length} is not divisible by 2 x --context-parallel-size ({cp}): "
                            "context parallelism splits each sequence into 2 equal chunks per rank")
    if cp > 1 and (seq_length // cp) % tp:
        raise ArgumentError(f"--seq-length {seq_length} / --context-parallel-size ({cp}) = {seq_length // cp} tokens "
                            f"per rank are not divisible by --tensor-model-parallel-size ({tp}) under "
                            "--sequence-parallel, which splits them over the tensor-parallel ranks")


def _recompute_modules(args: argparse.Namespace, granularity: Optional[str]) -> tuple:
    """The parts of each layer to recompute (model/recompute.py): --recompute-modules under selective recompute
    (Megatron's default core_attn), plus the norms and the activation under the fork's --recompute-lgd."""
    names = args.recompute_modules
    if names is not None and granularity != "selective":
        raise ArgumentError(f"--recompute-modules {' '.join(names)} needs --recompute-granularity selective "
                            "(as in Megatron-LM)")
    for name in names or ():
        if name in NOT_DENSE:
            raise ArgumentError(f"--recompute-modules {name} applies to mixture-of-experts or MLA layers; this "
                                f"model is a dense LLaMA (use {', '.join(MEGATRON_MODULES)})")
        if name not in MEGATRON_MODULES:
            raise ArgumentError(f"--recompute-modules {name} is not one of Megatron's modules for this model; use "
                                f"{', '.join(MEGATRON_MODULES)}")
    modules = tuple(dict.fromkeys(names or (("core_attn",) if granularity == "selective" else ())))
    if getattr(args, "recompute_lgd", False):
        if granularity == "full":
            raise ArgumentError("--recompute-lgd recomputes the norms and the activation of each layer, which "
                                "--recompute-granularity full already recomputes whole; give one")
        modules = tuple(dict.fromkeys(modules + LGD))
    freed = [name for name in modules if name in LGD]
    if freed and getattr(args, "compile", False):
        said = "--recompute-lgd" if "act" in freed else "--recompute-modules layernorm"
        raise ArgumentError(f"{said} frees and refills the outputs it recomputes, which a compiled layer cannot do; "
                            "drop --compile or use --recompute-modules core_attn mlp")
    return modules


def _check_recompute(args: argparse.Namespace, m: LlamaConfig) -> None:
    if args.recompute_num_layers is not None and m.recompute_granularity != "full":
        raise ArgumentError(f"--recompute-num-layers {args.recompute_num_layers} needs --recompute-granularity full")
    if args.recompute_method is not None and m.recompute_granularity == "selective":
        raise ArgumentError(f"--recompute-method {args.recompute_method} applies to --recompute-granularity full, "
                            "not to selective recompute (--recompute-activations)")
    if args.recompute_method == "uniform" and (args.recompute_num_layers or 1) > 1:
        raise ArgumentError(f"--recompute-method uniform with --recompute-num-layers {args.recompute_num_layers} "
                            "is not supported; use --recompute-method block (the first N layers of each chunk)")
