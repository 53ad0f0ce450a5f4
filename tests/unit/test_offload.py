"""PipeOffload in one process: the plan pass (offload_plan), the simulator's checks and memory, the store's copies
(offload_store, against autograd without hooks) and the flags (training/arguments/offload_args.py)."""
import pytest
import torch

from llamapipe.core.pipeline_parallel.offload_plan import offloaded_keys, with_offload
from llamapipe.core.pipeline_parallel.offload_store import OffloadStore
from llamapipe.core.pipeline_parallel.schedule_ir import Action, Plan
from llamapipe.core.pipeline_parallel.schedule_specs import build
from llamapipe.core.pipeline_parallel.simulator import Costs, PlanError, simulate, verify
from llamapipe.training.arguments.parser import ArgumentError, build_parser, config_from_args

SCHEDULES = [("1f1b", 1), ("zb-h1", 1), ("interleaved", 2), ("interleaved", 4), ("zbv", 2), ("v-half", 2),
             ("dualpipev", 2)]


@pytest.mark.parametrize("schedule,vpp", SCHEDULES)
@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("lead", [0, 1])
def test_offload_plan_verifies_and_lowers_the_peak(schedule, vpp, pp, lead):
    m = 4 * pp
    plan = build(schedule, pp, vpp, m)
    off = with_offload(plan, vpp, reload_lead=lead)
    verify(off)
    without, with_ = simulate(plan).peak_memory, simulate(off).peak_memory
    assert max(with_) <= max(without), (schedule, without, with_)
    if vpp > 1 or pp > 2:     # at pp 2 with one chunk every gap is too short (1F1B: a B right after each F)
        assert max(with_) < max(without), (schedule, without, with_)
    for rank in range(pp):        # same compute actions in the same order; each O right after its F
        assert [a for a in off.actions[rank] if a.kind not in "OR"] == list(plan.actions[rank])
        acts = off.actions[rank]
        for i, a in enumerate(acts):
            if a.kind == "O":
                assert acts[i - 1] == Action("F", a.chunk, a.microbatch)
            if a.kind == "R" and lead == 0:
                assert acts[i + 1].kind in ("B", "BW") and acts[i + 1][1:] == a[1:]
    assert simulate(off).makespan == simulate(plan).makespan      # copies cost 0 on the timeline by default


def test_offload_chunk_num_picks_the_chunks_below_it():
    plan = build("interleaved", 2, 4, 8)
    for chunk_num in (1, 2, 3):
        keys = offloaded_keys(with_offload(plan, chunk_num), 0)
        assert keys and {chunk for chunk, _ in keys} <= set(range(chunk_num))


def test_reload_right_before_the_backward_holds_less():
    plan = build("zbv", 2, 2, 8)        # copies on the compute cores (CPU): R right before B
    assert simulate(with_offload(plan, 1, reload_lead=0)).peak_memory == [1.0, 2.0]     # of [4, 4]
    assert simulate(with_offload(plan, 1, reload_lead=1)).peak_memory == [2.0, 3.0]


def test_a_gap_too_short_keeps_the_activation():
    plan = build("1f1b", 2, 1, 8)
    off = with_offload(plan, 1)
    last = off.actions[1]        # the last stage runs each B right after its F in steady state: nothing to gain
    assert not [a for a in last if a.kind == "O"]
    slow = with_offload(plan, 1, offload_time=10.0)       # copies slower than any gap: nothing offloads
    assert not any(a.kind == "O" for acts in slow.actions for a in acts)


def test_simulator_refuses_misplaced_offload():
    f, b = Action("F", 0, 0), Action("BW", 0, 0)
    bad = [(Action("O", 0, 0), f, b), (f, Action("O", 0, 0), b), (f, Action("O", 0, 0), b, Action("R", 0, 0)),
           (f, Action("O", 0, 0), Action("O", 0, 0), Action("R", 0, 0), b)]
    for acts in bad:
        with pytest.raises(PlanError):
            verify(Plan("x", 1, 1, 1, "interleaved", (acts,)))
    verify(Plan("x", 1, 1, 1, "interleaved", ((f, Action("O", 0, 0), Action("R", 0, 0), b),)))


def test_simulated_memory_moves_the_offloaded_share():
    f, o, r, b = (lambda mb, kind=kind: Action(kind, 0, mb) for kind in ("F", "O", "R", "BW"))
    acts = (f(0), o(0), f(1), o(1), r(0), b(0), r(1), b(1))
    plan = Plan("x", 1, 1, 2, "interleaved", (acts,))
    # levels: 1, 0.25, 1.25, 0.5, 1.25 (R0), 0.25, 1.0, 0 -- without offload F0 + F1 = 2
    assert simulate(plan, Costs(offload_share=0.75)).peak_memory == [1.25]
    assert simulate(plan, Costs(offload=0.5)).makespan == simulate(plan).makespan + 2.0


def _tiny_step(hooks: bool):
    torch.manual_seed(0)
    w1, w2 = torch.randn(8, 16, requires_grad=True), torch.randn(16, 4, requires_grad=True)
    x = torch.randn(5, 8)
    store = OffloadStore([torch.nn.Linear(1, 1)])
    with store.packing("k") if hooks else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        h = torch.relu(x @ w1)
        q, k = h.split(8, dim=1)           # two views of one storage: copied once
        y = ((q * k).sum(1, keepdim=True) * (h @ w2)).sum()
    before = store.device_bytes()
    store.offload("k")
    moved = store.host_bytes(), store.device_bytes()
    y.backward()
    store.release("k")
    return w1.grad, w2.grad, before, moved


def test_store_round_trip_gives_autograds_gradients():
    g1, g2, before, (host, device) = _tiny_step(hooks=True)
    r1, r2, _, _ = _tiny_step(hooks=False)
    assert torch.equal(g1, r1) and torch.equal(g2, r2)
    assert before > 0 and host > 0 and device < before      # the relu output and its views went to the host


def test_weight_grad_inputs_go_between_b_and_w_and_lower_the_last_ranks_peak():
    """--offload-weight-grad-inputs: an OW after each split B, its RW before the W, verified; on ZB-V's last rank
    (the cool-down runs the Bs before the Ws) the simulated peak falls below offload without it."""
    plan = build("zbv", 4, 2, 8)
    held = with_offload(plan, 2, held=True, reload_lead=0)
    verify(held)
    for acts in held.actions:
        pos = {(a.kind, a.chunk, a.microbatch): i for i, a in enumerate(acts)}
        for (kind, chunk, mb), i in pos.items():
            if kind == "OW":
                assert pos[("B", chunk, mb)] == i - 1 and i < pos[("RW", chunk, mb)] < pos[("W", chunk, mb)]
    assert any(a.kind == "OW" for a in held.actions[3])
    assert simulate(held).peak_memory[3] < simulate(with_offload(plan, 2, reload_lead=0)).peak_memory[3]
    f, b, w = Action("F", 0, 0), Action("B", 0, 0), Action("W", 0, 0)
    ow, rw = Action("OW", 0, 0), Action("RW", 0, 0)
    for acts in [(f, ow, b, rw, w), (f, b, ow, w, rw), (f, b, ow, w), (f, b, rw, ow, w)]:
        with pytest.raises(PlanError):
            verify(Plan("x", 1, 1, 1, "interleaved", (acts,)))


def _deferred_linear_step(offload: bool):
    """One deferred weight gradient of a parallel linear (as a B of a zero-bubble plan queues it), its inputs moved
    to the host store and back between the B and the W when `offload`."""
    from llamapipe.core.tensor_parallel.layers import parallel_linear
    from llamapipe.core.tensor_parallel.weight_grad_store import WeightGradStore
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(6, 8))
    x = torch.randn(4, 1, 8, requires_grad=True)
    grads, store = WeightGradStore(), OffloadStore([torch.nn.Linear(1, 1)])
    with grads.active():
        (y,) = parallel_linear(torch.tanh(x), [weight], None, "parallel")
    with grads.capture("k"):
        y.square().sum().backward()
    activations = lambda: [t for t in grads.held_tensors("k") if not isinstance(t, torch.nn.Parameter)]  # noqa: E731
    held_before = sum(t.untyped_storage().nbytes() for t in activations())
    moved = None
    if offload:
        store.offload_held("k", grads)
        moved = store.host_bytes(), store.device_bytes(), activations()
        store.reload_held("k", grads)
    grads.run("k")
    store.release_held("k")
    return weight.grad, x.grad, held_before, moved


def test_store_moves_what_a_deferred_weight_gradient_holds_and_gives_the_same_gradient():
    g, gx, held, (host, device, left) = _deferred_linear_step(offload=True)
    r, rx, _, _ = _deferred_linear_step(offload=False)
    assert torch.equal(g, r) and torch.equal(gx, rx)
    assert held > 0 and host == held and device == 0 and not left     # the input and output gradient went


BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters",
        "3", "--mock-data", "--vocab-size", "256"]


def _config(*flags, world=2):
    return config_from_args(build_parser().parse_args(BASE + list(flags)), world)


def test_offload_flags_become_the_config():
    par = _config("--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
                  "--cpu-offload", "--offload-chunk-num", "2", "--offload-time", "0.2").parallel
    assert (par.offload_chunk_num, par.offload_time) == (2, 0.2)
    par = _config("--pipeline-model-parallel-size", "2", "--cpu-offload", "--auto-offload-time").parallel
    assert (par.offload_chunk_num, par.offload_time) == (1, None)
    assert _config("--pipeline-model-parallel-size", "2").parallel.offload_chunk_num == 0
    par = _config("--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
                  "--fine-grained-activation-offloading", "--offload-modules", "core_attn", "attn_proj").parallel
    assert (par.offload_chunk_num, par.offload_modules, par.offload_min_numel) == (2, ("core_attn", "attn_proj"),
                                                                                   1024 * 1024)


def test_megatron_module_filter_and_fraction_in_the_store():
    """Only what the named submodules save is recorded; a fraction moves that share of its bytes."""
    from llamapipe.core.pipeline_parallel.offload_plan import OffloadOptions
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
    x = torch.randn(4, 8)
    for modules, fraction in ((("0",), 1.0), (("1",), 1.0), ((), 0.5)):
        store = OffloadStore([model], OffloadOptions(1, modules=modules, fraction=fraction))
        with store.packing("k"):
            y = model(x).sum()
        total = store.device_bytes()
        store.offload("k")
        recorded = sum(s.nbytes for s in store._keys["k"].values())
        if modules == ("0",):      # the first linear saves its input x: a leaf that needs no gradient
            assert recorded == x.numel() * 4
        if modules == ("1",):      # tanh saves its output
            assert recorded == x.numel() * 4
        if fraction == 0.5:
            assert 0 < store.host_bytes() <= 0.5 * recorded
        y.backward()
        store.release("k")
        assert total > 0


@pytest.mark.parametrize("flags, words", [
    (["--pipeline-model-parallel-size", "2", "--cpu-offload", "--offload-chunk-num", "2"],
     "--offload-chunk-num 2 must be between 1 and the 1 model chunk per pipeline rank"),
    (["--cpu-offload"], "--cpu-offload places its copies in the pipeline schedule and needs "
                        "--pipeline-model-parallel-size > 1, got 1"),
    (["--pipeline-model-parallel-size", "2", "--offload-chunk-num", "1"], "--offload-chunk-num tunes --cpu-offload"),
    (["--pipeline-model-parallel-size", "2", "--cpu-offload", "--offload-time", "-1"], "--offload-time -1.0 must"),
    (["--pipeline-model-parallel-size", "2", "--cpu-offload", "--offload-time", "1", "--auto-offload-time"],
     "give one"),
    (["--fine-grained-activation-offloading"], "--fine-grained-activation-offloading places its copies in the "
                                               "pipeline schedule and needs --pipeline-model-parallel-size > 1, got 1"),
    (["--pipeline-model-parallel-size", "2", "--fine-grained-activation-offloading", "--offload-modules", "moe_act"],
     "--offload-modules moe_act applies to mixture-of-experts layers"),
    (["--pipeline-model-parallel-size", "2", "--fine-grained-activation-offloading", "--offload-modules", "mlp"],
     "--offload-modules mlp is not a module Megatron offloads; use attn_norm, qkv_linear, core_attn"),
    (["--pipeline-model-parallel-size", "2", "--fine-grained-activation-offloading", "--activation-offload-fraction",
      "1.5"], "--activation-offload-fraction 1.5 must be within [0, 1]"),
    (["--pipeline-model-parallel-size", "2", "--activation-offload-fraction", "0.5"],
     "--activation-offload-fraction tunes --fine-grained-activation-offloading"),
    (["--pipeline-model-parallel-size", "2", "--offload-weight-grad-inputs"],
     "--offload-weight-grad-inputs tunes --cpu-offload"),
    (["--pipeline-model-parallel-size", "2", "--cpu-offload", "--offload-weight-grad-inputs"],
     "--pipeline-schedule 1f1b runs them together; use a zero-bubble schedule"),
])
def test_offload_flag_mistakes_are_one_line(flags, words):
    world = 2 if "2" in flags else 1
    with pytest.raises(ArgumentError, match=None) as err:
        _config(*flags, world=world)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_dry_run_counts_offloaded_activations_and_the_plans_peak():
    """The dry run with --cpu-offload on ZB-V (pp 2): each rank's device activations fall and match the simulator's
    offload plan in the dry run's own units (within 5%), and the report says what a node needs in host memory."""
    from llamapipe.core.pipeline_parallel.offload_plan import with_offload
    from llamapipe.training.dry_run.main import build_parser as dry_parser, dry_run_config, run
    from llamapipe.training.dry_run.report import offload_lines
    from tests.cli import TINY

    def result(*flags):
        args = ["--world-size", "2"] + TINY + ["--train-iters", "4", "--global-batch-size", "8", "--seq-length", "64",
                                               "--max-position-embeddings", "64", "--pipeline-model-parallel-size",
                                               "2", "--num-virtual-stages-per-pipeline-rank", "2",
                                               "--pipeline-schedule", "zbv", *flags]
        return run(dry_run_config(dry_parser().parse_args(args)))
    base, off = result(), result("--cpu-offload")
    plan = build("zbv", 2, 2, 8)      # the plan the dry run ran: reload one backward ahead, as on a GPU
    sim_before = simulate(plan, Costs(w_mem=0.5)).peak_memory
    sim_after = simulate(with_offload(plan, 1), Costs(w_mem=0.5)).peak_memory
    for rank in range(2):
        before = next(r for r in base.reports if r.role.coords["pp"] == rank)
        after = next(r for r in off.reports if r.role.coords["pp"] == rank)
        ratio, planned = after.activations / before.activations, sim_after[rank] / sim_before[rank]
        assert abs(ratio - planned) <= 0.05, f"rank {rank}: {ratio:.3f} of the activations, the plan {planned:.3f}"
        assert after.step.offloaded > 0
    assert offload_lines(off) and not offload_lines(base)
    assert "node 0 (8 ranks) needs" in offload_lines(off)[0]
    held = result("--cpu-offload", "--offload-chunk-num", "2", "--offload-weight-grad-inputs")
    both = result("--cpu-offload", "--offload-chunk-num", "2")
    last = [next(r for r in res.reports if r.role.coords["pp"] == 1) for res in (both, held)]
    assert last[1].activations < last[0].activations, "what the deferred Ws hold stayed on the device"


def test_planner_counts_offload_in_the_plans_peak():
    """plan_peaks walks the O/R of an offload plan: the offloaded chunk's M_B leaves between its O and its R."""
    from llamapipe.tools.parallel_estimate import plan_peaks
    plan = build("interleaved", 2, 2, 8)
    bytes_ = [[(10.0, 10.0), (10.0, 10.0)]] * 2
    assert plan_peaks(with_offload(plan, 1), bytes_) == [10 * p for p in simulate(with_offload(plan, 1)).peak_memory]
    assert max(plan_peaks(with_offload(plan, 1), bytes_)) < max(plan_peaks(plan, bytes_))


@pytest.mark.slow      # the planner ranks 6,000 layouts of a 1,024-GPU job: 40 s here
def test_plan_lists_405b_on_1024_h100_only_with_offload_and_says_why():
    """LLaMA-3.1-405B, 1,024 x 80 GB, sequence 8192: the top row fits only with its activations offloaded; the same
    layout without offload is over the budget; its command is one the trainer takes; --explain says why."""
    import dataclasses
    import shlex
    from llamapipe.tools.parallel_estimate import DEVICES, estimate
    from llamapipe.tools.plan_parallelism import build_parser as plan_parser, command, explain, model_from_args, rank
    args = plan_parser().parse_args(["--model", "llama3.1-405b", "--gpus", "1024", "--gpu-memory-gb", "80",
                                     "--seq-length", "8192", "--global-batch-size", "1024"])
    model = model_from_args(args)
    rows = rank(model, args, DEVICES["h100"])
    lay, est = rows[0]
    assert lay.offload >= 1 and est.total <= 0.9 * 80 * 2 ** 30
    without = estimate(model, dataclasses.replace(lay, offload=0), 8192, 1024, DEVICES["h100"]).total
    assert without > 0.9 * 80 * 2 ** 30, "the top row would fit without offload"
    assert "without it this layout does not fit" in explain(lay, est)
    cmd = shlex.split(command(args, lay, model))
    config = config_from_args(build_parser().parse_args(cmd[cmd.index("scripts/launch_multi_node.sh") + 1:]), 1024)
    assert config.parallel.offload_chunk_num == lay.offload


def test_auto_offloads_only_when_the_cap_forces_a_slow_plan():
    """`auto` under a tight cap (pp 4, 2 units) takes a plan with every activation offloaded, which verifies, keeps the
    cap and is faster; under its default cap (2p) and where offload does not fit the cap, it offloads nothing."""
    from llamapipe.core.pipeline_parallel.auto_plan import plan_auto
    costs = Costs(f=1.0, b=1.2, w=0.8, comm=0.05)
    tight = plan_auto(4, 1, 12, costs, 2)
    plain = plan_auto(4, 1, 12, costs, 1)           # a cap offload cannot meet: the plan without it
    assert tight.name == "auto+offload" and any(a.kind == "O" for acts in tight.actions for a in acts)
    verify(tight)
    result = simulate(tight, costs)
    assert max(result.peak_memory) <= 2 and result.makespan < simulate(plain, costs).makespan
    for cap in (None, 1):
        plan = plan_auto(4, 1, 12, costs, cap)
        assert plan.name == "auto" and not any(a.kind == "O" for acts in plan.actions for a in acts)


@pytest.mark.parametrize("modules", [("layernorm",), ("act",), ("layernorm", "act"), ("core_attn", "mlp")])
def test_offload_with_partial_recompute_keeps_the_gradients(modules):
    """The store beside partial recompute (model/recompute.py), whose freed outputs give their memory to later
    tensors of the same forward: gradients equal the run with neither, bit for bit (keyed by data pointer, the
    store once mixed a freed norm output with a later tensor)."""
    import dataclasses
    from llamapipe.model.llama import LlamaConfig, LlamaModel
    config = LlamaConfig(num_layers=2, hidden_size=64, ffn_hidden_size=176, num_attention_heads=4,
                         num_query_groups=2, vocab_size=256, max_position_embeddings=64)
    g = torch.Generator().manual_seed(1)
    ids, labels = (torch.randint(0, 256, (2, 32), generator=g) for _ in range(2))

    def grads(recompute, offload):
        torch.manual_seed(0)
        model = LlamaModel(dataclasses.replace(config, recompute_modules=recompute))
        store = OffloadStore([model])
        with store.packing("k") if offload else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            out = model(input_ids=ids, labels=labels)
        store.offload("k")
        store.reload("k")
        out.sum().backward()
        store.release("k")
        return torch.cat([p.grad.flatten() for p in model.parameters()])
    assert torch.equal(grads(modules, True), grads((), False))
