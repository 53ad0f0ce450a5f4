"""`--compile`: torch.compile (inductor, static shapes) per decoder layer and for the final norm, under every
pipeline schedule, recompute setting and tensor/sequence parallelism.

Granularity is torchtitan's: each `DecoderLayer` is compiled in place (`nn.Module.compile`, so parameter
names and checkpoints do not change). Identical layers share their compiled code, so a chunk compiles once,
not once per layer. On the last stage the final norm is compiled too; the loss itself stays the hand-written
vocab-parallel cross entropy, which measured faster on CPU than inductor's fused logsumexp
(core/tensor_parallel/cross_entropy.py).

The zero-bubble B/W split survives compilation because the parallel linear layers are graph breaks
(`core.tensor_parallel.graph_breaks`): each linear call runs eagerly through `LinearWithDeferredWeightGrad`,
whose backward computes only the input gradient and leaves the weight-gradient GEMM in the step's
`WeightGradStore` until W. What inductor compiles is what lies between the linear layers: RMSNorm with the
residual add before it, RoPE and attention (SDPA), SiLU-and-multiply, forward and backward. A decoder layer
thus becomes five compiled graphs around four eager GEMM groups (q/k/v, o, gate/up, down); the
tensor-parallel collectives sit inside those breaks. Under --recompute-granularity full the recompute
wraps the compiled layer; under selective recompute TorchDynamo traces the checkpointed attention core.

Compilation happens before training, on one dummy microbatch per chunk (`compile_chunks`), so the first
iteration does not pay for it, and its seconds are logged once per process. Inductor caches compiled kernels
on disk (/tmp/torchinductor_$USER), so a second process with the same shapes compiles in seconds.
"""
from __future__ import annotations

import os
import shutil
import sys
import time

import torch
from torch import nn

from llamapipe.core.logger import get_logger
from llamapipe.core.tensor_parallel.graph_breaks import enable_graph_breaks

COMPILE_OPTIONS = dict(backend="inductor", dynamic=False)


def check_compiler(device: torch.device) -> None:
    """Exit with one sentence when this platform cannot run inductor on `device` (before any training)."""
    import torch._dynamo
    if not torch._dynamo.is_dynamo_supported():
        raise SystemExit(f"--compile: torch.compile does not support this platform (Python "
                         f"{sys.version_info.major}.{sys.version_info.minor}, torch {torch.__version__})")
    if device.type == "cuda":
        from torch.utils._triton import has_triton
        if not has_triton():
            raise SystemExit("--compile on CUDA needs triton for inductor's GPU kernels, and it is not importable")
        return
    from torch._inductor import config as inductor_config
    names = [os.environ.get("CXX"), *inductor_config.cpp.cxx]
    if not any(name and shutil.which(name) for name in names):
        raise SystemExit("--compile on CPU needs a C++ compiler for inductor's kernels (g++ or clang++ on PATH, "
                         "or $CXX), and none was found")


def compile_chunk(chunk: nn.Module) -> None:
    """Compile each decoder layer of a `LlamaModel` chunk and, on the last stage, its final norm, in place."""
    enable_graph_breaks()
    for layer in chunk.layers.values():
        layer.compile(**COMPILE_OPTIONS)
    if chunk.post_process:
        chunk.final_norm.compile(**COMPILE_OPTIONS)


def compile_chunks(chunks: list[nn.Module], *, micro_batch_size: int, seq_length: int, eval_too: bool = False,
                   positions: bool = False, documents: bool = False) -> float:
    """Compile `chunks` and run one dummy microbatch through each (forward and backward; also a no-grad
    forward when `eval_too`) so compilation is paid now; returns and logs its seconds. `positions` and
    `documents`: the microbatches carry position ids and document ids (packed documents), so the dummy one does
    too. Parameters are untouched and gradients are left as None."""
    start = time.perf_counter()
    inputs = dict(positions=positions, documents=documents)
    for chunk in chunks:
        compile_chunk(chunk)
        _warm_up(chunk, micro_batch_size, seq_length, grad=True, **inputs)
        if eval_too:
            with torch.no_grad():
                _warm_up(chunk, micro_batch_size, seq_length, grad=False, **inputs)
        chunk.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - start
    layers = sum(len(chunk.layers) for chunk in chunks)
    get_logger().info(f"--compile: compiled {layers} decoder layers (inductor, microbatch "
                      f"{micro_batch_size} x {seq_length}) in {seconds:.1f} s")
    return seconds


def _warm_up(chunk: nn.Module, micro_batch_size: int, seq_length: int, *, grad: bool, positions: bool,
             documents: bool) -> None:
    """One forward (and backward when `grad`) of a dummy microbatch of `seq_length` tokens (the whole sequence),
    shaped as the executor feeds the chunk: two documents of half the sequence each when `documents`."""
    param = next(chunk.parameters())
    generator = torch.Generator().manual_seed(0)   # leaves the global RNG streams alone
    ids = torch.randint(0, chunk.config.vocab_size, (micro_batch_size, seq_length), generator=generator)
    ids = ids.to(param.device)
    if not chunk.pre_process:   # the previous stage's output: this CP rank's tokens, split over TP under SP
        local_seq = seq_length // chunk.sequence_shard.cp_size // (chunk.tp_size if chunk.sequence_parallel else 1)
        hidden = torch.randn(local_seq, micro_batch_size, chunk.config.hidden_size, generator=generator)
        chunk.set_input_tensor(hidden.to(param.device, param.dtype).requires_grad_(grad))
    index = torch.arange(seq_length, device=param.device).expand(micro_batch_size, -1)
    extra = dict(position_ids=index % (seq_length // 2) if positions else None,
                 document_ids=index // (seq_length // 2) if documents else None)
    out = chunk(input_ids=ids if chunk.pre_process else None, labels=ids if chunk.post_process else None, **extra)
    if grad:
        out.float().sum().backward()
    chunk.set_input_tensor(None)
