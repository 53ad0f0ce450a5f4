"""Tensor and sequence parallelism: comm ops, parallel layers, vocab-parallel loss, RNG tracker."""
from llamapipe.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from llamapipe.core.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                         allreduce_sequence_parallel_grads, gather_logical_tensor,
                                         shard_logical_tensor)
from llamapipe.core.tensor_parallel.random import get_rng_tracker, model_parallel_seed

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
           "allreduce_sequence_parallel_grads", "gather_logical_tensor", "shard_logical_tensor",
           "get_rng_tracker", "model_parallel_seed"]
