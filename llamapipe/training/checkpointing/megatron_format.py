"""Megatron-LM's checkpoint format, read and written without Megatron: the key map between megatron-core's
GPTModel (sharded state dict names, local and Transformer Engine specs) and our logical names, the fused
tensors' layouts, and the files of a torch_dist save (DCP `.metadata` + `__<rank>_<k>.distcp`, `common.pt`,
`metadata.json`). docs/megatron_checkpoints.md describes it.

Layouts (megatron-core 0.16.1): a uniform model's layers are stored stacked, `decoder.layers.<name>` with a
leading [num_layers] axis (older saves: `decoder.layers.<i>.<name>`, both read); `linear_qkv` rows run per
query group (the group's heads/groups query heads, then its key head, then its value head); `linear_fc1` is
[gate; up]; the vocabulary rows are padded (to make_vocab_size_divisible_by x TP).
common.pt pickles Megatron's argparse Namespace with its enums and config classes: `load_common` reads it with
torch's weights-only loader, every class outside its set allowed by name as an inert stand-in, so no code from
the file runs.
"""
from __future__ import annotations

import argparse
import types

import torch

TOP = {"embedding.word_embeddings.weight": "embedding.weight", "decoder.final_layernorm.weight": "final_norm.weight",
       "output_layer.weight": "output.weight"}
LAYER = {  # Megatron (stored, TE names; the local spec saves its norms under them too) -> ours, in layers.<i>
    "self_attention.linear_qkv.layer_norm_weight": "input_norm.weight",
    "self_attention.linear_proj.weight": "attention.o_proj.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_norm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
LOCAL_NORMS = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
               "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}   # local spec's own names
QKV, FC1 = "self_attention.linear_qkv.weight", "mlp.linear_fc1.weight"
EXTRA_STATE = ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2")
UNSUPPORTED = (("bias", "biases (add_bias_linear / add_qkv_bias)"), ("experts", "mixture of experts"),
               ("router", "mixture of experts"), ("layer_norm_bias", "LayerNorm (ours is RMSNorm)"),
               ("q_layernorm", "QK layernorm"), ("mtp", "multi-token prediction"))


def split_qkv(qkv: torch.Tensor, heads: int, groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v projections from Megatron's per-query-group linear_qkv rows."""
    per_group = heads // groups
    head_dim = qkv.shape[0] // (heads + 2 * groups)
    grouped = qkv.reshape(groups, per_group + 2, head_dim, qkv.shape[-1])
    q = grouped[:, :per_group].reshape(heads * head_dim, -1)
    k = grouped[:, per_group].reshape(groups * head_dim, -1)
    v = grouped[:, per_group + 1].reshape(groups * head_dim, -1)
    return q, k, v


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, groups: int) -> torch.Tensor:
    head_dim, hidden = k.shape[0] // groups, q.shape[-1]
    grouped = torch.cat([q.reshape(groups, heads // groups, head_dim, hidden),
                         k.reshape(groups, 1, head_dim, hidden), v.reshape(groups, 1, head_dim, hidden)], dim=1)
    return grouped.reshape(-1, hidden)


def _per_layer(megatron: dict[str, torch.Tensor], num_layers: int, source: str) -> dict[tuple[int, str], torch.Tensor]:
    """{(layer, stored name): tensor} from stacked (`decoder.layers.<name>`) or numbered keys."""
    layers = {}
    for key, tensor in megatron.items():
        if not key.startswith("decoder.layers."):
            continue
        rest = key[len("decoder.layers."):]
        head, _, tail = rest.partition(".")
        if head.isdigit():
            layers[(int(head), LOCAL_NORMS.get(tail, tail))] = tensor
        else:
            name = LOCAL_NORMS.get(rest, rest)
            if tensor.shape[0] != num_layers:
                raise ValueError(f"{source}: {key} stacks {tensor.shape[0]} layers but the args say {num_layers}")
            layers.update({(i, name): tensor[i] for i in range(num_layers)})
    return layers


def check_supported(keys, source: str) -> None:
    for key in keys:
        for word, what in UNSUPPORTED:
            if word in key.split(".")[-1] or f".{word}." in f".{key}.":
                raise ValueError(f"{source} holds {key}: {what} is not LLaMA-shaped, which is all llamapipe "
                                 "reads from Megatron")


def to_ours(megatron: dict[str, torch.Tensor], num_layers: int, heads: int, groups: int,
            source: str) -> dict[str, torch.Tensor]:
    """Our full logical state dict from Megatron's global (unsharded) tensors."""
    check_supported(megatron, source)
    ours = {name: megatron[key] for key, name in TOP.items() if key in megatron}
    for key in TOP:
        if key not in megatron and key != "output_layer.weight":
            raise ValueError(f"{source} has no {key}")
    layers = _per_layer(megatron, num_layers, source)
    for i in range(num_layers):
        def get(name):
            if (i, name) not in layers:
                raise ValueError(f"{source} has no decoder.layers.{name} for layer {i}")
            return layers[(i, name)]
        for name, mine in LAYER.items():
            ours[f"layers.{i}.{mine}"] = get(name)
        qkv, fc1 = get(QKV), get(FC1)
        if qkv.dim() != 2 or qkv.shape[0] % (heads + 2 * groups) or fc1.dim() != 2 or fc1.shape[0] % 2:
            raise ValueError(f"{source}: layer {i}'s linear_qkv {tuple(qkv.shape)} / linear_fc1 "
                             f"{tuple(fc1.shape)} do not fit {heads} heads in {groups} query groups and a "
                             "gated MLP, which its args say")
        q, k, v = split_qkv(qkv, heads, groups)
        gate, up = fc1.chunk(2, dim=0)
        ours.update({f"layers.{i}.attention.q_proj.weight": q, f"layers.{i}.attention.k_proj.weight": k,
                     f"layers.{i}.attention.v_proj.weight": v, f"layers.{i}.mlp.gate_proj.weight": gate,
                     f"layers.{i}.mlp.up_proj.weight": up})
    return {name: tensor.contiguous() for name, tensor in ours.items()}


def to_megatron(ours: dict[str, torch.Tensor], num_layers: int, heads: int, groups: int,
                tied: bool) -> dict[str, torch.Tensor]:
    """Megatron's global tensors, layers stacked, from our full logical state dict."""
    megatron = {key: ours[name] for key, name in TOP.items() if not (tied and name == "output.weight")}
    stacked: dict[str, list[torch.Tensor]] = {}
    for i in range(num_layers):
        layer = {name: ours[f"layers.{i}.{mine}"] for name, mine in LAYER.items()}
        layer[QKV] = fuse_qkv(*(ours[f"layers.{i}.attention.{p}_proj.weight"] for p in "qkv"), heads, groups)
        layer[FC1] = torch.cat([ours[f"layers.{i}.mlp.gate_proj.weight"], ours[f"layers.{i}.mlp.up_proj.weight"]])
        for name, tensor in layer.items():
            stacked.setdefault(name, []).append(tensor)
    megatron.update({f"decoder.layers.{name}": torch.stack(tensors) for name, tensors in stacked.items()})
    return {key: tensor.contiguous() for key, tensor in megatron.items()}


def fit_rows(full: dict[str, torch.Tensor], rows: int) -> dict[str, torch.Tensor]:
    """The vocabulary tensors cut or zero-padded to `rows` (Megatron padded to its TP, we to ours)."""
    out = dict(full)
    for key in ("embedding.weight", "output.weight"):
        if key in out and out[key].shape[0] != rows:
            t = out[key]
            out[key] = t[:rows] if t.shape[0] > rows else torch.cat([t, t.new_zeros(rows - t.shape[0], t.shape[1])])
    return out


class StandIn:
    """What a class outside the allow-list unpickles to: its recorded name and state, nothing run."""

    def __init__(self, *args, **kwargs):
        self.args = args

    def __setstate__(self, state):
        self.__dict__["state"] = state

    def __repr__(self):
        return f"<{type(self).__name__} {self.args!r}>"


_PLAIN = {"argparse.Namespace": argparse.Namespace, "types.SimpleNamespace": types.SimpleNamespace}


def _stand_ins(path: str) -> list[tuple[type, str]]:
    """Every class or function `path` names that torch's weights-only loader does not already build, each allowed
    under its own name as a StandIn subclass (so Megatron's enums and config classes load as inert records)."""
    stand_ins = []
    for name in torch.serialization.get_unsafe_globals_in_checkpoint(path):
        module, _, qualname = name.rpartition(".")
        if name in _PLAIN:      # attribute bags: built as themselves
            stand_ins.append((_PLAIN[name], name))
            continue
        stand_ins.append((type(qualname, (StandIn,), {"__module__": f"standin.{module}"}), name))
    return stand_ins


def load_common(path: str) -> dict:
    """common.pt / a legacy model_optim_rng.pt: a dict, loaded with weights_only=True; any class outside torch's
    weights-only set (argparse.Namespace, Megatron's enums and configs) is an inert stand-in, so nothing runs."""
    try:
        with torch.serialization.safe_globals(_stand_ins(path)):
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ValueError(f"{path} is not a readable Megatron checkpoint file ({type(exc).__name__}: {exc})") from None
    if not isinstance(state, dict):
        raise ValueError(f"{path} holds a {type(state).__name__}, not a Megatron checkpoint's state dict")
    return state


_COLUMN = ("self_attention.linear_qkv.weight", "mlp.linear_fc1.weight", "embedding.word_embeddings.weight",
           "output_layer.weight")                                             # TP splits dim 0
_ROW = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")       # TP splits dim 1


def merge_legacy(shards: dict[tuple[int, int], dict[str, torch.Tensor]], num_layers: int, tp: int, pp: int,
                 source: str) -> dict[str, torch.Tensor]:
    """Global tensors (numbered layers) from legacy `mp_rank_{t}[_{p}]` model state dicts {(t, p): sd} of a
    tp x pp save (the sizes its args record):
    stage-local layer numbers shifted by pp_rank x layers per stage, TP shards concatenated (each rank's
    linear_fc1 is its [gate_r; up_r], put back as [gate; up])."""
    if max(shards) >= (tp, 0) or max(p for _, p in shards) >= pp:
        raise ValueError(f"{source} holds shards beyond its args' tensor {tp} x pipeline {pp} ranks")
    if num_layers % pp:
        raise ValueError(f"{source}: {num_layers} layers do not split evenly over {pp} pipeline stages")
    per_stage = num_layers // pp
    for t in range(tp):
        for p in range(pp):
            if (t, p) not in shards:
                raise ValueError(f"{source} lacks the shard of tensor rank {t}, pipeline rank {p}")
    merged: dict[str, torch.Tensor] = {}
    for p in range(pp):
        names = [k for k in shards[(0, p)] if not k.endswith("_extra_state")]
        for key in names:
            parts = [shards[(t, p)][key] for t in range(tp)]
            if key.endswith("mlp.linear_fc1.weight") and tp > 1:
                halves = [part.chunk(2, dim=0) for part in parts]
                tensor = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
            elif key.endswith(_COLUMN):
                tensor = torch.cat(parts, dim=0)
            elif key.endswith(_ROW):
                tensor = torch.cat(parts, dim=1)
            else:
                tensor = parts[0]
            if key.startswith("decoder.layers."):
                head, _, tail = key[len("decoder.layers."):].partition(".")
                key = f"decoder.layers.{int(head) + p * per_stage}.{tail}"
            merged[key] = tensor
    return merged
