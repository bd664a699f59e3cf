"""The step-by-step path the notebooks use: one process, fake group, any world size."""

import pytest

from fsdp_pass import fake_process_group
from fsdp_pass.functional import derive_backward_and_lower, functional_trace, shard_functional_trace
from tests import models
from tests.trace_facts import every_collective_waited_once, gathers, input_numels, reduce_scatters


@pytest.mark.parametrize("world_size", [3, 64])
def test_functional_steps_shard_gather_and_reduce(world_size):
    x, _ = models.batch("mlp", 3, 0)
    prologue, trace = functional_trace(models.MLP(), x)
    with fake_process_group(world_size) as group:
        sharded, plan = shard_functional_trace(prologue, trace, group, "zero3")
        forward, backward = derive_backward_and_lower(sharded)
    rows = {"fc1.weight": (32, 16), "fc1.bias": (32, 1), "fc2.weight": (16, 32), "fc2.bias": (16, 1),
            "head.weight": (4, 16), "head.bias": (4, 1)}
    shard = {n: -(-r // world_size) * c for n, (r, c) in rows.items()}
    assert [u.name for u in plan.units] == list(rows)
    assert input_numels(gathers(forward)) == list(shard.values())
    assert sorted(input_numels(reduce_scatters(backward))) == sorted(world_size * s for s in shard.values())
    assert input_numels(gathers(backward)) == [shard["head.weight"], shard["fc2.weight"]]  # zero3 re-gathers
    assert every_collective_waited_once(forward) and every_collective_waited_once(backward)
    # the sharded arguments carry the shard shapes
    args = {a.name: tuple(a.shape) for a in sharded.args}
    assert args["t_fc1_weight"] == (-(-32 // world_size), 16)
