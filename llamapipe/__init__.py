"""llamapipe: Megatron-style LLaMA pretraining with tensor, sequence, pipeline, virtual-pipeline and data
parallelism and zero-bubble pipeline schedules.

Layout (as Megatron-LM's): `llamapipe.core` is the library (parallel_state, tensor_parallel,
pipeline_parallel, distributed, optimizer), `llamapipe.training` the application (arguments, loop,
checkpointing, logging), plus `llamapipe.model`, `llamapipe.data` and the command-line `llamapipe.tools`.
"""
__version__ = "0.2.0"
