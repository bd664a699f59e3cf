"""Values known while tracing (:mod:`fsdp_pass.models.trace_values`), on small functions: what has a value, what
does not, and the prologue check that keeps a compile to the calls its decision holds for."""

import thunder
import torch

from fsdp_pass.models.trace_values import hold_on_every_call, known_value

seen = []


def probe(x):
    """A lookaside: records what ``known_value`` says of ``x``."""
    seen.append(known_value(x))
    return x


def _traced(fn, *args):
    seen.clear()
    jitted = thunder.jit(fn)
    thunder.compile_data(jitted).executor_lookasides[probe] = probe
    jitted(*args)
    return list(seen)


def test_positions_made_from_numbers_have_their_value():
    def packed(x):  # two documents of 4 tokens in one row: not counting up by one
        return x + probe(torch.arange(4).expand(2, 4).reshape(1, 8))

    (known,) = _traced(packed, torch.zeros(1, 8, dtype=torch.long))
    assert known.argument is None and known.value.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]]


def test_a_chain_on_the_meta_device_is_replayed_on_the_cpu():
    def descending(x):
        return x + probe(x.shape[1] - torch.arange(x.shape[1], device=x.device)).unsqueeze(0)

    (known,) = _traced(descending, torch.zeros(1, 3, dtype=torch.long, device="meta"))
    assert known.value.device.type == "cpu" and known.value.tolist() == [3, 2, 1]


def test_a_value_made_from_one_argument_is_this_calls():
    def masked(x, mask):
        return x * probe(mask.to(torch.bool))

    mask = torch.tensor([[1, 1, 0]])
    (known,) = _traced(masked, torch.ones(1, 3), mask)
    assert known.argument is not None and known.value.tolist() == [[True, True, False]]
    assert known.replay(torch.tensor([[0, 1, 1]])).tolist() == [[False, True, True]]


def test_no_value_from_parameters_two_arguments_random_ops_or_meta_arguments():
    linear = torch.nn.Linear(3, 3)

    class Reads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = linear

        def forward(self, x, y):
            probe(self.linear.weight * 2)  # a parameter
            probe(x + y)  # two arguments
            probe(torch.rand(3) + 1)  # a random op
            return x

    assert _traced(Reads(), torch.ones(3), torch.ones(3)) == [None, None, None]
    assert _traced(lambda x: probe(x + 1), torch.ones(3, device="meta")) == [None]


def all_ones(mask):
    """A lookaside deciding on the mask's value, the decision held by the prologue."""
    known = known_value(mask)
    ones = bool(known.value.all())
    assert hold_on_every_call(known, lambda value: bool(value.all()), ones, "test: all ones")
    return ones


def test_the_prologue_holds_the_decision_a_compile_was_made_for():
    def scaled(x, mask):
        return x * 2 if all_ones(mask.to(torch.bool)) else x * 3

    jitted = thunder.jit(scaled)
    thunder.compile_data(jitted).executor_lookasides[all_ones] = all_ones
    x, results = torch.ones(2), []
    for mask in ([1, 1], [1, 0], [1, 1], [0, 1], [1, 1]):
        results.append((float(jitted(x, torch.tensor(mask))[0]), thunder.cache_misses(jitted)))
    assert results == [(2.0, 1), (3.0, 2), (2.0, 2), (3.0, 2), (2.0, 2)]
    assert "fsdp_pass_decision_holds(mask, 'test: all ones #" in str(thunder.last_prologue_traces(jitted)[-1])
