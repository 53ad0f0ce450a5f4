"""What one rank's actions do during one step of the executor (`executor.run`): F, B, W, BW and the vocabulary
layer's S and T on real model chunks, with the messages `p2p_communication` derives from the plan.

`RankStep` holds the step's state: live inputs and outputs per (chunk, microbatch), local hand-offs between two
chunks of one rank, the step's deferred weight gradients (`WeightGradStore`) and the vocabulary layer's S/T
state (`vocab_runtime.VocabStep`); every observer sees each message and each finished pass. The executor's
module docstring gives the rules (what a BW sends when, why a sent output's data is freed).
"""
from __future__ import annotations

import functools
import time
from contextlib import nullcontext
from typing import Any, Callable, Optional

import torch
from torch import nn

from llamapipe.core.pipeline_parallel.offload_plan import OffloadOptions, offloaded_keys
from llamapipe.core.pipeline_parallel.offload_store import OffloadStore
from llamapipe.core.pipeline_parallel.p2p_communication import Message, P2PCommunicator, needs_and_sends, vocab_messages
from llamapipe.core.pipeline_parallel.runtime import StepObserver
from llamapipe.core.pipeline_parallel.schedule_ir import BACKWARD_KINDS, Action, Plan
from llamapipe.core.pipeline_parallel.vocab_runtime import VocabStep, pack_targets
from llamapipe.core.tensor_parallel.weight_grad_store import WeightGradStore


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


class RankStep:
    """State of one rank during one step: live inputs/outputs per (chunk, mb), local hand-offs and the
    step's deferred weight gradients."""

    def __init__(self, plan: Plan, pp_rank: int, comm: P2PCommunicator, model_chunks: list[nn.Module],
                 forward_step_func: Callable, data_iterator: Any, forward_only: bool, loss_scale: float,
                 fused_bw: bool = False, observers: tuple[StepObserver, ...] = (),
                 vocab: Optional[VocabStep] = None, offload: Optional[OffloadOptions] = None) -> None:
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
        self.offloaded = frozenset() if forward_only else offloaded_keys(plan, pp_rank)
        held = not forward_only and any(a.kind == "OW" for a in plan.actions[pp_rank])
        self.offload = (OffloadStore(model_chunks, offload, pp_rank, len(self.offloaded))
                        if self.offloaded or held else None)   # O/R, OW/RW: what goes to host memory
        for observer in observers if self.offload is not None else ():
            observer.offload_begin(self.offload)

    def untimed_s(self) -> float:
        """Seconds so far blocked on receives and the vocabulary layer's collectives, or spent by observers
        measuring: not part of any action's time."""
        vocab = self.vocab.wait_s if self.vocab is not None else 0.0
        return self.wait_s + vocab + sum(o.overhead_s for o in self.observers)

    def _take(self, msg: Message) -> torch.Tensor:
        if msg.src == msg.dst:
            return self.local.pop(msg)
        for observer in self.observers:
            observer.message_waiting(msg)
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
        with self.offload.packing(key) if key in self.offloaded else nullcontext():
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
        if key in self.offloaded:
            self.offload.release(key)
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
        elif action.kind == "O":
            self.offload.offload((action.chunk, action.microbatch))
        elif action.kind == "R":
            self.offload.reload((action.chunk, action.microbatch))
        elif action.kind == "OW":
            self.offload.offload_held((action.chunk, action.microbatch), self.store)
        elif action.kind == "RW":
            self.offload.reload_held((action.chunk, action.microbatch), self.store)
        else:
            self.store.run((action.chunk, action.microbatch))
            if self.offload is not None:
                self.offload.release_held((action.chunk, action.microbatch))
