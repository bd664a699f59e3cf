"""What the forward keeps for the backward when a fusion executor runs its elementwise ops:
``kept_after_fusion(kept, elementwise_inputs, made_in, nbytes) -> kept``.

:mod:`~fsdp_pass.plan.saved_tensors` asks Thunder's autodiff what each op keeps, op by op, as the torch executor
runs them. A fusion executor (torchcompile, nvFuser: the CUDA lowering) runs a chain of elementwise ops as one
kernel, and Thunder's rematerialization then keeps the chain's inputs and recomputes the rest in the backward's
fusion wherever that keeps no more bytes: a norm keeps its input and not its normalized product, a SwiGLU its gate
and up projections and not their product, a mixed-precision op none of its float32 copies. So, under fusion:

1. an elementwise op's own intermediates (``Saved.inside_bytes``: its decomposition's casts and temporaries) are
   not kept (the caller leaves them out);
2. a kept tensor an elementwise op made is replaced by the tensors its chain of elementwise ops starts from (the
   *roots*: results of other ops, or of another piece, or tensors kept anyway), where those add no more bytes
   than it: the latest first, so a chain is followed back as far as it pays.

An op is elementwise (:func:`is_elementwise`) when it is neither a matmul, an attention nor a view, and each of
its floating-point results is as large as its largest tensor argument (reductions, embeddings and losses are not).
The dry run's CUDA lowering of the zoo's Llama is the check (``tests/test_auto_plan.py``).
"""

from __future__ import annotations

from thunder.core.proxies import TensorProxy

from fsdp_pass.plan.op_flops import is_attention, is_matmul_like
from fsdp_pass.predicates import is_float_tensor, is_view_like

FUSION_EXECUTORS = ("torchcompile", "nvfuser")


def fuses_elementwise(executors) -> bool:
    """Whether ``executors`` (Thunder's executor list) fuse elementwise ops."""
    return any(getattr(ex, "name", None) in FUSION_EXECUTORS for ex in executors or ())


def is_elementwise(bsym) -> bool:
    if is_matmul_like(bsym) or is_attention(bsym) or is_view_like(bsym):
        return False
    args = [p for p in bsym.flat_proxy_args if isinstance(p, TensorProxy)]
    outs = [o for o in bsym.flat_proxy_outs if is_float_tensor(o)]
    if not args or not outs:
        return False
    largest = max(int(p.numel) for p in args)
    return all(int(o.numel) == largest for o in outs)


def kept_after_fusion(kept: set[str], elementwise_inputs: dict[str, tuple[str, ...]], made_in: dict[str, int],
                      nbytes) -> set[str]:
    """``kept`` (result names) as a fusion executor keeps them (module docstring, item 2). ``elementwise_inputs``:
    per result of an elementwise op, the results it read (views taken as what they view); ``made_in``: every
    result's piece, in the order the trace made them; ``nbytes(name)``: a result's bytes."""
    out = set(kept)
    order = {name: i for i, name in enumerate(made_in)}
    for name in sorted((k for k in kept if k in elementwise_inputs), key=order.get, reverse=True):
        roots, todo, seen = set(), [name], set()
        while todo:
            x = todo.pop()
            if x in seen or x not in made_in:  # not made by the trace (an input of the step): held anyway
                continue
            seen.add(x)
            if x != name and (x in out or x not in elementwise_inputs or made_in[x] != made_in[name]):
                roots.add(x)
            else:
                todo.extend(elementwise_inputs.get(x, ()))
        if sum(nbytes(r) for r in roots - out) <= nbytes(name):
            out.discard(name)
            out |= roots
    return out
