"""What Thunder's autodiff keeps of one forward op for the backward: ``saved_by_op(bsym) -> Saved | None``.

The step model counts a step's activations op by op on the functional forward trace, where an op is what the
module called (``layer_norm``, ``gelu``, ``scaled_dot_product_attention``). Thunder differentiates an op without
a rule of its own through its decomposition, and then keeps the decomposition's intermediates: a tanh GELU keeps
five tensors of its input's size, a layer norm five of its input's, an attention computed op by op its scores
several times. Guessing that from the op's inputs undercounted a tiny GPT-2's activations by half (its auto plan
measured 147,800 B against a 122,544 B budget). So each op is asked of Thunder itself:

1. The op alone is traced on fresh proxies of its tensor arguments (each requiring a gradient where the
   step differentiates it: the caller says, since a functional trace marks its parameters only), returning
   its outputs.
2. Thunder's own autodiff runs on it (``grad_transform_on_trace``, ``split_into_forward_and_backward``, with
   the executor list of the compile under way, so an executor's own gradient rule is used where it would be:
   a fused attention keeps a log-sum-exp, not its scores); what the forward returns for the backward is what
   the step keeps of this op.
3. Each kept tensor, a view or a shallow copy taken as the tensor it shares memory with (a broadcast norm weight is its own bytes, not the
   activation's), is one of the op's tensor arguments (by position), one of its outputs (by position, as the
   differentiated forward returns them: an op with a gradient rule of its own is traced again there under new
   names), or made inside the op (its bytes).

Answers are cached by the op's symbol, its tensor arguments' shapes and dtypes, which of them need a gradient, its other
arguments and the executors: the layers of a model repeat, so a 32-layer model asks about each op once. An op
Thunder cannot differentiate alone gives None (the caller falls back to an estimate).
"""

from __future__ import annotations

from dataclasses import dataclass

import thunder
import torch
from thunder.common import CompileData
from thunder.core import dtypes, prims
from thunder.core.compile_data import compile_data_and_stats, get_compile_data
from thunder.core.proxies import TensorProxy
from thunder.core.pytree import tree_flatten, tree_map
from thunder.transforms.autodiff import grad_transform_on_trace, split_into_forward_and_backward

from fsdp_pass.predicates import is_return, is_view_like


@dataclass(frozen=True)
class Saved:
    """What one op keeps for its backward."""

    inputs: tuple[int, ...]  # positions among the op's tensor arguments (``flat_proxy_args`` order)
    outputs: tuple[int, ...]  # positions among its tensor outputs
    inside_bytes: int  # tensors made inside the op (its decomposition's intermediates)
    # positions of the tensor arguments kept as a dtype conversion of themselves (a bfloat16 argument's float32
    # upcast, whose bytes are in ``inside_bytes``): a fusion executor recomputes the conversion in the backward's
    # kernel, and keeps the argument instead (fused_saves)
    converted: tuple[int, ...] = ()


_CACHE: dict = {}


def _tensor_args(bsym) -> list[TensorProxy]:
    return [p for p in bsym.flat_proxy_args if isinstance(p, TensorProxy)]


def _key(bsym, grads: tuple[bool, ...], executors) -> tuple:
    def describe(x):
        if isinstance(x, TensorProxy):
            return ("T", tuple(int(s) for s in x.shape), str(x.dtype))
        return repr(x)

    flat, _ = tree_flatten((bsym.args, bsym.kwargs))
    return (bsym.sym.id, tuple(describe(x) for x in flat), grads, tuple(getattr(e, "name", str(e)) for e in executors))


def _executors():
    cd = get_compile_data()
    if cd is not None and cd.executors_list is not None:
        return tuple(cd.executors_list)
    return tuple(thunder.get_default_executors())


def _kept_of_op_alone(bsym, grads: tuple[bool, ...], executors):
    """(argument names, output names, kept tensors, {a kept tensor's name: the argument it converts}) of the op
    traced alone and differentiated by Thunder."""
    args = _tensor_args(bsym)
    names = [p.name for p in args]
    metas = [
        torch.empty(tuple(int(s) for s in p.shape), dtype=dtypes.to_torch_dtype(p.dtype), device="meta",
                    requires_grad=g)
        for p, g in zip(args, grads)
    ]

    def op_alone(*tensors):
        new = dict(zip(names, tensors))
        a, k = tree_map(lambda x: new[x.name] if isinstance(x, TensorProxy) else x, (bsym.args, bsym.kwargs))
        out = bsym.sym(*a, **k)
        return {"output": tuple(out) if isinstance(out, (tuple, list)) else (out,), "flat_args": list(tensors)}

    cd = CompileData(fn=op_alone, executors_list=executors, disable_preprocessing=True)
    with compile_data_and_stats(cd, None):
        trace = thunder.trace(inline_trace=False)(op_alone, *metas)
        forward, _ = split_into_forward_and_backward(grad_transform_on_trace(trace))
    (ret,) = [b for b in forward.bound_symbols if is_return(b)]
    kept, _ = tree_flatten(ret.args[1])
    # the outputs as the differentiated forward names them: an op with a gradient rule of its own is traced again
    # under a new name there (a tanh keeps its output as t1, which the op alone returned as t0)
    outs, _ = tree_flatten(ret.args[0]["output"])
    viewed: dict[str, TensorProxy] = {}  # a view's name -> the tensor whose memory it shares
    converts: dict[str, str] = {}  # a dtype conversion's (or a view of one's) name -> the tensor it converts
    for b in forward.bound_symbols:
        src = [p for p in b.flat_proxy_args if isinstance(p, TensorProxy)]
        if not src:
            continue
        first = viewed.get(src[0].name, src[0])
        # a view, or a shallow copy (a new name for the same tensor: a decomposed attention keeps its
        # probabilities under two names, which counted its b*h*s*s scores twice)
        if is_view_like(b) or b.sym.id == prims.PrimIDs.SHALLOW_COPY:
            for o in b.flat_proxy_outs:
                if isinstance(o, TensorProxy):
                    viewed[o.name] = first
                    if src[0].name in converts:
                        converts[o.name] = converts[src[0].name]
        elif b.sym.id == prims.PrimIDs.CONVERT_ELEMENT_TYPE:
            converts[b.output.name] = converts.get(first.name, first.name)
    kept = [viewed.get(t.name, t) for t in kept if isinstance(t, TensorProxy)]
    arg_names = [p.name for p in trace.args]
    converted = {t.name: converts[t.name] for t in kept if converts.get(t.name) in arg_names}
    return arg_names, [viewed.get(o.name, o).name for o in outs if isinstance(o, TensorProxy)], kept, converted


def saved_by_op(bsym, needs_grad) -> Saved | None:
    """What Thunder keeps of ``bsym`` (an op of a functional forward trace) for its backward (module docstring);
    None where it cannot be asked. ``needs_grad(proxy)``: whether the step differentiates that tensor argument
    (a functional trace marks its parameters only)."""
    grads = tuple(bool(needs_grad(p)) and dtypes.is_float_dtype(p.dtype) for p in _tensor_args(bsym))
    if not any(grads):
        return Saved((), (), 0)  # nothing to differentiate: nothing kept
    executors = _executors()
    key = _key(bsym, grads, executors)
    if key not in _CACHE:
        try:
            arg_names, out_names, kept, converted = _kept_of_op_alone(bsym, grads, executors)
        except Exception:  # an op Thunder cannot differentiate on its own (a custom op, a data-dependent one)
            _CACHE[key] = None
        else:
            position = {n: i for i, n in enumerate(arg_names)}
            out_position = {n: i for i, n in enumerate(out_names)}
            ins, outs, inside, seen, conv = [], [], 0, set(), set()
            for t in kept:
                if t.name in seen:
                    continue
                seen.add(t.name)
                if t.name in position:
                    ins.append(position[t.name])
                elif t.name in out_position:
                    outs.append(out_position[t.name])
                else:
                    inside += int(t.numel) * t.dtype.bytes
                    if t.name in converted:
                        conv.add(position[converted[t.name]])
            _CACHE[key] = Saved(tuple(sorted(ins)), tuple(sorted(outs)), inside, tuple(sorted(conv)))
    return _CACHE[key]
