"""The step model's memory points (``step_model.peak_of``) against what the final traces hold there, on hand-made
unit costs: each test names the buffer the memory report (``fsdp_pass.report.memory``) follows and the model once
counted elsewhere."""

from __future__ import annotations

from fsdp_pass.plan.candidate_costs import Candidate, UnitCost
from fsdp_pass.plan.step_model import peak_of


def _unit(gathered, grads, acts, shard=0):
    return UnitCost(gathered, grads, shard, acts, 0.0, 0.0, 0.0)


def test_the_outputs_gradients_live_through_the_last_units_backward_only():
    """The backward receives the gradients of the forward's outputs (the logits' where the loss is computed outside
    the model) and frees them once the last unit's ops have read them (the memory report's rule 5: torch's
    autograd engine keeps no reference). Counted through the whole backward, they put the zoo Llama's predicted
    peak (d 512, vocab 8000, 2 x 256 tokens, CPU, world 1) at layer 7's backward, 15.6 MiB above the traces
    there."""
    names = ["u0", "u1"]
    no_prefetch = Candidate((0, 1), (True, True), prefetch=0)
    units = [_unit(100, 10, 10), _unit(10, 10, 10)]
    # u0's backward start: u1's reduce-scatter in flight, u0 gathered again, its activations; the outputs'
    # gradient (50) is gone by then
    assert peak_of(units, no_prefetch, names, 0, output_grad=50) == (10 + 100 + 10, "backward of u0")
    # the last unit's backward start holds it: its parameters, every activation, the outputs' gradient
    assert peak_of(units, no_prefetch, names, 0, output_grad=200) == (10 + 20 + 200, "backward of u1")
