"""The step model's memory points (``step_model.peak_of``) against what the final traces hold there, on hand-made
unit costs: each test names the buffer the memory report (``fsdp_pass.report.memory``) follows and the model once
counted elsewhere."""

from __future__ import annotations

from fsdp_pass.cost.candidate_costs import Candidate, UnitCost
from fsdp_pass.cost.step_model import peak_of


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


def test_a_loss_the_forward_computes_has_its_backward_before_the_last_units_with_no_gather_issued():
    """A loss inside the model (a Hugging Face model fed labels) is the ops after the forward's last parameter read:
    its backward runs first, the outputs' gradient (the logits') beside the gradient one of its ops receives and
    the one it makes (each as large as its largest result: nll's and log-softmax's), every activation and the kept
    units, the last one only where kept; the schedule issues no backward gather above it. The last unit's own
    backward then starts without what the loss kept (its log-probabilities). HF d512 (CPU, world 1): the model said
    283.9 MiB for both choices at the head's backward (3 x the logits for the loss's working set on top of their
    gradient, the layer-7 gather prefetched, the log-probabilities still kept); the traces 255.4 kept, 239.8
    resharded, at the loss's backward."""
    from dataclasses import replace

    names = ["u0", "u1"]
    units = [_unit(10, 10, 100), replace(_unit(30, 30, 40), tail_working=2 * 20, tail_activations=20)]
    head_kept, head_resharded = Candidate((0, 1), (True, False)), Candidate((0, 1), (True, True))
    at = "the loss's backward, before u1's"
    # every activation (140), the outputs' gradient (20), two results of the loss (40); u1's 30 where kept, and not
    # u0's 10, which the prefetch would issue at the top of the backward
    assert peak_of(units, head_kept, names, 0, output_grad=20) == (140 + 20 + 40 + 30, at)
    assert peak_of(units, head_resharded, names, 0, output_grad=20) == (140 + 20 + 40, at)
    # u1's own backward start: gathered (30), u0's gather issued (10), activations less the loss's (120), the
    # outputs' gradient summed with the loss's (20), its working set (0 here): below the loss's point
    bigger_head = [units[0], replace(units[1], gathered=60)]
    assert peak_of(bigger_head, head_resharded, names, 0, output_grad=20) == (60 + 10 + 120 + 20, "backward of u1")


def test_a_units_backward_holds_the_gradient_it_receives_and_one_it_makes():
    """On the unfused lists each op's backward frees the saved activations it read as it makes the next gradients:
    beside its start a unit's backward holds the gradient it receives (its results' that later units read, one
    buffer once the next norm's reduction has summed them) and the one an op makes from it (its largest result).
    The zoo Llama's layer 7 (d 512, CPU, world 2, head resharded): 1 + 2.7 MiB in the traces, where three of the
    MLP's hidden results (8.1 MiB) were counted."""
    from fsdp_pass.cost.candidate_costs import unit_costs
    from fsdp_pass.cost.cost_model import DEFAULTS
    from fsdp_pass.cost.step_summary import Piece, StepSummary

    def piece(name, largest, passed_on=()):
        return Piece(name, (name,), name, 10, 10, 5, 1.0, 50, largest_result_bytes=largest, passed_on=passed_on)

    summary = StepSummary((piece("a", 8, ((1, 3), (1, 2))), piece("b", 4)), ranks=2)
    a, b = unit_costs(summary, Candidate((0, 1), (True, True)), DEFAULTS["cpu-gloo"])
    assert (a.working, a.received) == (8 + 3, 3)  # one result made, the larger of the two it passed on
    assert b.received == 0  # the last unit receives the outputs' gradients (step_model's output_grad)


def test_activations_a_later_units_backward_reads_last_are_freed_there():
    """A block's output, which the next norm keeps (and the next norm's reduction, charged to the block: it comes
    after its last parameter read, so its backward runs before the block is gathered again), is freed by the later
    unit's backward: the zoo Llama's layer 7 backward start (world 2) held 2 MiB fewer activations in the traces
    than the model counted."""
    from dataclasses import replace

    names = ["u0", "u1"]
    no_prefetch = Candidate((0, 1), (True, True), prefetch=0)
    u0, u1 = _unit(100, 40, 50), _unit(10, 40, 10)
    # u0's backward start: u1's reduce-scatter buffer in flight, u0 gathered, its 50 of activations
    assert peak_of([u0, u1], no_prefetch, names, 0) == (40 + 100 + 50, "backward of u0")
    # 20 of them are read last by u1's backward, which frees them
    assert peak_of([replace(u0, freed_later=((1, 20),)), u1], no_prefetch, names, 0) == (40 + 100 + 30,
                                                                                        "backward of u0")


def test_over_one_rank_gathers_are_not_prefetched_and_the_unpack_holds_the_buffer_beside_its_copies():
    """Over a group of one rank the schedule packs each gather's buffer right before its use (it moves nothing):
    no gather is issued ahead. Where a unit has several parameters, its unpack copies them out of the gathered buffer,
    which lives until the unpack ends: twice the unit's gathered bytes for that moment, the next unit's buffer
    (at world 2 issued right after) not yet issued. The zoo Llama's layers (world 1): the unpack of layer 7 in the
    backward, 2 x 12.1 MiB; the model counted the layer once and the prefetched layer 6 beside it."""
    from dataclasses import replace

    names = ["u0", "u1", "u2"]
    units = [_unit(20, 10, 1, shard=10), _unit(40, 10, 1, shard=10), _unit(10, 10, 1, shard=10)]
    resharded = Candidate((0, 1, 2), (True, True, True), prefetch=1)
    # two ranks, u1's backward start: u2's gradient shard and its buffer in flight (10 + 10), u1 gathered (40), u0's
    # prefetched gather (20), two units' activations
    assert peak_of(units, resharded, names, 0) == (10 + 10 + 40 + 20 + 2, "backward of u1")
    one_rank = [replace(u, reduced_in_place=True) for u in units]
    # one rank: no gather ahead, u2's buffer is its shard
    assert peak_of(one_rank, resharded, names, 0) == (10 + 40 + 2, "backward of u1")
    copies = [replace(u, copies_out=True) for u in one_rank]
    assert peak_of(copies, resharded, names, 0) == (10 + 2 * 40 + 2, "backward of u1")


def test_a_kept_unit_whose_backward_reads_no_parameter_is_not_held_through_the_backward():
    """ZeRO-2 keeps a unit gathered for its backward, but where that backward reads none of its parameters (an
    embedding's gradient reads its indices only) the forward saves nothing of it: the gathered buffer is freed
    after the forward's last read, as a resharded unit's. The explain model (vocab 256, d 64, world 2, ZeRO-2):
    the traces' backward starts with the layers' and the head's gathered parameters and not the embedding's 64 KiB,
    which the model counted through the whole backward (its peak 2.9 % above the traces)."""
    from dataclasses import replace

    names = ["u0", "u1"]
    units = [replace(_unit(30, 10, 10), reads_params=False), replace(_unit(10, 10, 10), tail_working=100)]
    at = "the loss's backward, before u1's"
    # every activation (20), u1's parameters (10), the loss's working set (100): u0's 30 freed in the forward
    for reshard_u0 in (False, True):
        assert peak_of(units, Candidate((0, 1), (reshard_u0, False)), names, 0) == (20 + 10 + 100, at)


def test_what_the_loss_inside_the_model_freed_is_not_freed_again_by_the_last_units_backward():
    """The results a loss inside the model keeps (the logits a mean of squares reads again, a cross-entropy's
    log-probabilities) are the last unit's activations; the loss's backward, which runs first, frees them, and the
    last unit's own backward frees the rest. Freed twice, the activations the model counted went below what the
    traces hold: a two-layer model with a mean of squared logits (world 2) predicted 6208 B at its first layer's
    backward end, where the traces hold 7456 B (its gradients and their flat buffer beside the two reduce-scatters
    in flight)."""
    from dataclasses import replace

    names = ["u0", "u1"]
    units = [_unit(0, 10, 20), replace(_unit(0, 10, 30), tail_working=4, tail_activations=30)]
    resharded = Candidate((0, 1), (True, True), prefetch=0)
    # the loss's backward: every activation (50) and its working set (4)
    assert peak_of(units, resharded, names, 0) == (20 + 30 + 4, "the loss's backward, before u1's")
    # u0's backward end: u1's reduce-scatter buffer in flight (10), u0's activations freed by its ops, its gradients
    # and their flat buffer (40 + 40)
    bigger_grads = [replace(units[0], grads=40), units[1]]
    assert peak_of(bigger_grads, resharded, names, 0) == (10 + 40 + 40, "backward of u0")
    # u0's backward start with u1's 30 of activations counted once: its own 20, u1's buffer in flight (10)
    wider = [replace(units[0], working=50), units[1]]
    assert peak_of(wider, resharded, names, 0) == (10 + 20 + 50, "backward of u0")


def test_an_op_that_keeps_its_own_output_is_charged_it_once():
    """Thunder's autodiff traces an op with a gradient rule of its own again, under new names (a tanh's output t0 is
    t1 there): read by name, the tanh's kept output was taken for a tensor made inside it, and counted again where
    the next linear keeps the same tensor as its input (512 B a layer of the two-layer model above)."""
    import torch
    from torch import nn

    from fsdp_pass.functional import functional_trace
    from fsdp_pass.cost.saved_tensors import saved_by_op

    _, trace = functional_trace(nn.Sequential(nn.Linear(4, 4), nn.Tanh()), torch.randn(2, 4))
    (tanh,) = [b for b in trace.bound_symbols if b.sym.name == "tanh"]
    saved = saved_by_op(tanh, lambda p: True)
    assert (saved.inputs, saved.outputs, saved.inside_bytes) == ((), (0,), 0)
