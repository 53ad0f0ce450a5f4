"""megatron-core's pipeline schedules on CPU for benchmarks/bench_peers.py: the adapter (every CUDA-only call the
schedules and GPTModel make, patched here and nowhere else, each with why) and the model (GPTModel with the
local spec: RMSNorm, RoPE, SwiGLU, grouped-query attention, untied embeddings, no biases, no dropout).

megatron-core 0.16.1 is imported only here and only when the benchmark runs it; the package never does.
"""
from __future__ import annotations

import contextlib
import types

import torch
import torch.nn.functional as F


class _CpuZerosTorch(types.ModuleType):
    """`torch` as megatron's schedules.py sees it: `zeros(..., device="cuda")` lands on the CPU, all else is torch."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, **kwargs):
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return torch.zeros(*args, **kwargs)


def patch_for_cpu() -> list[str]:
    """Apply the CPU patches; returns one line per patch saying what and why (the benchmark records them)."""
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as mrandom
    done = []
    # p2p_communication allocates its receive buffers and shape messages on torch.cuda.current_device(), and RoPE
    # puts its frequencies there: the device that stands for "this rank's accelerator" is the CPU here.
    torch.cuda.current_device = lambda: "cpu"
    done.append("torch.cuda.current_device -> 'cpu' (p2p receive buffers and RoPE frequencies ask it for the device)")
    # p2p_communication synchronizes the CUDA stream after batched sends; CPU ops are synchronous already.
    torch.cuda.synchronize = lambda *a, **k: None
    done.append("torch.cuda.synchronize -> no-op (after p2p ops; CPU work is synchronous)")
    # The schedules count tokens in `torch.zeros([], dtype=torch.int, device="cuda")`.
    schedules.torch = _CpuZerosTorch("torch")
    done.append("schedules.py's torch.zeros(device='cuda') token counter -> CPU")
    # Dropout regions fork the CUDA RNG tracker; dropout is 0 here, so no RNG state is needed at all.
    tracker = mrandom.get_cuda_rng_tracker()
    tracker.fork = lambda *a, **k: contextlib.nullcontext()
    done.append("CUDA RNG tracker fork -> null context (it swaps CUDA RNG states; dropout is 0)")
    done.append("explicit causal mask passed to GPTModel (the default mask is built on 'cuda')")
    return done


def causal_mask(seq: int) -> torch.Tensor:
    """Megatron's convention: True where attention is NOT allowed, shape (1, 1, s, s)."""
    return torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]


def build(shape, pp: int, vpp: int) -> tuple[list, list[str]]:
    """(this rank's model chunks, the patches applied). Initialises megatron's parallel state over the default
    (gloo) group: tensor 1, pipeline `pp`, virtual `vpp` (None when 1)."""
    patches = patch_for_cpu()
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    mpu.initialize_model_parallel(1, pp, virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None)
    try:
        model_parallel_cuda_manual_seed(1234)
    except Exception:  # the tracker's CUDA states cannot exist on CPU; the forked tracker above never uses them
        pass
    config = TransformerConfig(
        num_layers=shape.layers, hidden_size=shape.hidden, ffn_hidden_size=shape.ffn,
        num_attention_heads=shape.heads, num_query_groups=shape.groups, kv_channels=shape.hidden // shape.heads,
        normalization="RMSNorm", layernorm_epsilon=1e-5, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False,
        apply_rope_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=True, init_method_std=0.02, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None, pipeline_dtype=torch.float32,
        params_dtype=torch.float32, batch_p2p_comm=False, deallocate_pipeline_outputs=False)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    chunks = []
    for v in range(vpp):
        vp = v if vpp > 1 else None
        chunks.append(GPTModel(
            config=config, transformer_layer_spec=spec, vocab_size=shape.vocab, max_sequence_length=shape.seq,
            pre_process=mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            share_embeddings_and_output_weights=False, position_embedding_type="rope", vp_stage=vp))
    return chunks, patches


def step_function(shape, chunks: list, batches: list):
    """One forward-backward over `batches` (each {"tokens", "labels"} of (b, s)) with megatron's schedule for
    these chunks; returns the per-microbatch mean token losses on the last stage ([] elsewhere)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    fb = get_forward_backward_func()
    mask = causal_mask(shape.seq)
    position_ids = torch.arange(shape.seq)[None].expand(shape.micro_batch, -1)

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        out = model(batch["tokens"], position_ids, mask, labels=batch["labels"])   # (b, s) token losses

        def loss_func(per_token):
            loss = per_token.float().mean()
            return loss, {"lm loss": loss.detach().clone()}   # megatron divides `loss` in place by m
        return out, loss_func

    def step() -> list[float]:
        iters = [iter(batches) for _ in chunks]
        out = fb(forward_step_func=forward_step, data_iterator=iters if len(chunks) > 1 else iters[0],
                 model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=len(batches),
                 seq_length=shape.seq, micro_batch_size=shape.micro_batch)
        return [float(d["lm loss"]) for d in out]
    return step
