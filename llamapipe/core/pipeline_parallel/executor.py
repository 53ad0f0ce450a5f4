"""The one interpreter that runs any pipeline plan on real model chunks (docs/design.md section 3).

`run(plan, ...)` executes this rank's `plan.actions[pp_rank]` in order: F (forward, send the output),
B (input-gradient backward with weight gradients deferred into the step's `WeightGradStore`, send the
input gradient), W (run the deferred weight gradients), BW (both; a BW that sends runs B, sends, then runs W,
so the upstream rank waits one W less: the simulator's `early_send`). Every transfer is derived from the
plan by `p2p_communication`; a hop between two chunks of one rank (ZB-V, arXiv 2401.10241) is a local hand-off.
After an output is sent its data is freed and only its graph kept (Megatron-LM's deallocate-output
trick, arXiv 2104.04473); backward then runs through the autograd engine directly to skip the shape check.

Vocabulary parallelism (arXiv 2411.05288): with model chunks whose chunk 0 holds a `PipelineVocabOutput`
shard, the plan gets S/T actions (`vocab_parallel.with_vocab_parallel`, unless it has them), which
`vocab_runtime.VocabStep` runs; the last stage's F then ends at the final norm and its B takes the sum of every
rank's T partial gradient. The loss is reported by the last stage's rank at its T. The input embedding,
split the same way, runs before the first action and its backward after the last one (`VocabStep.embed`): the
first stage's F takes the summed embedding as its input; the data iterator after the chunks' ones feeds it.

Loss convention (Megatron-core per-token loss): on the last stage `loss_func(output)` returns
(loss_sum, num_tokens, log); backward runs on loss_sum * loss_scale and the caller divides the
accumulated grads by the global token count. Grads are left in `.grad`; nothing is reduced over DP.
"""
from __future__ import annotations

import functools
import time
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from llamapipe.core.parallel_state import ParallelState
from llamapipe.fault_injection import slow_action, slowing
from llamapipe.core.pipeline_parallel.offload_plan import offload_plan
from llamapipe.core.pipeline_parallel.p2p_communication import P2PCommunicator
from llamapipe.core.pipeline_parallel.runtime import GradSyncHooks, RuntimeOptions
from llamapipe.core.pipeline_parallel.schedule_ir import BACKWARD_KINDS, Action, Plan
from llamapipe.core.pipeline_parallel.step_actions import RankStep
from llamapipe.core.pipeline_parallel.vocab_parallel import with_vocab_parallel
from llamapipe.core.pipeline_parallel.vocab_runtime import VocabStep, vocab_embedding, vocab_output


def forward_only_actions(plan: Plan, pp_rank: int) -> tuple[Action, ...]:
    """The plan's F (and S) actions in plan order: a deadlock-free evaluation pass (F only depends on F, S on
    the last stage's F)."""
    return tuple(a for a in plan.actions[pp_rank] if a.kind in ("F", "S"))


@functools.lru_cache(maxsize=64)
def vocab_plan(plan: Plan) -> Plan:
    """`plan` with the output layer's S/T actions (every rank derives the same plan from the same one)."""
    return plan if plan.vocab else with_vocab_parallel(plan)


def run(plan: Plan, *, model_chunks: list[nn.Module], forward_step_func: Callable, data_iterator: Any,
        parallel_state: ParallelState, num_microbatches: int, forward_only: bool = False, loss_scale: float = 1.0,
        options: RuntimeOptions = RuntimeOptions()) -> list[dict]:
    """Run this rank's part of `plan`; returns per-microbatch loss dicts on the last stage, else [].

    `model_chunks[c]` is local chunk c. `data_iterator` is one iterator or one per local chunk. `options`
    (`runtime.RuntimeOptions`, the job's) gives the rest: `fused_bw=True` sends a BW's input gradient only
    after its weight gradients (Megatron-LM's order; benchmarks use it as the baseline), by default the
    gradient goes out between the B and W parts; `grad_sync` is told which actions finish each chunk's backward
    so it can start data-parallel all-reduces during the step (not in a forward-only step); every observer
    sees every action, message wait and phase of the step (`runtime.StepObserver`).
    """
    pp_rank = parallel_state.pp_rank
    output = vocab_output(model_chunks)
    if output is not None:
        plan = vocab_plan(plan)
    if options.offload is not None and not forward_only:
        plan = offload_plan(plan, options.offload)
    if num_microbatches != plan.num_microbatches:
        raise ValueError(f"the plan has {plan.num_microbatches} microbatches but num_microbatches is "
                         f"{num_microbatches}")
    if len(model_chunks) != plan.vpp or plan.pp != parallel_state.pp_size:
        raise ValueError(f"plan {plan.name} needs pp={plan.pp} with {plan.vpp} chunks per rank, got "
                         f"pp={parallel_state.pp_size} with {len(model_chunks)} chunks")
    actions = forward_only_actions(plan, pp_rank) if forward_only else plan.actions[pp_rank]
    actions_of = (lambda r: forward_only_actions(plan, r)) if forward_only else None
    device = next(model_chunks[0].parameters()).device
    comm = (options.communicator or P2PCommunicator)(plan, pp_rank, parallel_state.pp_ranks, parallel_state.pp_group,
                                                     device=device, variable_seq_lengths=options.variable_seq_lengths,
                                                     actions_of=actions_of)
    vocab = None if output is None else VocabStep(
        output, parallel_state.pp_group, plan.pp, last_rank=plan.rank_chunk_of(plan.num_stages - 1)[0] == pp_rank,
        loss_scale=loss_scale, embedding=vocab_embedding(model_chunks), first_rank=pp_rank == 0,
        first_rank_global=parallel_state.pp_ranks[0])
    step = RankStep(plan, pp_rank, comm, model_chunks, forward_step_func, data_iterator, forward_only, loss_scale,
                    options.fused_bw, options.observers, vocab, options.offload)
    for observer in options.observers:
        observer.step_begin(plan, pp_rank, forward_only)
    _run_step(step, actions, None if forward_only else options.grad_sync, _prepass_iterator(data_iterator, plan)
              if vocab is not None else None)
    step.store.assert_empty()
    assert not step.outputs and not step.local, "activations left alive at step end"
    assert step.offload is None or step.offload.device_bytes() + step.offload.host_bytes() == 0, \
        "offloaded activations left at step end"
    for observer in options.observers:
        observer.step_end(comm.largest_send)
    return [step.losses[mb] for mb in sorted(step.losses)]


def _run_step(step: RankStep, actions: tuple, grad_sync: Optional[GradSyncHooks], prepass: Any) -> None:
    """The step's actions (and the vocabulary-parallel embedding around them), then every send waited for;
    a started gradient synchronisation is aborted when anything raises."""
    vocab, comm = step.vocab, step.comm
    try:
        if grad_sync is not None:
            grad_sync.begin_step(step.store)
        with torch.no_grad() if step.forward_only else nullcontext(), step.store.active():
            if vocab is not None:
                with _phase(step, "embed"):
                    vocab.embed(step.forward_step_func, prepass, step.plan.num_microbatches,
                                keep_graph=not step.forward_only)
            _loop(step, actions, comm, grad_sync)
            if vocab is not None:
                with _phase(step, "embed-backward"):
                    vocab.embedding_backward()
                    vocab.finish()
                step.losses.update(vocab.losses)
        with _comm_call(step, "finish"):
            comm.finish()
    except BaseException:
        if grad_sync is not None:
            grad_sync.abort()
        raise
    if grad_sync is not None:
        grad_sync.end_step()


@contextmanager
def _phase(step: RankStep, what: str) -> Iterator[None]:
    """Time a part of the step that is not an action of the plan, for the observers."""
    start, untimed = time.perf_counter(), step.untimed_s()
    yield
    for observer in step.observers:
        observer.phase_done(what, start, time.perf_counter(), step.untimed_s() - untimed)


@contextmanager
def _comm_call(step: RankStep, what: str) -> Iterator[None]:
    """Time a communication call between actions, for the observers."""
    for observer in step.observers:
        observer.comm_begin(what)
    start = time.perf_counter()
    yield
    if step.observers:
        end = time.perf_counter()
        for observer in step.observers:
            observer.comm_done(what, start, end)


def _prepass_iterator(data_iterator: Any, plan: Plan) -> Any:
    """The data iterator of the vocabulary-parallel embedding: the one after the chunks' ones."""
    if not isinstance(data_iterator, (list, tuple)) or len(data_iterator) <= plan.vpp:
        raise ValueError(f"a vocabulary-parallel model needs {plan.vpp + 1} data iterators on every rank (one per "
                         "model chunk, then the embedding's), as training.setup.build_iterators makes them")
    return data_iterator[plan.vpp]


def _last_backward_actions(actions: tuple) -> tuple[dict, dict]:
    """Per chunk: the index of its last B/BW, and of its last B/BW/W (after which its grads are final)."""
    last_b, last_any = {}, {}
    for i, a in enumerate(actions):
        if a.kind in BACKWARD_KINDS:
            last_b[a.chunk] = i
        if a.kind != "F":
            last_any[a.chunk] = i
    return last_b, last_any


def _loop(step: RankStep, actions: tuple, comm: P2PCommunicator, grad_sync: Optional[GradSyncHooks]) -> None:
    last_b, last_any = _last_backward_actions(actions) if grad_sync is not None else ({}, {})
    last = max(last_any.values(), default=-1)
    slow = slowing()        # a test's slowed rank (LLAMAPIPE_TEST_SLOW); off in every real run
    with _comm_call(step, "post"):
        comm.post_ahead()
        comm.flush()
    for i, action in enumerate(actions):
        start, untimed = time.perf_counter(), step.untimed_s()
        cpu_start = time.thread_time() if slow else 0.0
        if last_b.get(action.chunk) == i:
            grad_sync.arm(action.chunk)
        if i == last:
            grad_sync.last_action()
        for observer in step.observers:
            observer.action_begin(action)
        step.execute(action)
        if slow:
            slow_action(cpu_start)
        if grad_sync is not None:
            grad_sync.disarm()
            if last_any.get(action.chunk) == i:
                grad_sync.chunk_done(action.chunk, last_action=i == last)
        if step.observers:
            end = time.perf_counter()
            for observer in step.observers:
                observer.action_done(action, start, end, step.untimed_s() - untimed)
        with _comm_call(step, "post"):
            comm.post_ahead()
            comm.flush()
