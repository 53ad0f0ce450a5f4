"""megatron-core as a reference on CPU: the patches it needs, a tiny LLaMA-shaped GPTModel, its forward, and a
save directory laid out as Megatron-LM's training writes it.

megatron-core is an optional test dependency (docs/testing.md); `require()` skips a test with the reason when it
cannot be imported. Every patch below is applied only inside `cpu_patches()` and names the CUDA-only call it
replaces:

- `torch.cuda.current_device`: RotaryEmbedding and the attention modules ask it for the device of tensors they
  make (the RoPE frequencies, the default causal mask); on CPU it answers "cpu".
- `torch.cuda.synchronize`: `dist_checkpointing.save` calls it around the write; on CPU there is nothing to wait for.
- `tensor_parallel.random.get_cuda_rng_tracker().fork`: dropout regions fork the CUDA RNG; with dropout 0 the fork
  is a no-op context.
- `FileSystemWriterAsync.write_preloaded_data_multiproc`: `dist_checkpointing.save` writes its files from
  processes it forks; forked from a threaded test process (a pytest-xdist worker, with wandb's or torch's threads)
  the writers can die before they report, and the save waits for them forever (seen in CI). The same buckets are
  written here in this process by megatron-core's own `write_preloaded_data`: the same files.
The causal mask is passed explicitly to `forward` (the default one is built on "cuda").
"""
from __future__ import annotations

import argparse
import contextlib
import os
import warnings
from unittest import mock

import pytest
import torch


def require():
    """megatron.core, or skip the calling test saying why."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import megatron.core  # noqa: F401
            from megatron.core.models.gpt import GPTModel  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install
        pytest.skip(f"megatron-core cannot be imported ({type(exc).__name__}: {exc}); "
                    "install the [megatron] extra (docs/testing.md)")
    return megatron.core


@contextlib.contextmanager
def cpu_patches():
    require()
    from megatron.core.tensor_parallel import random as mrandom
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch("torch.cuda.current_device", lambda: "cpu"))
        stack.enter_context(mock.patch("torch.cuda.synchronize", lambda *a, **k: None))
        tracker = mrandom.get_cuda_rng_tracker()
        stack.enter_context(mock.patch.object(tracker, "fork", lambda *a, **k: contextlib.nullcontext()))
        from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
        stack.enter_context(mock.patch.object(FileSystemWriterAsync, "write_preloaded_data_multiproc",
                                              staticmethod(_write_in_process)))
        yield


def _write_in_process(transform_list, use_msc, rank, write_buckets, global_results_queue) -> None:
    """megatron-core's multi-process bucket writer, one bucket after another in this process (see the module
    docstring): each bucket through its own `write_preloaded_data`, the results as the writer collects them."""
    import queue
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
    results: dict | Exception = {}
    for i, bucket in enumerate(write_buckets):
        local, count = queue.Queue(), queue.Queue()
        count.put(i)
        FileSystemWriterAsync.write_preloaded_data(transform_list, i, bucket, local, count, True, use_msc=use_msc)
        index, written = local.get()
        if isinstance(written, Exception):
            results = written
            break
        results[index] = written
    global_results_queue.put(results)


TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=160,
            vocab_size=128, seq_length=32, rotary_base=10000.0, norm_epsilon=1e-5)


def init_parallel(tp: int = 1, pp: int = 1, rank: int = 0, port: int | None = None):
    """Megatron's parallel state on an initialised gloo group of tp x pp ranks (one process: a one-rank group);
    os.environ is left alone (a MASTER_PORT set here would leak into later tests)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    if not dist.is_initialized():
        if port is None:
            from benchmarks.launch import free_port
            port = free_port()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp * pp)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tp, pp)
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    with cpu_patches(), mock.patch("torch.cuda.manual_seed", lambda *a: None), \
            mock.patch("torch.cuda.device_count", lambda: 0):
        try:
            model_parallel_cuda_manual_seed(1234)
        except Exception:
            pass


def build_model(shape: dict | None = None, seed: int = 0, tp: int = 1, pp: int = 1):
    """A LLaMA-shaped GPTModel (RMSNorm, SwiGLU, GQA, RoPE, untied, no bias; local spec), fp32, random weights."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    s = dict(TINY, **(shape or {}))
    config = TransformerConfig(
        num_layers=s["num_layers"], hidden_size=s["hidden_size"], num_attention_heads=s["num_attention_heads"],
        num_query_groups=s["num_query_groups"], ffn_hidden_size=s["ffn_hidden_size"], normalization="RMSNorm",
        layernorm_epsilon=s["norm_epsilon"], gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, add_qkv_bias=False, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        params_dtype=torch.float32, pipeline_dtype=torch.float32, init_method_std=0.02,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    torch.manual_seed(seed)   # every rank draws the same full weights, then keeps its shard
    from megatron.core import parallel_state
    pre_process = parallel_state.is_pipeline_first_stage() if pp > 1 else True
    post_process = parallel_state.is_pipeline_last_stage() if pp > 1 else True
    with cpu_patches():
        model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                         vocab_size=s["vocab_size"], max_sequence_length=s["seq_length"],
                         pre_process=pre_process, post_process=post_process,
                         share_embeddings_and_output_weights=False, position_embedding_type="rope",
                         rotary_base=s["rotary_base"])
    with torch.no_grad():   # the local RMSNorm starts at ones: make the norms non-trivial so a mix-up shows
        for name, param in model.named_parameters():
            if "norm" in name:   # the same on every rank that holds it: seeded by the name
                gen = torch.Generator().manual_seed(seed * 1000 + sum(map(ord, name)))
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
    return model.eval()


def causal_mask(seq: int) -> torch.Tensor:
    """Megatron's attention mask: True where a position may NOT attend, shaped [1, 1, s, s]."""
    return torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]


def forward(model, tokens: torch.Tensor) -> torch.Tensor:
    """Logits [batch, seq, vocab] of megatron-core's own forward, fp32."""
    batch, seq = tokens.shape
    position_ids = torch.arange(seq).unsqueeze(0).expand(batch, seq)
    with cpu_patches(), torch.no_grad():
        return model(tokens, position_ids, causal_mask(seq))


def megatron_args(shape: dict | None = None, **extra) -> argparse.Namespace:
    """The training args Megatron-LM records in common.pt (an argparse Namespace holding Megatron's enums and
    torch dtypes), for the fields a reader needs."""
    from megatron.core.transformer.enums import AttnBackend
    s = dict(TINY, **(shape or {}))
    fields = dict(num_layers=s["num_layers"], hidden_size=s["hidden_size"],
                  num_attention_heads=s["num_attention_heads"], num_query_groups=s["num_query_groups"],
                  group_query_attention=s["num_query_groups"] != s["num_attention_heads"],
                  ffn_hidden_size=s["ffn_hidden_size"], padded_vocab_size=s["vocab_size"],
                  seq_length=s["seq_length"], max_position_embeddings=s["seq_length"],
                  rotary_base=s["rotary_base"], norm_epsilon=s["norm_epsilon"], normalization="RMSNorm",
                  swiglu=True, add_bias_linear=False, add_qkv_bias=False, untie_embeddings_and_output_weights=True,
                  position_embedding_type="rope", num_experts=None, tensor_model_parallel_size=1,
                  pipeline_model_parallel_size=1, make_vocab_size_divisible_by=128, ckpt_format="torch_dist",
                  consumed_train_samples=0, iteration=0, attention_backend=AttnBackend.auto,
                  params_dtype=torch.float32)
    fields.update(extra)
    return argparse.Namespace(**fields)


def trained_optimizer(model, steps: int, global_batch: int, lr: float = 1e-3, min_lr: float = 1e-4,
                      warmup_iters: int = 2, decay_iters: int = 20, style: str = "cosine"):
    """(megatron-core's FP32Optimizer over torch AdamW after `steps` updates of seeded random gradients, its
    OptimizerParamScheduler stepped `steps` times as Megatron-LM's training steps it: by the global batch size,
    its warmup and decay in samples). FP32Optimizer makes its loss scale on "cuda": made on the CPU here."""
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import FP32Optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    adam = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(steps)
    for _ in range(steps):
        for param in model.parameters():
            param.grad = 0.01 * torch.randn(param.shape, generator=gen)
        adam.step()
    real = torch.tensor
    with mock.patch("torch.tensor", lambda *a, device=None, **k: real(*a, **k)):
        optimizer = FP32Optimizer(adam, OptimizerConfig(optimizer="adam", lr=lr), lambda *a: None)
    scheduler = OptimizerParamScheduler(adam, init_lr=0.0, max_lr=lr, min_lr=min_lr,
                                        lr_warmup_steps=warmup_iters * global_batch,
                                        lr_decay_steps=decay_iters * global_batch, lr_decay_style=style,
                                        start_wd=0.1, end_wd=0.1, wd_incr_steps=decay_iters * global_batch,
                                        wd_incr_style="constant")
    for _ in range(steps):
        scheduler.step(increment=global_batch)
    return optimizer, scheduler


def save_megatron(model, save_dir: str, iteration: int, args: argparse.Namespace | None = None,
                  optimizer=None, scheduler=None) -> str:
    """`model` saved as Megatron-LM's training saves it (checkpointing.py, torch_dist): save_dir/
    latest_checkpointed_iteration.txt and iter_%07d/ holding the DCP files, metadata.json and common.pt
    ({args, iteration, checkpoint_version 3.0, opt_param_scheduler, ...}); with `optimizer`, its
    sharded_state_dict under "optimizer" as Megatron's generate_state_dict puts it. Returns the iter directory."""
    from megatron.core import dist_checkpointing
    args = args or megatron_args()
    args.iteration = iteration
    path = os.path.join(save_dir, f"iter_{iteration:07d}")
    os.makedirs(path, exist_ok=True)
    model_state = model.sharded_state_dict(prefix="")
    state = {"model": model_state, "args": args, "iteration": iteration,
             "checkpoint_version": 3.0, "num_floating_point_operations_so_far": 0}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(model_state)
    if scheduler is not None:
        state["opt_param_scheduler"] = scheduler.state_dict()
    with cpu_patches():
        dist_checkpointing.save(state, path, sharded_strategy=("torch_dist", 1))
    import torch.distributed as dist
    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt"), "w") as fh:
            fh.write(str(iteration))
    return path


def save_megatron_legacy(model, save_dir: str, iteration: int, tp: int = 1, pp: int = 1,
                         args: argparse.Namespace | None = None) -> str:
    """`model` saved as Megatron-LM's `--ckpt-format torch` saves it at tp x pp: iter_%07d/mp_rank_{t:02d}
    [_{p:03d}]/model_optim_rng.pt, each {model: its rank's state dict (stage-local layer numbers, TP shards:
    linear_qkv by query groups, linear_fc1 as the rank's [gate_r; up_r], linear_proj / linear_fc2 by columns,
    the vocabulary by rows), args, iteration, checkpoint_version}. Returns the iter directory."""
    args = args or megatron_args(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, ckpt_format="torch")
    full, per_stage = model.state_dict(), model.config.num_layers // pp
    path = os.path.join(save_dir, f"iter_{iteration:07d}")
    for t in range(tp):
        for p in range(pp):
            state = {}
            for key, tensor in full.items():
                if key.startswith("decoder.layers."):
                    head, _, tail = key[len("decoder.layers."):].partition(".")
                    if int(head) // per_stage != p:
                        continue
                    key = f"decoder.layers.{int(head) - p * per_stage}.{tail}"
                elif key.startswith("embedding.") and p != 0 or key.startswith(("decoder.final", "output")) \
                        and p != pp - 1:
                    continue
                state[key] = _tp_shard(key, tensor, t, tp)
            name = f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "")
            os.makedirs(os.path.join(path, name))
            torch.save({"model": state, "args": args, "iteration": iteration, "checkpoint_version": 3.0},
                       os.path.join(path, name, "model_optim_rng.pt"))
    with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write(str(iteration))
    return path


def _tp_shard(key: str, tensor, t: int, tp: int):
    if not isinstance(tensor, torch.Tensor) or tp == 1:
        return tensor
    if key.endswith("linear_fc1.weight"):
        gate, up = tensor.chunk(2)
        return torch.cat([gate.chunk(tp)[t], up.chunk(tp)[t]]).clone()
    if key.endswith(("linear_qkv.weight", "word_embeddings.weight", "output_layer.weight")):
        return tensor.chunk(tp)[t].clone()
    if key.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return tensor.chunk(tp, dim=1)[t].clone()
    return tensor.clone()


def save_parallel_worker(rank: int, tp: int, pp: int, save_dir: str, port: int, seed: int) -> None:
    """One of tp x pp gloo processes: build its shard of the GPTModel and save it with the others, as
    Megatron-LM's training does (torch.multiprocessing.spawn target)."""
    import warnings
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    init_parallel(tp, pp, rank, port)
    model = build_model(seed=seed, tp=tp, pp=pp)
    save_megatron(model, save_dir, 3, megatron_args(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp))
    import torch.distributed as dist
    dist.barrier()
    dist.destroy_process_group()
