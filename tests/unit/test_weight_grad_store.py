"""The weight-gradient store the executor owns (core/tensor_parallel/weight_grad_store.py): a parallel
linear's forward remembers the current store, so its backward defers into that store from any thread
(on GPU autograd runs backward on a device thread, where the caller's context variables are not set),
and nothing is deferred without one."""
import threading

import torch
from torch import nn

from llamapipe.core.tensor_parallel import weight_grad_store
from llamapipe.core.tensor_parallel.weight_grad_store import WeightGradStore
from llamapipe.core.tensor_parallel.layers import ColumnParallelLinear


def _layer_and_input():
    torch.manual_seed(0)
    layer = ColumnParallelLinear(4, 6)
    nn.init.normal_(layer.weight)
    return layer, torch.randn(3, 2, 4, requires_grad=True)


def test_backward_on_another_thread_defers_into_the_store_its_forward_ran_under():
    layer, x = _layer_and_input()
    plain, _ = _layer_and_input()
    plain(x).square().sum().backward()
    store = WeightGradStore()
    with store.active():
        loss = layer(x).square().sum()
    assert weight_grad_store.current() is None, "the store is current only inside its block"
    store.begin("k")
    worker = threading.Thread(target=loss.backward)   # a fresh thread: no context variables set
    worker.start()
    worker.join()
    assert store.end() == "k"
    assert layer.weight.grad is None and store.queued(layer.weight) == 1
    ran = []
    store.set_listener(ran.append)
    assert store.run("k") == 1
    assert ran == [(layer.weight,)] and store.queued(layer.weight) == 0
    torch.testing.assert_close(layer.weight.grad, plain.weight.grad, rtol=0, atol=0)
    store.assert_empty()


def test_without_a_store_or_outside_capture_the_weight_gradient_runs_at_once():
    layer, x = _layer_and_input()
    layer(x).sum().backward()                          # no store at all
    assert layer.weight.grad is not None
    layer.weight.grad = None
    store = WeightGradStore()
    with store.active():
        out = layer(x).sum()
    out.backward()                                     # the store is not capturing: plain BW
    assert layer.weight.grad is not None and store.queued(layer.weight) == 0
    store.assert_empty()


def test_two_stores_keep_their_own_closures():
    layer, x = _layer_and_input()
    first, second = WeightGradStore(), WeightGradStore()
    with first.capture("a"):
        layer(x).sum().backward()
    with second.capture("a"):
        layer(x).sum().backward()
    assert first.queued(layer.weight) == second.queued(layer.weight) == 1
    first.run("a")
    once = layer.weight.grad.clone()
    second.run("a")
    torch.testing.assert_close(layer.weight.grad, 2 * once, rtol=1e-6, atol=0)
    first.assert_empty()
    second.assert_empty()
