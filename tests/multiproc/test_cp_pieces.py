"""Seq1F1B piece attention under ring context parallelism (model/piece_attention.cached_piece_attention,
core/context_parallel/ring_pieces.py) on 2 gloo ranks against causal SDPA over the whole sequence on one rank: three
uneven pieces' forwards in order (the last one's ring message carries two earlier pieces), their backwards in
reverse (later pieces' key/value gradients reach the earlier pieces through the cache), then the outputs and q/k/v
gradients, unsharded and concatenated over the pieces, equal the reference's (fp32, rel/abs 1e-5). Cases: p2p at
cp 2 with GQA, with and without packed documents (then the reference is `document_attention`), and a2a+p2p with
levels 1 x 2 (the ring over the p2p level's SubGroup). The model-level runs against one process, a2a+p2p at
cp 4 = 2 x 2 among them, are in test_seq1f1b_compose.py.
"""
import pytest
import torch
import torch.nn.functional as F

from llamapipe.core.context_parallel import shard_sequence, unshard_sequence
from llamapipe.core.document_attention import document_attention
from tests.harness import run_distributed

pytestmark = pytest.mark.slow
B, HEADS, GROUPS, S, D = 2, 4, 2, 48, 8
BOUNDS = (0, 16, 24, 48)          # three uneven pieces, each a multiple of 2 x cp = 4 tokens
# (name, comm type, packed documents)
CASES = [("p2p", "p2p", False), ("p2p docs", "p2p", True), ("a2a+p2p 1x2 docs", "a2a+p2p", True)]


def _inputs() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(3)
    q, dout = (torch.randn(B, HEADS, S, D, generator=g) for _ in range(2))
    k, v = (torch.randn(B, GROUPS, S, D, generator=g) for _ in range(2))
    return q, k, v, dout


def _documents() -> torch.Tensor:
    """Document ids (b, s): boundaries inside pieces and chunks, one document across a piece boundary."""
    ids = torch.zeros(B, S, dtype=torch.long)
    ids[0, 5:], ids[0, 19:], ids[0, 30:] = 1, 2, 3
    ids[1, 13:] = 1
    return ids


def _reference(documents: bool) -> list[torch.Tensor]:
    q, k, v, dout = (t.requires_grad_(i < 3) for i, t in enumerate(_inputs()))
    if documents:
        out = document_attention(q, k, v, _documents())
    else:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]


def _pieces(group, comm: str, cp: int, cp_rank: int, documents: bool) -> list[list[torch.Tensor]]:
    """[out, dq, dk, dv] of this rank's shard of each piece."""
    from llamapipe.core.pipeline_parallel.seq_split import Piece
    from llamapipe.model.piece_attention import PieceKVCache, cached_piece_attention
    cache, count, pieces = PieceKVCache(), len(BOUNDS) - 1, []
    for index, (a, b) in enumerate(zip(BOUNDS, BOUNDS[1:])):
        q, k, v, dout = (shard_sequence(t[:, :, a:b], 2, cp, cp_rank).requires_grad_(i < 3)
                         for i, t in enumerate(_inputs()))
        docs = _documents()[:, :b] if documents else None
        out = cached_piece_attention(cache, Piece(0, index, count), q, k, v, group, True, docs, comm)
        pieces.append((out, dout, q, k, v))
    for out, dout, *_ in reversed(pieces):
        out.backward(dout)
    return [[out.detach(), q.grad, k.grad, v.grad] for out, _, q, k, v in pieces]


def _worker(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from llamapipe.core.context_parallel.ulysses import UlyssesGroup
    return {name: _pieces(UlyssesGroup(dist.group.WORLD, 1) if comm == "a2a+p2p" else dist.group.WORLD, comm, world,
                          rank, documents) for name, comm, documents in CASES}


def test_cp_piece_attention_matches_full_sdpa() -> None:
    ranks = run_distributed(_worker, 2, timeout=240)
    for name, _, documents in CASES:
        reference = _reference(documents)
        for i, what in enumerate(("out", "dq", "dk", "dv")):
            got = torch.cat([unshard_sequence([r[name][p][i] for r in ranks], dim=2) for p in range(len(BOUNDS) - 1)],
                            dim=2)
            torch.testing.assert_close(got, reference[i], rtol=1e-5, atol=1e-5, msg=f"{name}: {what}")
