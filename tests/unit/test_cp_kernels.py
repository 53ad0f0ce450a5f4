"""Context-parallel attention on one process: the block plan, the plain-matmul kernel against aten's CPU
FlashAttention, the cp 1 path and the refusals."""
import pytest
import torch
import torch.nn.functional as F

from llamapipe.core.context_parallel import context_parallel_attention
from llamapipe.core.context_parallel.blocks import attention_blocks
from llamapipe.core.context_parallel.kernels import attend, attend_backward, attend_math, attend_math_backward
from llamapipe.training.flag_names import worded_as_flags


def test_ring_blocks_by_global_chunk():
    """cp 4, rank 1 holds chunks (1, 6): its own block is one causal call; a lower rank's block (0, 7) is
    attended fully by both local chunks against its head; a higher rank's (2, 5) only by the tail, fully."""
    assert attention_blocks((1, 6), (1, 6)) == [(0, 2, 0, 2, True)]
    assert attention_blocks((1, 6), (0, 7)) == [(0, 2, 0, 1, False)]
    assert attention_blocks((1, 6), (2, 5)) == [(1, 2, 0, 2, False)]


def test_allgather_blocks_attend_the_prefix():
    """All 8 chunks of cp 4 in global order: chunk 1 sees chunk 0 fully and itself causally; chunk 6 sees
    chunks 0-5 fully and itself causally."""
    assert attention_blocks((1, 6), range(8)) == [(0, 1, 0, 1, False), (0, 1, 1, 2, True),
                                                  (1, 2, 0, 6, False), (1, 2, 6, 7, True)]
    assert attention_blocks((0, 7), range(8))[0] == (0, 1, 0, 1, True)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_math_kernel_matches_cpu_flash(causal, groups):
    """Output, log-sum-exp and the gradients given the global out/lse: plain matmuls vs aten's CPU kernel vs
    autograd through SDPA (fp32, 1e-5)."""
    g = torch.Generator().manual_seed(groups)
    q = torch.randn(2, 4, 6, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(2, groups, 6, 8, generator=g, requires_grad=True) for _ in range(2))
    dout = torch.randn(2, 4, 6, 8, generator=g)
    out, lse = attend(q, k, v, causal, 0.3)
    out_m, lse_m = attend_math(q, k, v, causal, 0.3)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.3, enable_gqa=groups != 4)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out_m, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse_m, lse, rtol=1e-5, atol=1e-5)
    for grads in (attend_backward(dout, q, k, v, out, lse, causal, 0.3),
                  attend_math_backward(dout, q, k, v, out, lse, causal, 0.3)):
        for name, got, want in zip("qkv", grads, ref_grads):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)


def test_cp1_is_causal_sdpa_and_an_unknown_comm_type_is_refused():
    q, k, v = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(context_parallel_attention(q, k, v, None), want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="--cp-comm-type ulysses is not one of p2p, allgather, a2a, a2a"), \
            worded_as_flags():
        context_parallel_attention(q, k, v, None, "ulysses")


@pytest.mark.parametrize("a2a,p2p", [(2, 1), (4, 1), (2, 2), (2, 3), (3, 2)])
def test_what_an_a2a_level_gathers_is_the_balanced_layout_of_the_p2p_level(a2a, p2p):
    """a2a+p2p (ulysses.py): CP ranks p * A + i, i < A, gather (in their load-balanced order) exactly the tokens
    CP rank p of a group of P holds; with P 1, the whole sequence in global order."""
    from llamapipe.core.context_parallel import local_positions, unshard_sequence
    s = 2 * a2a * p2p * 3
    for p in range(p2p):
        gathered = unshard_sequence([local_positions(s, a2a * p2p, p * a2a + i) for i in range(a2a)], dim=0)
        assert gathered.tolist() == local_positions(s, p2p, p).tolist()
