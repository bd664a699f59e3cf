"""Integer inputs the traced step indexes with where torch needs int64: an FSDPError naming them, before the compile.

``check_index_inputs(prologue, computation, names)`` runs on Thunder's first traces of a step, before the pass
rewrites them and before Thunder derives the backward, lowers and compiles it (stage 0 of :mod:`fsdp_pass.pipeline`).

torch takes int32 token ids where it looks rows up (``embedding``, ``index_select``, indexing), so int32 ids are
traced and run as int64 ids are. Some ops take int64 only: ``cross_entropy`` and ``nll_loss``'s class targets,
``take_along_dim``, ``index_copy``, ``one_hot``. An int32 ``labels`` would trace, compile for a minute and then fail
at run time ("dtype of indices should be Long but got Int").

1. Every op of the computation trace, at any depth of its decomposition, that is one of those and reads an integer
   tensor other than int64 marks the top-level op it belongs to.
2. From that op's integer tensors, the producers are followed back (through ops that keep the dtype) to the
   trace's inputs; the prologue says which argument each input is (``kwargs['labels']`` -> ``keyword argument
   labels``).
3. The first such input found is an FSDPError naming it, the op that needs int64, and the fix.
"""

from __future__ import annotations

from thunder.core import dtypes, prims, utils
from thunder.core.proxies import TensorProxy

from fsdp_pass.errors import fail
from fsdp_pass.predicates import is_bookkeeping
from fsdp_pass.shard.input_checks import argument_label

# ops whose torch kernels take int64 indices only (their ids, as the traces name them before lowering)
NEEDS_INT64 = frozenset({
    "torch.nn.functional.cross_entropy",
    "torch.nn.functional.nll_loss",
    "torch.nn.functional.one_hot",
    "torch.take_along_dim",
    "torch.index_copy",
    prims.PrimIDs.TAKE_ALONG_AXIS,
    prims.PrimIDs.INDEX_COPY,
})


def _narrow_integers(bsym) -> list[TensorProxy]:
    """The integer (not bool) tensors ``bsym`` reads that are not int64."""
    return [p for p in bsym.flat_proxy_args if isinstance(p, TensorProxy) and dtypes.is_exact_dtype(p.dtype)
            and not dtypes.is_boolean_dtype(p.dtype) and p.dtype not in (dtypes.int64, dtypes.int64_)]


def _needing_int64(bsym):
    """The first op in ``bsym`` (itself, or any depth of its decomposition) that takes int64 indices only and reads a
    narrower integer tensor; None if there is none."""
    if bsym.sym.id in NEEDS_INT64 and _narrow_integers(bsym):
        return bsym
    for sub in bsym.subsymbols:
        found = _needing_int64(sub)
        if found is not None:
            return found
    return None


def _inputs_behind(proxy, producers, input_names: set[str]) -> list[str]:
    """The trace inputs of ``proxy``'s dtype that it is computed from (itself, if it is one)."""
    seen, todo, found = set(), [proxy], []
    while todo:
        p = todo.pop()
        if p.name in seen:
            continue
        seen.add(p.name)
        if p.name in input_names:
            found.append(p.name)
            continue
        producer = producers.get(p, None)
        if producer is not None:
            todo += [a for a in producer.flat_proxy_args if isinstance(a, TensorProxy) and a.dtype == proxy.dtype]
    return found


def _labels_of_inputs(prologue, computation, names) -> dict[str, str]:
    """Computation input name -> the argument it is (``argument 0 (idx)``, ``keyword argument labels``), read off
    the prologue's chain of ``args[i]`` / ``kwargs[key]`` / ``[key]`` unpackings."""
    producers = utils.producers(prologue)
    labels = {}
    for pro_out, comp_arg in zip(prologue.output[0], computation.args):
        keys, p = [], pro_out
        while (b := producers.get(p, None)) is not None and b.sym.id == prims.PrimIDs.UNPACK_GETITEM:
            container, key = b.args
            keys.insert(0, key)
            p = container
        root = getattr(p, "name", None)
        if keys and root in ("args", "kwargs"):
            labels[comp_arg.name] = argument_label(root, keys, names)
    return labels


def check_index_inputs(prologue, computation, names: tuple[str, ...] = ()) -> None:
    """Steps 1-3 (``names``: the forward's positional parameter names, for the labels)."""
    producers = utils.producers(computation)
    labels = None
    for bsym in computation.bound_symbols:
        if is_bookkeeping(bsym):
            continue
        op = _needing_int64(bsym)
        if op is None:
            continue
        labels = labels if labels is not None else _labels_of_inputs(prologue, computation, names)
        for proxy in _narrow_integers(bsym) or _narrow_integers(op):
            for name in _inputs_behind(proxy, producers, set(labels)):
                dtype = str(proxy.dtype).removeprefix("thunder.dtypes.").rstrip("_")
                where = op.sym.name if op is bsym else f"{op.sym.name}, inside {bsym.sym.name}"
                fail(
                    f"The model's {labels[name]} is {dtype}, and the step uses it where torch takes int64 only "
                    f"({where}); it would compile, then fail at run time.",
                    f"Pass it as int64: .long() (token ids looked up by an embedding may stay {dtype}; class targets "
                    "of a loss and gather indices may not).",
                )
