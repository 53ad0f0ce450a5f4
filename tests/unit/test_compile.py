"""--compile (llamapipe/model/compile.py): a compiled chunk keeps the zero-bubble B/W split and computes the
eager chunk's gradients; eager runs never import TorchDynamo; a missing C++ compiler is reported before
training. The end-to-end losses are compared in tests/e2e/test_compile.py."""
import copy
import subprocess
import sys

import pytest
import torch

from llamapipe.core.tensor_parallel.weight_grad_store import WeightGradStore
from llamapipe.model.llama import LlamaConfig, LlamaModel
from tests.harness import ROOT

TINY = LlamaConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                   vocab_size=128, max_position_embeddings=32)
LINEAR_CALLS_PER_LAYER = 4   # q/k/v, o, gate/up, down: each defers one closure


def _is_linear_weight(name: str) -> bool:
    return "proj" in name or name == "output.weight"


@pytest.mark.slow   # compiles (tens of seconds on two cores with a cold inductor cache)
@pytest.mark.parametrize("recompute", [None, "selective", "full"])
def test_compiled_chunk_defers_weight_grads_to_w_and_matches_eager(recompute):
    from llamapipe.model.compile import compile_chunks
    eager = LlamaModel(TINY.replace(recompute_granularity=recompute), seed=7)
    compiled = copy.deepcopy(eager)
    compile_chunks([compiled], micro_batch_size=2, seq_length=16)
    assert all(p.grad is None for p in compiled.parameters()), "the warm-up leaves no gradient behind"
    ids = torch.randint(0, TINY.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    inputs, labels = ids[:, :-1], ids[:, 1:]
    eager(inputs, labels=labels).sum().backward()

    store = WeightGradStore()
    with store.active():                                    # F, as the executor runs it
        loss = compiled(inputs, labels=labels).sum()
    with store.capture("mb0"):                              # B: input gradients only
        loss.backward()
    grads = dict(compiled.named_parameters())
    assert store.queued(grads["layers.0.mlp.down_proj.weight"]) == 1
    assert sum(1 for _ in store.held_tensors("mb0")) > 0, "W's inputs are held until W"
    for name, param in grads.items():
        if _is_linear_weight(name):
            assert param.grad is None, f"{name}: weight gradient computed at B, not deferred to W"
        else:
            assert param.grad is not None, f"{name}: small parameters get their gradient at B"
    assert store.run("mb0") == TINY.num_layers * LINEAR_CALLS_PER_LAYER + 1   # + the output layer
    store.assert_empty()
    for name, param in eager.named_parameters():
        torch.testing.assert_close(grads[name].grad, param.grad, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{name} (compiled vs eager): {m}")


@pytest.mark.slow
def test_executor_runs_compiled_weight_grads_at_w():
    """A zero-bubble order on one rank, F0 B0 F1 B1 W0 W1, through the executor: when F1 runs, B0 has given
    the norms their gradients but no linear weight has one yet; after W1 every gradient equals eager's."""
    from llamapipe.core.parallel_state import ParallelState
    from llamapipe.core.pipeline_parallel import executor
    from llamapipe.core.pipeline_parallel.schedule_ir import Action, Plan
    from llamapipe.model.compile import compile_chunks
    eager = LlamaModel(TINY, seed=7)
    compiled = copy.deepcopy(eager)
    compile_chunks([compiled], micro_batch_size=2, seq_length=16)
    ids = torch.randint(0, TINY.vocab_size, (2, 2, 17), generator=torch.Generator().manual_seed(0))
    for mb in ids:
        eager(mb[:, :-1], labels=mb[:, 1:]).sum().backward()
    seen = []

    def forward_step(data_iterator, model):
        seen.append({name: p.grad is not None for name, p in model.named_parameters()})
        mb = next(data_iterator)
        out = model(mb[:, :-1], labels=mb[:, 1:])
        return out, lambda o: (o.sum(), torch.tensor(float(o.numel())), {})

    kinds = [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("W", 0), ("W", 1)]
    plan = Plan("f-b-f-b-w-w", 1, 1, 2, "interleaved", (tuple(Action(k, 0, mb) for k, mb in kinds),))
    executor.run(plan, model_chunks=[compiled], forward_step_func=forward_step, data_iterator=iter(ids),
                 parallel_state=ParallelState(), num_microbatches=2)
    at_f1 = seen[1]
    assert not any(has for name, has in at_f1.items() if _is_linear_weight(name)), "a weight grad ran before W"
    assert all(has for name, has in at_f1.items() if not _is_linear_weight(name))
    for name, param in compiled.named_parameters():
        torch.testing.assert_close(param.grad, dict(eager.named_parameters())[name].grad, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{name} (compiled vs eager): {m}")


def test_eager_runs_never_import_torchdynamo():
    """The graph breaks are registered lazily, so a run without --compile skips TorchDynamo's import."""
    code = ("import sys, torch; from llamapipe.model.llama import LlamaConfig, LlamaModel; "
            "m = LlamaModel(LlamaConfig(num_layers=1, hidden_size=32, ffn_hidden_size=64)); "
            "m(torch.zeros(1, 8, dtype=torch.long), labels=torch.zeros(1, 8, dtype=torch.long)).sum().backward(); "
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


def test_missing_cpu_compiler_is_one_sentence(monkeypatch, tmp_path):
    from llamapipe.model.compile import check_compiler
    monkeypatch.setenv("PATH", str(tmp_path))               # an empty directory: no g++, no clang++
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(SystemExit, match=r"^--compile on CPU needs a C\+\+ compiler .* none was found$"):
        check_compiler(torch.device("cpu"))
