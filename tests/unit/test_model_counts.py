"""llamapipe.model.llama.counts, the one formula for parameters and FLOPs per token, against a hand computation and
against the built model; the log line, the planner and the memory check use it."""
import pytest

from llamapipe.core.parallel_state import ParallelState
from llamapipe.model.llama import LlamaConfig, counts

# head dim 12 from --kv-channels (not hidden 32 / heads 4 = 8), GQA (2 groups), vocabulary 250 padded to 256
SMALL = LlamaConfig(num_layers=3, hidden_size=32, ffn_hidden_size=40, num_attention_heads=4, num_query_groups=2,
                    kv_channels=12, vocab_size=250, max_position_embeddings=64)


def _hand_flops_per_token(seq: int, passes: int) -> int:
    """SMALL's FLOPs per token written out matrix by matrix (2 FLOPs per multiply-add)."""
    matrices = {"q": 32 * 48, "k": 32 * 24, "v": 32 * 24, "o": 48 * 32, "gate": 32 * 40, "up": 32 * 40,
                "down": 40 * 32}
    per_layer = 2 * sum(matrices.values()) + 2 * (seq * 48) + 2 * (seq * 48)    # + QK^T and AV over 4 x 12 dims
    output_layer = 2 * 32 * 256                                                  # padded rows, not 250
    return passes * (3 * per_layer + output_layer)


def test_flops_per_token_against_a_hand_computation():
    assert counts.flops_per_token(SMALL, 16) == _hand_flops_per_token(16, passes=3) == 228_864
    assert counts.flops_per_token(SMALL, 16, full_recompute=True) == _hand_flops_per_token(16, passes=4)
    # tp 4 pads the vocabulary to a multiple of 128 x 4 = 512 rows: 256 more output-layer rows, x 2 x 3
    assert counts.flops_per_token(SMALL, 16, tp=4) - counts.flops_per_token(SMALL, 16) == 3 * 2 * 32 * 256


@pytest.mark.parametrize("tie", [False, True])
def test_parameter_count_is_the_built_models(tie):
    from llamapipe.model.llama import LlamaModel
    m = SMALL.replace(tie_word_embeddings=tie)
    built = LlamaModel(m, ParallelState(), seed=1)
    assert counts.model_parameters(m) == sum(p.numel() for p in built.parameters())
    layer = built.layers["0"]
    assert counts.layer_parameters(m) == sum(p.numel() for p in layer.parameters())
    assert counts.layer_matmul_parameters(m) == sum(p.numel() for p in layer.parameters() if p.dim() == 2)


def test_llama2_7b_parameter_count_is_metas():
    assert counts.model_parameters(LlamaConfig.from_name("llama2-7b")) == 6_738_415_616


def test_log_line_planner_and_memory_check_import_the_one_formula():
    from llamapipe.tools import parallel_estimate
    from llamapipe.training import log
    from llamapipe.training.arguments import memory
    from llamapipe.model import families
    assert log.flops_per_token is families.flops_per_token          # dispatches to the config's family
    assert families.FAMILIES["llama"].flops_per_token is counts.flops_per_token
    assert parallel_estimate.flops_per_token is families.flops_per_token
    assert memory.model_parameters is families.model_parameters
    assert families.FAMILIES["llama"].parameters is counts.model_parameters
