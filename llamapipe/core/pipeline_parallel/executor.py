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
from llamapipe.core.pipeline_parallel.p2p_communication import Message, P2PCommunicator, needs_and_sends, vocab_messages
from llamapipe.core.pipeline_parallel.runtime import GradSyncHooks, RuntimeOptions, StepObserver
from llamapipe.core.pipeline_parallel.schedule_ir import BACKWARD_KINDS, Action, Plan
from llamapipe.core.pipeline_parallel.vocab_parallel import with_vocab_parallel
from llamapipe.core.pipeline_parallel.vocab_runtime import VocabStep, pack_targets, vocab_embedding, vocab_output
from llamapipe.core.tensor_parallel.weight_grad_store import WeightGradStore


def forward_only_actions(plan: Plan, pp_rank: int) -> tuple[Action, ...]:
    """The plan's F (and S) actions in plan order: a deadlock-free evaluation pass (F only depends on F, S on
    the last stage's F)."""
    return tuple(a for a in plan.actions[pp_rank] if a.kind in ("F", "S"))


@functools.lru_cache(maxsize=64)
def vocab_plan(plan: Plan) -> Plan:
    """`plan` with the output layer's S/T actions (every rank derives the same plan from the same one)."""
    return plan if plan.vocab else with_vocab_parallel(plan)


def _free_output(out: torch.Tensor) -> None:
    """Release a sent output's storage but keep its autograd graph (the send holds its own alias)."""
    if out._base is None:
        out.data = torch.empty((1,), device=out.device, dtype=out.dtype)


def _backward(out: torch.Tensor, grad: Optional[torch.Tensor]) -> None:
    if grad is None:
        torch.autograd.backward(out)
        return
    # The output's data may have been freed, so the shape check of torch.autograd.backward must be skipped.
    torch.autograd.Variable._execution_engine.run_backward(
        tensors=(out,), grad_tensors=(grad,), keep_graph=False, create_graph=False, inputs=(),
        allow_unreachable=True, accumulate_grad=True)


class _Step:
    """State of one rank during one step: live inputs/outputs per (chunk, mb), local hand-offs and the
    step's deferred weight gradients."""

    def __init__(self, plan: Plan, pp_rank: int, comm: P2PCommunicator, model_chunks: list[nn.Module],
                 forward_step_func: Callable, data_iterator: Any, forward_only: bool, loss_scale: float,
                 fused_bw: bool = False, observers: tuple[StepObserver, ...] = (),
                 vocab: Optional[VocabStep] = None) -> None:
        self.plan, self.pp_rank, self.comm, self.chunks = plan, pp_rank, comm, model_chunks
        self.observers = observers           # timers, trace, action times, activation probe
        self.fused_bw = fused_bw
        self.forward_step_func, self.data_iterator = forward_step_func, data_iterator
        self.forward_only, self.loss_scale = forward_only, loss_scale
        self.inputs: dict[tuple, Optional[torch.Tensor]] = {}
        self.outputs: dict[tuple, torch.Tensor] = {}
        self.local: dict[Message, torch.Tensor] = {}
        self.losses: dict[int, dict] = {}
        self.wait_s = 0.0                    # time blocked on receives, excluded from action timings
        self.store = WeightGradStore()
        self.vocab = vocab                   # S/T of a vocabulary-parallel plan

    def untimed_s(self) -> float:
        """Seconds so far blocked on receives and the vocabulary layer's collectives, or spent by observers
        measuring: not part of any action's time."""
        vocab = self.vocab.wait_s if self.vocab is not None else 0.0
        return self.wait_s + vocab + sum(o.overhead_s for o in self.observers)

    def _take(self, msg: Message) -> torch.Tensor:
        if msg.src == msg.dst:
            return self.local.pop(msg)
        start = time.perf_counter()
        tensor = self.comm.recv(msg)
        end = time.perf_counter()
        self.wait_s += end - start
        for observer in self.observers:
            observer.message_received(msg, end)
        return tensor

    def _give(self, msg: Message, tensor: torch.Tensor) -> None:
        if msg.src == msg.dst:
            self.local[msg] = tensor.detach()
            return
        self.comm.send(msg, tensor)
        if self.observers:
            now = time.perf_counter()
            for observer in self.observers:
                observer.message_sent(msg, now)

    def _iterator(self, chunk: int) -> Any:
        return self.data_iterator[chunk] if isinstance(self.data_iterator, (list, tuple)) else self.data_iterator

    def forward(self, action: Action) -> None:
        key, chunk = (action.chunk, action.microbatch), self.chunks[action.chunk]
        need, send = needs_and_sends(self.plan, self.pp_rank, action)
        x = None
        if need is not None or self._embedded_input(action):
            x = self._take(need) if need is not None else self.vocab.embedded[action.microbatch].detach()
            if not self.forward_only:
                x.requires_grad_(True)
            chunk.set_input_tensor(x)
        out, loss_func = self.forward_step_func(self._iterator(action.chunk), chunk)
        if send is None and self.vocab is not None:      # the last stage: its hidden state goes to every S
            self.vocab.loss_funcs[action.microbatch] = loss_func.loss_func
            hidden, targets = out.detach(), pack_targets(loss_func)
            for msg in vocab_messages(self.plan, self.pp_rank, action)[1]:
                self._give(msg, hidden if msg.kind == "hidden" else targets)
        elif send is None:
            loss_sum, num_tokens, log = loss_func(out)
            self.losses[action.microbatch] = {"loss_sum": loss_sum.detach().float(), "num_tokens": num_tokens,
                                              "log": log}
            out = loss_sum * self.loss_scale
        for observer in self.observers:
            observer.forward_done(key, out)
        if send is not None:
            self._give(send, out)
            if send.src != send.dst and not self.forward_only:
                _free_output(out)
        if not self.forward_only:
            self.inputs[key], self.outputs[key] = x, out

    def backward(self, action: Action) -> None:
        key = (action.chunk, action.microbatch)
        need, send = needs_and_sends(self.plan, self.pp_rank, action)
        grad = self._take(need) if need is not None else None
        partials = [self._take(msg) for msg in vocab_messages(self.plan, self.pp_rank, action)[0]]
        if partials:                         # the last stage under vocabulary parallelism: every rank's T
            grad = functools.reduce(torch.add, partials)
        out, x = self.outputs.pop(key), self.inputs.pop(key)
        # A BW that sends to another rank runs as B, send, W: the upstream rank gets its gradient one W
        # earlier, at no memory cost (the simulator's early_send); fused_bw keeps Megatron's order.
        split = action.kind == "B" or (not self.fused_bw and send is not None and send.src != send.dst)
        with self.store.capture(key) if split else nullcontext():
            _backward(out, grad)
        if send is not None:
            assert x is not None and x.grad is not None, f"no input gradient for {action}"
            self._give(send, x.grad)
        elif self._embedded_input(action):      # the embedding shards' backward runs after the last action
            self.vocab.embedding_grads[action.microbatch] = x.grad
        if self.observers:
            del out, x                       # so an observer sees only what the deferred W keeps alive
            held = self.store.held_tensors(key)
            for observer in self.observers:
                observer.backward_done(key, split=action.kind == "B", held=held)
        if split and action.kind == "BW":
            self.comm.flush()
            self.store.run(key)

    def _embedded_input(self, action: Action) -> bool:
        """Whether `action` is on the first stage of a model whose embedding is split over the pipeline."""
        return (self.vocab is not None and self.vocab.embedded is not None
                and self.plan.stage_of(self.pp_rank, action.chunk) == 0)

    def vocab_action(self, action: Action) -> None:
        """S: the output layer's statistics on this rank's shard; T: its backward, partial gradient sent."""
        consumed, produced = vocab_messages(self.plan, self.pp_rank, action)
        if action.kind == "S":
            hidden, targets = (self._take(msg) for msg in consumed)
            self.vocab.stats(action.microbatch, hidden, targets)
        else:
            self._give(produced[0], self.vocab.grad(action.microbatch))

    def execute(self, action: Action) -> None:
        if action.kind == "F":
            self.forward(action)
        elif action.kind in ("S", "T"):
            self.vocab_action(action)
        elif action.kind in BACKWARD_KINDS:
            self.backward(action)
        else:
            self.store.run((action.chunk, action.microbatch))


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
    step = _Step(plan, pp_rank, comm, model_chunks, forward_step_func, data_iterator, forward_only, loss_scale,
                 options.fused_bw, options.observers, vocab)
    for observer in options.observers:
        observer.step_begin(plan, pp_rank, forward_only)
    _run_step(step, actions, None if forward_only else options.grad_sync, _prepass_iterator(data_iterator, plan)
              if vocab is not None else None)
    step.store.assert_empty()
    assert not step.outputs and not step.local, "activations left alive at step end"
    for observer in options.observers:
        observer.step_end(comm.largest_send)
    return [step.losses[mb] for mb in sorted(step.losses)]


def _run_step(step: _Step, actions: tuple, grad_sync: Optional[GradSyncHooks], prepass: Any) -> None:
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
def _phase(step: _Step, what: str) -> Iterator[None]:
    """Time a part of the step that is not an action of the plan, for the observers."""
    start, untimed = time.perf_counter(), step.untimed_s()
    yield
    for observer in step.observers:
        observer.phase_done(what, start, time.perf_counter(), step.untimed_s() - untimed)


@contextmanager
def _comm_call(step: _Step, what: str) -> Iterator[None]:
    """Time a communication call between actions, for the observers."""
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


def _loop(step: _Step, actions: tuple, comm: P2PCommunicator, grad_sync: Optional[GradSyncHooks]) -> None:
    last_b, last_any = _last_backward_actions(actions) if grad_sync is not None else ({}, {})
    last = max(last_any.values(), default=-1)
    with _comm_call(step, "post"):
        comm.post_ahead()
        comm.flush()
    for i, action in enumerate(actions):
        start, untimed = time.perf_counter(), step.untimed_s()
        if last_b.get(action.chunk) == i:
            grad_sync.arm(action.chunk)
        if i == last:
            grad_sync.last_action()
        step.execute(action)
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
