"""torch's private FSDP2 / DTensor API behind core/distributed/fsdp_internals.py: each private name the adapter uses
exists on the installed torch with the kind and signature the adapter relies on, no other module reaches into
torch's private distributed API, and the adapter works on a two-layer `fully_shard` model in one gloo process.
When torch moves one of these, this file fails first, naming it."""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

import llamapipe
from llamapipe.core.distributed import fsdp_internals

ADAPTER = Path(fsdp_internals.__file__)
# Every private attribute the adapter reads, and how the tests below check it on the installed torch.
METHODS = {     # (class, method) -> what the adapter calls it with besides self (FSDPState, FSDPParamGroup: private)
    (FSDPModule, "_get_fsdp_state"): (),
    (FSDPState, "_lazy_init"): (),
    (FSDPParamGroup, "post_backward"): (),
    (FSDPParamGroup, "finalize_backward"): (),
}
INSTANCE_ATTRS = {"_fsdp_param_groups", "_training_state", "_module_info", "_unsharded_param", "_local_tensor"}
PRIVATE_MODULES = {"torch.distributed.fsdp._fully_shard._fsdp_common", "torch.distributed.tensor._utils"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_uses(path: Path) -> tuple[set[str], set[str]]:
    """(private attribute names, modules with a private part) that the file at `path` uses."""
    attrs, modules = set(), set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            attrs.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _private(node.value):
            attrs.add(node.value)                # getattr / hasattr by name
        elif isinstance(node, ast.ImportFrom) and any(map(_private, (node.module or "").split("."))):
            modules.add(node.module)
        elif isinstance(node, ast.Import):
            modules |= {a.name for a in node.names if any(map(_private, a.name.split(".")))}
    return attrs, modules


def test_the_adapter_uses_only_the_private_names_checked_here():
    attrs, modules = _private_uses(ADAPTER)
    assert attrs == {name for _, name in METHODS if name.startswith("_")} | INSTANCE_ATTRS
    assert modules == PRIVATE_MODULES


def test_no_other_module_reaches_into_torchs_private_distributed_api():
    private = {name for _, name in METHODS} | INSTANCE_ATTRS | {"_fsdp_param_group", "_composable"}
    found = []
    for path in sorted(Path(llamapipe.__file__).parent.rglob("*.py")):
        if path == ADAPTER:
            continue
        attrs, modules = _private_uses(path)
        found += [f"{path}: {name}" for name in sorted(attrs & private)]
        found += [f"{path}: {m}" for m in sorted(modules) if m.startswith("torch.distributed")]
    assert not found, "private torch API outside fsdp_internals.py:\n" + "\n".join(found)


@pytest.mark.parametrize("owner,name", list(METHODS), ids=[f"{o.__name__}.{n}" for o, n in METHODS])
def test_private_methods_exist_with_the_signature_the_adapter_calls(owner, name):
    method = getattr(owner, name, None)
    assert callable(method), f"torch {torch.__version__}: {owner.__name__}.{name} is gone"
    inspect.signature(method).bind(object(), *METHODS[(owner, name)])   # TypeError if the call no longer fits


def test_private_functions_and_enums_exist():
    assert isinstance(TrainingState.IDLE, TrainingState)
    params = list(inspect.signature(compute_local_shape_and_global_offset).parameters)
    assert params[:3] == ["global_shape", "mesh", "placements"]


@pytest.fixture
def one_rank(tmp_path):
    """A one-process gloo group for the test, destroyed after it."""
    assert not dist.is_initialized(), "another test left a process group behind"
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _sharded(mesh) -> nn.Sequential:
    model = _model(0)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    model.set_requires_gradient_sync(False)      # as fsdp.py: reduced once per step, by the adapter
    for module in (model, model[0], model[2]):
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)
    return model


def test_instance_attributes_have_the_kinds_the_adapter_reads(one_rank):
    model = _sharded(one_rank)
    fsdp_internals.init_root(model)
    state = model._get_fsdp_state()
    assert isinstance(state, FSDPState) and isinstance(state._fsdp_param_groups, list)
    groups = fsdp_internals.param_groups(model[0])
    assert len(groups) == 1 and isinstance(groups[0], FSDPParamGroup)
    assert isinstance(groups[0]._training_state, TrainingState)
    fsdp_param = groups[0].fsdp_params[0]
    assert isinstance(fsdp_param, FSDPParam) and hasattr(fsdp_param, "unsharded_accumulated_grad")
    assert fsdp_param._module_info.module is model[0] and fsdp_param._module_info.param_name == "weight"
    model(torch.randn(2, 8)).sum().backward()
    assert isinstance(fsdp_param._unsharded_param, nn.Parameter)
    assert isinstance(model[0].weight, DTensor) and isinstance(model[0].weight._local_tensor, torch.Tensor)


def test_the_adapter_reduces_the_gathered_gradients_into_the_shards(one_rank):
    """Against the same model unsharded: the gathered gradients after backward, then the shards' after
    `reduce_scatter` (a sum over one rank), then nothing gathered after `drop_gathered_grads`."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    reference = _model(0)
    reference(x).square().sum().backward()
    want = {name: p.grad for name, p in reference.named_parameters()}

    model = _sharded(one_rank)
    fsdp_internals.init_root(model)
    model(x).square().sum().backward()
    groups = [g for layer in (model[0], model[2]) for g in fsdp_internals.param_groups(layer)]
    names = {model[0]: "0", model[2]: "2"}
    gathered = {f"{names[m]}.{n}": p for m, n, p in fsdp_internals.gathered_params(groups)}
    assert sorted(gathered) == sorted(want)
    for name, param in gathered.items():
        torch.testing.assert_close(param.grad, want[name], rtol=1e-6, atol=1e-7, msg=name)

    model.set_requires_gradient_sync(True)
    fsdp_internals.reduce_scatter(groups)
    model.set_requires_gradient_sync(False)
    for name, param in model.named_parameters():
        local = fsdp_internals.local_tensor(param.grad)
        torch.testing.assert_close(local, want[name][fsdp_internals.local_index(param)], rtol=1e-6, atol=1e-7,
                                   msg=name)
    assert all(g._training_state == TrainingState.IDLE for g in groups)

    model(x).square().sum().backward()
    fsdp_internals.drop_gathered_grads(groups)
    assert all(p is None or p.grad is None for _, _, p in fsdp_internals.gathered_params(groups))
