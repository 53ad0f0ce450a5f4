"""The blocks of causal attention over context-parallel chunks, shared by ring, all-gather and Seq1F1B pieces
(attention.py, pieces.py): which local query chunks attend which key chunks (`attention_blocks`), each block's
kernel call merged into running fp32 outputs by log-sum-exp and its backward, packed documents' masks per
block, and the all-gather of keys/values over the CP group."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from llamapipe.core.context_parallel.kernels import attend, attend_backward
from llamapipe.core.context_parallel.sharding import local_positions, unshard_sequence
from llamapipe.core.document_attention import same_document
from llamapipe.core.pipeline_parallel.position import waiting

Block = tuple[int, int, int, int, bool]   # query chunks [q0, q1), key chunks [k0, k1), causal diagonal?
Docs = Optional[tuple[torch.Tensor, torch.Tensor]]   # document ids (b, s_q) of the local queries, (b, s_k) of the keys


def attention_blocks(q_chunks: Sequence[int], k_chunks: Sequence[int]) -> list[Block]:
    """The kernel calls that cover causal attention of local query chunks to a set of key chunks.

    Chunks are given by global index, each list in increasing order. Query chunk i attends key chunk j fully
    when j < i, causally when j == i, not at all when j > i. Identical lists are one causal call; otherwise
    each diagonal pair is a causal call and the full pairs of neighbouring query chunks that attend the same
    (contiguous) key chunks share one call."""
    q_chunks, k_chunks = list(q_chunks), list(k_chunks)
    assert q_chunks == sorted(q_chunks) and k_chunks == sorted(k_chunks)
    if q_chunks == k_chunks:
        return [(0, len(q_chunks), 0, len(k_chunks), True)]
    blocks: list[Block] = []
    for i, qc in enumerate(q_chunks):
        full = [j for j, kc in enumerate(k_chunks) if kc < qc]
        if full:
            assert full == list(range(full[0], full[-1] + 1)), "full key chunks must be contiguous"
            last = blocks[-1] if blocks else None
            if last and not last[4] and last[1] == i and last[2:4] == (full[0], full[-1] + 1):
                blocks[-1] = (last[0], i + 1, last[2], last[3], False)
            else:
                blocks.append((i, i + 1, full[0], full[-1] + 1, False))
        blocks += [(i, i + 1, j, j + 1, True) for j, kc in enumerate(k_chunks) if kc == qc]
    return blocks


def allowed_pairs(docs: Docs, rows: slice, cols: slice, causal: bool) -> tuple[bool, Optional[torch.Tensor]]:
    """(whether the block has any pair to attend, its document mask or None without documents)."""
    if docs is None:
        return True, None
    allowed = same_document(docs[0][:, rows], docs[1][:, cols], causal)
    return bool(allowed.any()), allowed


def forward_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: list[Block], chunk: int,
                    scale: float, out: torch.Tensor, lse: torch.Tensor, docs: Docs) -> None:
    """Attend q's rows to k/v per block; merge into the running fp32 `out` and `lse` by log-sum-exp."""
    for q0, q1, k0, k1, causal in blocks:
        rows, cols = slice(q0 * chunk, q1 * chunk), slice(k0 * chunk, k1 * chunk)
        any_pair, allowed = allowed_pairs(docs, rows, cols, causal)
        if not any_pair:
            continue
        block_out, block_lse = attend(q[:, :, rows], k[:, :, cols], v[:, :, cols], causal, scale, allowed)
        old_out, old_lse = out[:, :, rows], lse[:, :, rows]
        new_lse = torch.logaddexp(old_lse, block_lse)
        # a row that has attended no key yet (documents) keeps lse -inf: weigh by 0, not by exp(-inf + inf)
        finite = new_lse.masked_fill(new_lse == float("-inf"), 0.0)
        old_out.mul_((old_lse - finite).exp_().unsqueeze(-1))
        old_out.add_(block_out.float() * (block_lse - finite).exp_().unsqueeze(-1))
        old_lse.copy_(new_lse)


def backward_blocks(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     lse: torch.Tensor, blocks: list[Block], chunk: int, scale: float, dq: torch.Tensor,
                     dkv: torch.Tensor, docs: Docs) -> None:
    """Add each block's gradients into the fp32 `dq` (like q) and `dkv` (2, like k): global out and lse."""
    for q0, q1, k0, k1, causal in blocks:
        rows, cols = slice(q0 * chunk, q1 * chunk), slice(k0 * chunk, k1 * chunk)
        any_pair, allowed = allowed_pairs(docs, rows, cols, causal)
        if not any_pair:
            continue
        dq_b, dk_b, dv_b = attend_backward(dout[:, :, rows], q[:, :, rows], k[:, :, cols], v[:, :, cols],
                                           out[:, :, rows], lse[:, :, rows], causal, scale, allowed)
        dq[:, :, rows] += dq_b
        dkv[0][:, :, cols] += dk_b
        dkv[1][:, :, cols] += dv_b


def accumulators(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero fp32 output and -inf log-sum-exp for q's rows. The output is (b, heads, s, d) stored sequence-first,
    (s, b, heads, d) in memory, so the model's (s, b, heads * d) view of it needs no copy (the saved output is
    then the o projection's saved input too, as with SDPA's CPU kernel)."""
    b, heads, s, d = q.shape
    out = torch.zeros((s, b, heads, d), dtype=torch.float32, device=q.device).permute(1, 2, 0, 3)
    return out, torch.full((b, heads, s), float("-inf"), dtype=torch.float32, device=q.device)


def docs_of(documents: Optional[torch.Tensor], cp_size: int, q_rank: int, k_rank: Optional[int]) -> Docs:
    """The document ids of CP rank q_rank's queries and of CP rank k_rank's keys (None: the whole sequence)."""
    if documents is None:
        return None
    s = documents.shape[1]
    mine = documents[:, local_positions(s, cp_size, q_rank).to(documents.device)]
    keys = documents if k_rank is None else documents[:, local_positions(s, cp_size, k_rank).to(documents.device)]
    return mine, keys


def gather_kv(kv: torch.Tensor, group: Any) -> torch.Tensor:
    """(2, b, groups, s_local, d) on each rank -> (2, b, groups, s, d) in global sequence order."""
    parts = [torch.empty_like(kv) for _ in range(dist.get_world_size(group))]
    with waiting("the context-parallel all-gather of keys/values", dist.get_process_group_ranks(group),
                 collective=True):      # a hang report names the CP ranks that did not join it
        dist.all_gather(parts, kv, group=group)
    return unshard_sequence(parts, dim=3)
