"""Which arguments of the computation trace are module parameters, and under which names."""

from __future__ import annotations

from thunder.core import utils

from fsdp_pass.predicates import is_return, is_unpack_parameter, is_unpack_trivial


def parameter_names_of_args(prologue, computation) -> dict[str, str]:
    """Map each computation-trace argument name that is a module parameter to the parameter's name."""
    producers = utils.producers(prologue)
    names = {}
    for pro_out, comp_arg in zip(prologue.output[0], computation.args):
        bsym = producers.get(pro_out, None)
        if bsym is not None and is_unpack_parameter(bsym):
            _, param_name = bsym.args
            names[comp_arg.name] = param_name
    return names


def first_and_last_use(computation, arg_names) -> dict[str, tuple[int, int]]:
    """For each argument in ``arg_names``: index of the first and last top-level op that reads it."""
    uses: dict[str, tuple[int, int]] = {}
    for i, bsym in enumerate(computation.bound_symbols):
        if is_unpack_trivial(bsym) or is_return(bsym):
            continue
        for p in bsym.flat_proxy_args:
            if p.name in arg_names:
                first, _ = uses.get(p.name, (i, i))
                uses[p.name] = (first, i)
    return uses
