"""The cluster model (``casync.model.cluster``, ``CostModel.cluster``, ``casync.model.simulate``):
what it charges, and the choice between the flat and hierarchical topologies."""

from __future__ import annotations

import pytest

from casync.model.cluster import ASSUMPTIONS, RESTS_ON
from casync.model.costmodel import CostModel
from casync.model.models import TIMINGS, layers
from casync.model.planner import choose_level
from casync.model.simulate import Gradient, ready_times, simulate
from casync.plan import StaticPlanner


def test_every_assumption_has_a_source_and_every_strategy_names_its_own():
    for a in ASSUMPTIONS.values():
        assert a.value > 0 and a.what and len(a.source) > 20, a
    for strategy, keys in RESTS_ON.items():
        assert keys and set(keys) <= set(ASSUMPTIONS), strategy


def test_ring_dgc_runs_one_ring_per_partition():
    cost = CostModel.cluster(16, 8, 25e9, ("dgc",))
    planner = StaticPlanner("dgc", "ring", min_compress=262144)  # 4 MB partitions
    grads = [Gradient("w", 3 << 20), Gradient("b", 1000)]
    rings = simulate(cost, 16, grads, "casync", coalesce=False, fuse_raw=True,
                     planner=planner).units
    # 12 MB: three rings, not one per 65,536-element ring piece (48)
    assert [u.numel for u in rings if u.plan.compress] == [1 << 20] * 3
    # the engine itself still spreads a lone large tensor over every hop
    engine = simulate(cost, 16, grads, "casync", planner=planner).units
    assert sum(u.numel for u in engine if u.plan.compress) == 3 << 20


@pytest.mark.parametrize("model", ["resnet50", "vgg19", "bert-large", "lstm"])
@pytest.mark.parametrize("rate", [25e9, 100e9])
def test_kernels_that_share_the_gpu_with_backward_are_never_free(model, rate):
    cost = CostModel.cluster(16, 8, rate, ("onebit", "dgc"))
    backward = TIMINGS[model].backward_ms / 1e3
    grads = ready_times(layers(model), backward)
    for strategy, kwargs in [("casync", {"planner": StaticPlanner("onebit", "ps")}),
                             ("casync", {"planner": StaticPlanner("dgc", "ring"),
                                         "coalesce": False, "fuse_raw": True}),
                             ("powersgd", {}), ("allreduce", {})]:
        result = simulate(cost, 16, grads, strategy, **kwargs)
        # The GPU did backward and every kernel: the iteration's GPU part is no shorter.
        assert result.finish >= backward + result.kernels - 1e-9, (strategy, result)
        assert result.backward_end >= backward - 1e-9
    # BytePS compresses on the CPU: its kernels leave backward alone
    byteps = simulate(cost, 16, grads, "byteps", algorithm="onebit")
    assert byteps.kernels == 0 and byteps.backward_end == pytest.approx(backward)


def test_a_measured_profile_without_backward_on_its_lane_is_unchanged():
    cost = CostModel.cluster(4, 1, 10e9)
    cost.shares_compute = False
    grads = [Gradient("a", 1 << 20, 0.01), Gradient("b", 1 << 20, 0.02)]
    result = simulate(cost, 4, grads, "casync", planner=StaticPlanner("onebit", "ps"),
                      chunk_elems=1 << 20)  # a chunk per tensor
    assert [u.ready for u in result.units] == [0.01, 0.02]
    assert result.backward_end == 0.02 and result.kernels > 0


def test_the_planner_chooses_hierarchical_on_nvlink_and_flat_on_a_slow_node():
    grads = ready_times(layers("resnet50"), TIMINGS["resnet50"].backward_ms / 1e3)
    nvlink = CostModel.cluster(4, 8, 25e9, ("onebit",))
    _, fast = choose_level(nvlink, 4, grads)
    assert fast.level == "hierarchical"
    # a node whose ranks talk more slowly to each other than across the network
    slow = CostModel.cluster(4, 8, 25e9, ("onebit",), intra_Bps=0.2e9)
    _, result = choose_level(slow, 4, grads)
    assert result.level == "flat" and result.finish < fast.finish * 20
    _, single = choose_level(CostModel.cluster(4, 1, 25e9, ("onebit",)), 4, grads)
    assert single.level == ""
