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


def test_the_callers_loss_is_a_point_before_the_backward_with_the_last_unit_as_the_forward_left_it():
    """A loss computed outside the model (the forward returns its logits) runs before the backward trace: its
    log-probabilities and their gradient (``loss``) beside the outputs' gradient, every activation and the units
    kept gathered, the last one only where it is kept, and no backward gather yet. The traces of the zoo Llama (d
    512, vocab 8000, 2 x 256 tokens, CPU, world 1) peak there: 264.1 MiB with the head kept, 248.4 resharded; the
    model, without this point, gave both choices the same peak."""
    names = ["u0", "u1"]
    units = [_unit(10, 10, 100), _unit(30, 30, 10)]
    head_kept, head_resharded = Candidate((0, 1), (True, False)), Candidate((0, 1), (True, True))
    at = "the caller's loss, before the backward"
    assert peak_of(units, head_kept, names, 0, output_grad=20, loss=40) == (30 + 110 + 20 + 40, at)
    assert peak_of(units, head_resharded, names, 0, output_grad=20, loss=40) == (110 + 20 + 40, at)
    # without a caller's loss the point is below the last unit's backward start (its parameters gathered there)
    assert peak_of(units, head_resharded, names, 0, output_grad=20)[1] == "backward of u1"


def test_over_one_rank_no_reduce_scatter_buffer_is_in_flight_beside_the_gradient_shard():
    """Over a group of one rank a reduce-scatter returns its input: the flat gradient buffer is the gradient shard,
    held to the optimizer's step, and no second buffer waits in flight. Counted twice, the head's 15.6 MiB put the
    zoo Llama's predicted peak (world 1, CPU) at layer 7's backward, above the traced peak at the caller's loss."""
    from dataclasses import replace

    names = ["u0", "u1"]
    no_prefetch = Candidate((0, 1), (True, True), prefetch=0)
    units = [_unit(100, 10, 10, shard=10), _unit(10, 50, 10, shard=50)]
    # u0's backward start at 2 ranks: u1's shard and its flat buffer in flight, u0 gathered, its activations
    assert peak_of(units, no_prefetch, names, 0) == (50 + 50 + 100 + 10, "backward of u0")
    one_rank = [replace(u, reduced_in_place=True) for u in units]
    assert peak_of(one_rank, no_prefetch, names, 0) == (50 + 100 + 10, "backward of u0")
