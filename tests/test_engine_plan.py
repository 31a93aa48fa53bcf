"""The pure-Python parts: plans, the planner, schedules, flat layouts and microbatch splitting."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from rptrain.engine.batching import merge_outputs, split_inputs, split_label, split_sizes
from rptrain.engine.layout import FlatLayout, Range
from rptrain.engine.plan import ExecutePlan, LayerCost, backward_memory, forward_memory, plan_stages
from rptrain.engine.schedule import JobKind, backward_schedule, forward_schedule, training_schedule


def uniform(n: int, param_bytes: int = 100, time: float = 1.0, act: int = 10, saved: int = 50) -> list[LayerCost]:
    return [LayerCost(param_bytes, param_bytes, time, 2 * time, act, saved) for _ in range(n)]


def test_plan_from_cuts_and_views():
    plan = ExecutePlan.from_cuts(6, forward=[2, 4], backward=[1, 4])
    assert plan.forward == ((0, 2), (2, 4), (4, 6))
    assert plan.backward == ((0, 1), (1, 4), (4, 6))
    assert ExecutePlan.single_stage(3).forward == ((0, 3),)
    assert ExecutePlan.per_layer(3).backward == ((0, 1), (1, 2), (2, 3))


def test_planner_without_cap_on_one_device_is_one_fused_stage():
    assert plan_stages(uniform(8)) == ExecutePlan.single_stage(8)


def test_planner_respects_memory_cap_and_fuses_the_largest_tail():
    costs = uniform(10)
    cap = backward_memory(costs, 7, 10)  # three layers fit a backward stage, not four
    plan = plan_stages(costs, 1, cap)
    assert plan.forward[-1] == plan.backward[-1] == (7, 10)
    for a, b in plan.forward:
        assert forward_memory(costs, a, b) <= cap
    for a, b in plan.backward:
        assert backward_memory(costs, a, b) <= cap
    # Forward stages hold less (no gradients, no graph) so there are fewer of them.
    assert len(plan.forward) <= len(plan.backward)


def test_planner_balances_measured_times():
    times = [1, 1, 1, 1, 8, 1, 1, 1, 1, 1, 1, 1]
    costs = [LayerCost(100, 100, t, 2 * t) for t in times]
    plan = plan_stages(costs, num_devices=4)
    assert len(plan.forward) >= 4  # enough jobs for every device
    stage_times = [sum(times[a:b]) for a, b in plan.forward[:-1]]
    assert max(stage_times) <= 8 + 1  # the heavy layer gets (nearly) a stage of its own


def test_planner_rejects_a_layer_that_cannot_fit():
    with pytest.raises(ValueError, match="does not fit"):
        plan_stages(uniform(3, param_bytes=1000), 1, memory_cap=100)


def test_training_schedule_round_robin_and_checkpoints():
    plan = ExecutePlan.from_cuts(6, forward=[2, 4], backward=[1, 4])
    jobs = training_schedule(plan, num_devices=2)
    assert [(j.kind, j.start, j.stop, j.device) for j in jobs] == [
        (JobKind.FORWARD, 0, 2, 0),
        (JobKind.FORWARD, 2, 4, 1),
        (JobKind.FUSED, 4, 6, 0),
        (JobKind.BACKWARD, 1, 4, 1),
        (JobKind.BACKWARD, 0, 1, 0),
    ]
    # Forward jobs keep the inputs of the backward stages they contain.
    assert jobs[0].checkpoints == (0, 1) and jobs[1].checkpoints == ()
    assert jobs[3].checkpoints == (1,) and jobs[4].checkpoints == (0,)


def test_layer_grain_checkpoints_every_layer():
    plan = ExecutePlan.from_cuts(5, forward=[3], backward=[3])
    jobs = training_schedule(plan, 1, grain="layer")
    assert jobs[0].checkpoints == (0, 1, 2)
    assert jobs[-1].kind is JobKind.BACKWARD and jobs[-1].checkpoints == (0, 1, 2)


def test_forward_and_backward_schedules_for_autograd():
    plan = ExecutePlan.from_cuts(4, forward=[2], backward=[1, 2])
    fwd = forward_schedule(plan, 3, save_for_backward=True)
    assert [j.checkpoints for j in fwd] == [(0, 1), (2,)]
    bwd = backward_schedule(plan, 3, first_device=len(fwd))
    assert [(j.start, j.stop, j.device) for j in bwd] == [(2, 4, 2), (1, 2, 0), (0, 1, 1)]
    assert all(j.kind is JobKind.FORWARD and not j.checkpoints for j in forward_schedule(plan, 1))


def test_flat_layout_ranges_and_tied_slots():
    shared = nn.Parameter(torch.zeros(4, 3))
    layers = [nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 4).half(), nn.Module()]
    layers[3].w = shared
    layers[0].tied = shared
    layout = FlatLayout.of_parameters(layers)
    # Every tensor starts on a 256-byte boundary (64 fp32 / 128 fp16 elements).
    assert [(s.key, s.offset) for s in layout.slots] == [("float32", 0), ("float32", 64), ("float32", 128), ("float16", 0), ("float16", 128)]
    assert layout.sizes == {"float32": 128 + 12, "float16": 128 + 4}
    # Layer 3 owns nothing new: its only tensor lives in layer 0's range.
    assert layout.ranges(3, 4) == [Range("float32", 128, 140)]
    assert layout.ranges(0, 1) == [Range("float32", 0, 140)]  # padding does not split a range
    assert layout.ranges(2, 3) == [Range("float16", 0, 132)]
    assert layout.ranges(1, 2) == []
    assert layout.base == {"float32": 0, "float16": 192} and layout.total == 384
    assert [s.index for s in layout.slots_in_range(Range("float32", 0, 140))] == [0, 1, 2]


def test_split_sizes_are_balanced():
    assert split_sizes(7, 3) == [3, 2, 2]
    assert split_sizes(8, 4) == [2, 2, 2, 2]


def test_split_inputs_nested_and_replicated():
    x = torch.arange(10).view(5, 2)
    mask = torch.ones(3, 3)  # not batch-sized: replicated
    parts = split_inputs((x, {"m": mask, "pair": (x, 7)}), {"scale": torch.tensor(2.0)}, 2)
    assert len(parts) == 2
    (a0, k0), (a1, k1) = parts
    assert a0[0].shape[0] == 3 and a1[0].shape[0] == 2
    assert a0[1]["m"] is mask and a0[1]["pair"][1] == 7
    assert torch.equal(torch.cat([a0[1]["pair"][0], a1[1]["pair"][0]]), x)
    assert k1["scale"].item() == 2.0


@pytest.mark.parametrize("args", [
    (torch.arange(10).view(5, 2),),
    (torch.arange(10).view(5, 2), torch.ones(3, 3), torch.tensor(2.0), torch.arange(5)),  # not batch-sized, 0-dim: replicated
], ids=["one", "mixed"])
def test_flat_tensor_inputs_split_as_the_general_path_does(args):
    """Tensors-only inputs and tensor labels skip pytree (batching._split_flat): the same parts as
    through a structure that takes the general path (a dict of kwargs)."""
    n = 2
    flat = split_inputs(args, {}, n)
    general = split_inputs((), {f"a{i}": a for i, a in enumerate(args)}, n)
    for (a, k), (_, g) in zip(flat, general):
        assert k == {} and len(a) == len(args)
        for i, t in enumerate(a):
            assert torch.equal(t, g[f"a{i}"]) and (t is args[i]) == (g[f"a{i}"] is args[i])
    label = torch.arange(5)
    assert [p.tolist() for p in split_label(label, n)] == [p[0].tolist() for p in split_label((label,), n)]
    assert split_label(torch.tensor(3.0), n) == [torch.tensor(3.0)] * n  # no batch dimension: replicated


def test_tensor_walks_match_pytree():
    """map_tensors/iter_tensors open tuples, lists, dicts and namedtuples themselves (batching._plain):
    the same structure, leaves and order as torch's pytree."""
    import collections

    from torch.utils import _pytree as pytree

    from rptrain.engine.batching import iter_tensors, map_tensors
    from rptrain.engine.passstate import Args

    Pair = collections.namedtuple("Pair", "a b")
    t = torch.ones(2)
    for obj in [t, (t, 3), [t, (t, {"z": t, "a": [t]})], Args((t,), {"k": t}), Pair(t, (t, None)), {"b": t, "a": (t, 2)}, "s", None]:
        mine = map_tensors(lambda x: x + 1, obj)
        theirs = pytree.tree_map(lambda leaf: leaf + 1 if isinstance(leaf, torch.Tensor) else leaf, obj)
        (a, spec_a), (b, spec_b) = pytree.tree_flatten(mine), pytree.tree_flatten(theirs)
        assert spec_a == spec_b and type(mine) is type(theirs)
        assert all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b))
        leaves = [leaf for leaf in pytree.tree_leaves(obj) if isinstance(leaf, torch.Tensor)]
        found = list(iter_tensors(obj))
        assert len(found) == len(leaves) and all(x is y for x, y in zip(found, leaves))


def test_split_errors_name_the_problem():
    with pytest.raises(ValueError, match="num_microbatch=3 is larger than the batch size 2"):
        split_inputs((torch.zeros(2, 1),), {}, 3)
    with pytest.raises(ValueError, match="empty"):
        split_label(torch.zeros(0), 1)
    with pytest.raises(ValueError, match=r"split_input must return \(args_list, kwargs_list\)"):
        split_inputs((torch.zeros(4),), {}, 2, lambda a, k, n: [(a, k)])


def test_merge_outputs():
    """As the original library: cat along dim 0, 0-dim floats averaged, equal non-tensors once."""
    assert torch.equal(merge_outputs([torch.ones(2, 1), torch.zeros(1, 1)]), torch.tensor([[1.0], [1.0], [0.0]]))
    merged = merge_outputs([(torch.ones(1), {"s": torch.tensor(1.0)}, "tag"), (torch.ones(2), {"s": torch.tensor(2.0)}, "tag")])
    assert merged[0].shape == (3,) and merged[1]["s"].item() == 1.5 and merged[2] == "tag"
    with pytest.raises(ValueError, match="differs between microbatches"):
        merge_outputs([1, 2])
    assert merge_outputs([1, 2], sum) == 3


def moe_like(n: int = 8) -> list[LayerCost]:
    """Equal compute per layer; the first half hold 8x the weights (MoE layers before dense ones)."""
    return [LayerCost(800 if i < n // 2 else 100, 800 if i < n // 2 else 100, 1.0, 2.0, 10, 50) for i in range(n)]


def test_planner_balances_bytes_as_well_as_compute():
    costs, devices = moe_like(), 3
    by_time = plan_stages(costs, devices)
    by_bytes = plan_stages(costs, devices, transfer_rate=100.0)  # 8 s to upload an MoE layer, 1 s to compute it

    def slowest(plan, stages):  # the longest stage: its compute or its weights' upload
        return max(max(sum(c.forward_time for c in costs[a:b]), sum(c.param_bytes for c in costs[a:b]) / 100.0) for a, b in stages)

    assert slowest(by_bytes, by_bytes.forward[:-1]) < slowest(by_time, by_time.forward[:-1])
    assert len(by_bytes.forward) >= devices  # still a stage per device at least
    # Without a rate, or with transfers far faster than compute, the plan is the compute-balanced one.
    assert plan_stages(costs, devices, transfer_rate=1e12) == by_time


def test_transfer_rate_keeps_the_memory_cap():
    costs = moe_like(10)
    cap = backward_memory(costs, 0, 2)  # two MoE layers fit a backward stage
    plan = plan_stages(costs, 2, cap, transfer_rate=50.0)
    assert all(forward_memory(costs, a, b) <= cap for a, b in plan.forward)
    assert all(backward_memory(costs, a, b) <= cap for a, b in plan.backward)
