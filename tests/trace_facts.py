"""Facts about printed/final traces that structure tests assert on (counts, order, sizes)."""

from __future__ import annotations

from fsdp_pass.predicates import is_all_gather, is_reduce_scatter, is_return, is_wait


def gathers(trace):
    return [b for b in trace.bound_symbols if is_all_gather(b)]


def reduce_scatters(trace):
    return [b for b in trace.bound_symbols if is_reduce_scatter(b)]


def waits(trace):
    return [b for b in trace.bound_symbols if is_wait(b)]


def input_numels(bsyms):
    return [b.flat_proxy_args[0].numel for b in bsyms]


def every_collective_waited_once(trace) -> bool:
    issued = {b.output.name for b in trace.bound_symbols if is_all_gather(b) or is_reduce_scatter(b)}
    waited = [b.args[0].name for b in trace.bound_symbols if is_wait(b)]
    return sorted(waited) == sorted(issued) and len(set(waited)) == len(waited)


def _saved_tensors(forward_trace):
    (ret,) = [b for b in forward_trace.bound_symbols if is_return(b)]
    return ret.args[1][0]


def saved_for_backward_shapes(forward_trace):
    return [tuple(t.shape) for t in _saved_tensors(forward_trace)]


def saved_for_backward_names(forward_trace):
    return [t.name for t in _saved_tensors(forward_trace)]
