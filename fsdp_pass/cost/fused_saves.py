"""What the forward keeps for the backward when a fusion executor runs its elementwise ops:
``kept_after_fusion(kept, elementwise_inputs, made_in, nbytes, region_of, kept_in) -> kept``.

:mod:`~fsdp_pass.cost.saved_tensors` asks Thunder's autodiff what each op keeps, op by op, as the torch executor
runs them. A fusion executor (torchcompile, nvFuser: the CUDA lowering) runs a chain of elementwise ops as one
kernel, and Thunder's rematerialization then keeps the chain's inputs and recomputes the rest in the backward's
fusion wherever that keeps no more: a norm keeps its input and not its normalized product, a SwiGLU its gate
and up projections and not their product, a mixed-precision op none of its float32 copies. So, under fusion:

1. an elementwise op's own intermediates (``Saved.inside_bytes``: its decomposition's casts and temporaries) are
   not kept (the caller leaves them out);
2. a kept tensor an elementwise op made is replaced by the tensors its chain of elementwise ops starts from (the
   *roots*: results of other ops, results made in another *region*, or tensors kept anyway), where those cost
   less than it: the latest first, so a chain is followed back as far as it pays.

A region is what one fused kernel and its backward's can recompute from: a block (a decoder layer), whose gathered
parameters arrive after the previous block's kernels ran (the caller says, ``region_of``: per piece). Rematerialization
cuts each region's kernel apart from its backward's on its own (Thunder's ``find_cut``), so:

- a root made in an earlier region is an input of this one: it costs half its bytes (the cut's weight for a
  kernel's input), kept or not; a root made in this region costs its bytes unless this region keeps it anyway;
- a tie keeps the tensor itself (a residual sum, not the projection added to it: the sum is already an
  output of the kernel, the projection is not);
- a tensor that a later region's ops keep (``kept_in``: the pieces whose ops keep it), or that a later region's
  chain starts from, is kept as it is: that region's backward reads it, and cannot recompute it from what this
  region keeps (a norm's normalized input, made before the next block's weights arrive, is kept beside the
  residual it is computed from).

Measured on the dry run's CUDA lowering of the zoo's Llama-2-7B shape (2 layers, 512 tokens): per layer the
traces keep the attention's v, rotated q and k, output and log-sum-exp, both residual sums, the next norm's
normalized input, gate and up (99.1 MiB); without regions the model kept the two projections added to the
residual instead and let the next norm recompute its input from them (91.1 MiB), and the 7B's auto plan did not
fit its traces.

Under selective checkpointing the same rule runs with the copies (:func:`is_copy`) taken as elementwise too: the
checkpointed unit's backward recomputes every op but its matmuls and attentions, so grouped-query attention keeps
the k and v projections, not their repeated copies (Llama-3-8B's shape, 2 layers, 512 tokens, bf16: per layer the
traces keep 100.1 MiB at the selective level and 112.1 MiB without checkpointing, 4 x 2 MiB k and v repeated to
4 x 8 MiB; the model counted 112.0 at both before). Without checkpointing the traces keep the repeated copies
(the fused kernels do not reach past them). A dtype conversion of an elementwise op's argument (a bfloat16
tensor's float32 upcast in a norm's backward, ``Saved.converted``) is kept as the argument: the fused kernel
recomputes the conversion (before, it was dropped with the op's intermediates and the model missed a residual sum
a layer and the embedding's output: 104.0 against 112.1 MiB a layer there).

An op is elementwise (:func:`is_elementwise`) when it is neither a matmul, an attention nor a view, and each of
its floating-point results is as large as its largest tensor argument (reductions, embeddings and losses are not).
The dry run's CUDA lowering of the zoo's Llama is the check (``tests/test_dry_run_models.py``).
"""

from __future__ import annotations

from thunder.core.proxies import TensorProxy

from fsdp_pass.cost.op_flops import is_attention, is_matmul_like
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


# ops whose results are their inputs' elements, picked, repeated or laid out anew (the module's ops, as the
# functional trace names them): grouped-query attention's repeated k and v (a getitem, an expand, a reshape),
# rotary embeddings' rotate_half (two getitems and a cat)
_COPIES = frozenset(
    ("cat", "stack", "expand", "expand_as", "getitem", "narrow", "split", "chunk", "reshape", "view", "flatten",
     "unsqueeze", "squeeze", "transpose", "permute", "movedim", "contiguous", "clone", "repeat", "repeat_interleave")
)


def is_copy(bsym) -> bool:
    """An op whose results are its inputs' elements (:data:`_COPIES`): what selective checkpointing recomputes in a
    unit's backward as it does the elementwise ops, so a chain is followed back through it (the selective level's
    ``elementwise_inputs`` of :func:`kept_after_fusion`)."""
    return str(bsym.sym.name) in _COPIES


def kept_after_fusion(kept: set[str], elementwise_inputs: dict[str, tuple[str, ...]], made_in: dict[str, int],
                      nbytes, region_of=None, kept_in: dict[str, set[int]] | None = None) -> set[str]:
    """``kept`` (result names) as a fusion executor keeps them (module docstring, item 2). ``elementwise_inputs``:
    per result of an elementwise op, the results it read (views taken as what they view); ``made_in``: every
    result's piece, in the order the trace made them; ``nbytes(name)``: a result's bytes; ``region_of(piece)``: its
    region (None: each piece its own); ``kept_in``: per kept result, the pieces whose ops keep it."""
    region_of = region_of or (lambda piece: piece)
    region = lambda x: region_of(made_in[x])  # noqa: E731 - a result's region
    kept_in = kept_in or {}
    out = set(kept)
    # read by a later region's backward: kept as it is
    pinned = {k for k in kept if k in made_in and any(region_of(p) != region(k) for p in kept_in.get(k, ()))}
    order = {name: i for i, name in enumerate(made_in)}
    for name in sorted((k for k in kept if k in elementwise_inputs), key=order.get, reverse=True):
        if name in pinned or name not in out:
            continue
        roots, todo, seen = set(), [name], set()
        while todo:
            x = todo.pop()
            if x in seen or x not in made_in:  # not made by the trace (an input of the step): held anyway
                continue
            seen.add(x)
            if x != name and (x in out or x not in elementwise_inputs or region(x) != region(name)):
                roots.add(x)
            else:
                todo.extend(elementwise_inputs.get(x, ()))
        earlier = {r for r in roots if region(r) != region(name)}
        cost = sum(nbytes(r) for r in earlier) / 2 + sum(nbytes(r) for r in roots - earlier - out)
        if cost < nbytes(name):
            out.discard(name)
            out |= roots
            pinned |= earlier
    return out
