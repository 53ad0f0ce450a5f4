"""Checks every model family's HF tests make (tests/unit/test_model_<family>.py): gradients against HF's with the
zero-bubble B/W split, and the to_hf(from_hf(x)) round trip."""
from __future__ import annotations

import torch
import transformers

from llamapipe.core.tensor_parallel.weight_grad_store import WeightGradStore


def assert_grads_in_b_match_hf(hf, ours, ids: torch.Tensor, in_b: dict, deferred: tuple) -> None:
    """Layer 1's gradients equal HF's: `in_b` ({our attention's parameter path: HF name}) already after B under a
    weight-gradient store, `deferred` (our path, HF name) only once its W has run."""
    hf(input_ids=ids, labels=ids).loss.backward()
    store = WeightGradStore()
    with store.capture("mb0"):
        ours(ids[:, :-1], labels=ids[:, 1:]).mean().backward()
    attention = ours.layers["1"].attention
    hf_params = dict(hf.named_parameters())
    ours_param = attention.get_parameter
    assert ours_param(deferred[0]).grad is None, "the weight gradient is deferred to W"
    for path, hf_name in in_b.items():
        torch.testing.assert_close(ours_param(path).grad, hf_params[hf_name].grad, rtol=1e-4, atol=1e-7)
    store.run("mb0")
    torch.testing.assert_close(ours_param(deferred[0]).grad, hf_params[deferred[1]].grad, rtol=1e-4, atol=1e-7)


def exact_round_trip(hf, from_hf, to_hf) -> tuple:
    """to_hf(from_hf(x)) gives back exactly HF's tensors: (our config, our state dict, HF's state dict, config)."""
    config, state_dict = from_hf(hf.state_dict(), hf.config.to_dict())
    hf_sd, hf_cfg = to_hf(config, state_dict)
    original = hf.state_dict()
    assert set(hf_sd) == set(original)
    for name, tensor in original.items():
        assert torch.equal(hf_sd[name], tensor), name
    return config, state_dict, hf_sd, hf_cfg


def assert_hf_round_trip(hf, from_hf, to_hf, model_type: str, architecture: str):
    """`exact_round_trip` and a config transformers builds `architecture` from; returns (our config, our state
    dict, the rebuilt HF model)."""
    config, state_dict, hf_sd, hf_cfg = exact_round_trip(hf, from_hf, to_hf)
    assert hf_cfg["model_type"] == model_type and hf_cfg["architectures"] == [architecture]
    rebuilt = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**hf_cfg))
    assert type(rebuilt).__name__ == architecture
    rebuilt.load_state_dict(hf_sd)
    return config, state_dict, rebuilt
