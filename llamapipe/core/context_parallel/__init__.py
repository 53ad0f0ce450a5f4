"""Context parallelism: the sequence split over CP ranks (causal load balance) and the attention that spans it."""
from llamapipe.core.context_parallel.attention import COMM_TYPES, context_parallel_attention
from llamapipe.core.context_parallel.sharding import (SequenceShard, chunk_ids, local_positions, shard_sequence,
                                                      unshard_sequence)

__all__ = ["COMM_TYPES", "SequenceShard", "context_parallel_attention", "chunk_ids", "local_positions",
           "shard_sequence", "unshard_sequence"]
