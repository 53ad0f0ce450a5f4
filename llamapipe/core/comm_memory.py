"""The communication buffers a rank holds beside its activations: one model of them for `llamapipe plan` and
`llamapipe dry-run`.

The dry run (training/dry_run/rank.py) feeds it what it measured on the real shards: the largest message each
pipeline peer sent, the parameters in the model's order, ZeRO-1's padded flat shard. The planner
(tools/comm_estimate.py) feeds it the same quantities from the model's shape and the layout, so both count the
same buffers in the same way:

- pipeline receives posted ahead: `LOOKAHEAD` per peer, each the size of that peer's largest message
  (`P2PCommunicator`);
- the data-parallel gradient reduction's flat fp32 buckets (`grad_reduce.bucket_groups`): one at a time, all at
  once when the reduction overlaps the backward (--overlap-grad-reduce); under ZeRO-2/3, FSDP's gathered weights
  instead (every unit's under ZeRO-2, which keeps them from forward to backward; two units' under ZeRO-3: the one
  running and the one prefetched);
- ZeRO-1's all-gather of the updated parameters: the whole padded flat shard of the model, in the parameters'
  dtype (Megatron's distributed optimizer);
- under --cp-comm-type a2a / a2a+p2p, the all-to-all buffers of one attention (core/context_parallel/ulysses.py).
"""
from __future__ import annotations

import inspect
from typing import Iterable, Sequence

from llamapipe.core.distributed.grad_reduce import bucket_groups
from llamapipe.core.pipeline_parallel.p2p_communication import P2PCommunicator

LOOKAHEAD = inspect.signature(P2PCommunicator).parameters["lookahead"].default   # receives posted per peer
BUCKET_BYTES = 4            # the reduction's flat buckets are fp32 (or wider: fp32 parameters are fp32 too)


def p2p_receive_bytes(largest_from_peers: Iterable[int]) -> int:
    """Receives posted ahead: `LOOKAHEAD` per pipeline peer, each its largest message in bytes."""
    return LOOKAHEAD * sum(largest_from_peers)


def grad_bucket_bytes(numels: Sequence[int], bucket_size: int, overlap: bool) -> int:
    """The flat fp32 buckets of a rank whose parameters hold `numels` elements (in the model's order, one dtype):
    the largest one, or all of them when the reduction overlaps the backward."""
    buckets = [BUCKET_BYTES * sum(bucket) for bucket in bucket_groups(list(numels), bucket_size,
                                                                       dtype_of=lambda n: None, numel_of=int)]
    return sum(buckets) if overlap else max(buckets, default=0)


def fsdp_gather_bytes(unit_bytes: Sequence[int], strategy: str) -> int:
    """FSDP's gathered weights of units holding `unit_bytes` each: all of them under ZeRO-2 ("optim_grads"), the
    running and the prefetched one under ZeRO-3."""
    return sum(unit_bytes) if strategy == "optim_grads" else 2 * max(unit_bytes, default=0)


def a2a_buffer_bytes(tokens: int, heads: int, groups: int, head_dim: int, itemsize: int) -> int:
    """a2a context parallelism: q, k and v of this rank's `tokens` tokens (micro-batch included) for its `heads`
    query heads and `groups` query groups (per TP rank) as packed to send and as received, live together while
    one attention's all-to-alls run (the output's two buffers, after attention, are smaller)."""
    return 2 * tokens * (heads + 2 * groups) * head_dim * itemsize


def zero1_gather_bytes(padded_total: int, itemsize: int) -> int:
    """ZeRO-1's all-gather of the updated parameters: the padded flat model shard (`padded_total` elements)."""
    return padded_total * itemsize
