"""Tier 1: one process, fake process group at world size 8: count and order of collectives.

These tests pin the per-parameter policy (one collective per parameter) with every unit resharded
after forward, so each parameter's gather can be followed on its own; units are tested in test_units.
"""

import ast
from pathlib import Path

import pytest
import thunder

import fsdp_pass
from fsdp_pass import FSDP, fake_process_group
from fsdp_pass_executors import executors_for
from tests import models
from tests.trace_facts import (
    every_collective_waited_once,
    gathers,
    input_numels,
    reduce_scatters,
    saved_for_backward_names,
    saved_for_backward_shapes,
    waits,
)

WORLD = 8
# MLP parameters in order of first use, and each one's numel per rank at world size 8
MLP_ORDER = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "head.weight", "head.bias"]
MLP_SHARD_NUMEL = [4 * 16, 4, 2 * 32, 2, 1 * 16, 1]


def compile_mlp(strategy):
    with fake_process_group(WORLD):
        jm = thunder.jit(models.MLP(), transforms=[FSDP(strategy, units="per_parameter", reshard_after_forward=strategy == "zero3")], executors=executors_for("cpu"))
        x, y = models.batch("mlp", 3, 0)  # batch 3: no activation shares a weight's shape
        models.loss_fn("mlp", jm(x), y).backward()
        fsdp = jm._lc_transforms[0]
        return thunder.last_traces(jm)[-1], thunder.last_backward_traces(jm)[-1], fsdp.unit_plan


@pytest.fixture(scope="module")
def traces():
    return {s: compile_mlp(s) for s in ("zero2", "zero3")}


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_forward_gathers_each_parameter_once_in_first_use_order(traces, strategy):
    fwd, _, plan = traces[strategy]
    assert [u.name for u in plan.units] == MLP_ORDER
    assert input_numels(gathers(fwd)) == MLP_SHARD_NUMEL
    assert reduce_scatters(fwd) == []
    assert every_collective_waited_once(fwd)


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_backward_reduce_scatters_every_gradient_once(traces, strategy):
    _, bwd, _ = traces[strategy]
    # reduce-scatter input is the padded full gradient: N x the shard
    assert sorted(input_numels(reduce_scatters(bwd))) == sorted(n * WORLD for n in MLP_SHARD_NUMEL)
    assert every_collective_waited_once(bwd)
    assert len(waits(bwd)) == len(reduce_scatters(bwd)) + len(gathers(bwd))


def test_zero2_backward_has_no_gather_and_reuses_saved_parameters(traces):
    fwd, bwd, _ = traces["zero2"]
    assert gathers(bwd) == []
    shapes = saved_for_backward_shapes(fwd)
    assert (16, 32) in shapes and (4, 16) in shapes  # full fc2.weight and head.weight kept


def test_zero3_backward_gathers_again_what_it_needs(traces):
    fwd, bwd, plan = traces["zero3"]
    assert all(u.reshard_after_forward for u in plan.units)
    # the backward needs the weights that multiply a gradient: head.weight, then fc2.weight
    # (fc1.weight only multiplies the input, which needs no gradient; biases are never needed)
    assert input_numels(gathers(bwd)) == [1 * 16, 2 * 32]
    shapes = saved_for_backward_shapes(fwd)
    assert (16, 32) not in shapes and (4, 16) not in shapes  # no full parameter saved
    assert {"t_fc2_weight", "t_head_weight"} <= set(saved_for_backward_names(fwd))  # their shards are


def test_plan_prints_as_table(traces):
    _, _, plan = traces["zero3"]
    text = str(plan)
    assert "strategy=zero3 world_size=8 units=6" in text
    for name in MLP_ORDER:
        assert name in text


def test_tied_embedding_is_one_shard_gathered_at_each_use():
    with fake_process_group(WORLD):
        jm = thunder.jit(models.TinyGPT2(), transforms=[FSDP("zero3", units="blocks")], executors=executors_for("cpu"))
        x, y = models.batch("gpt2_tied", 2, 0)
        models.loss_fn("gpt2_tied", jm(x), y).backward()
        fsdp = jm._lc_transforms[0]
        names = [n for n, _ in jm.named_parameters()]
        assert "wte.weight" in names and "lm_head.weight" not in names  # one sharded tensor
        assert jm.get_parameter("lm_head.weight") is jm.get_parameter("wte.weight")
        units = fsdp.unit_plan.units
        # gathered where each name is used: with the embeddings first, with the final norm last
        assert units[0].name == "wte+wpe" and "wte.weight" in units[0].params
        assert units[-1].name == "ln_f+lm_head" and "lm_head.weight" in units[-1].params
        fwd = thunder.last_traces(jm)[-1]
        assert len(gathers(fwd)) == len(units)


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_every_collective_and_wait_is_labelled_with_its_unit(traces, strategy):
    fwd, bwd, _ = traces[strategy]
    for trace in (fwd, bwd):
        for bsym in gathers(trace) + reduce_scatters(trace) + waits(trace):
            assert "[fsdp]" in str(bsym.header) and "unit '" in str(bsym.header), bsym
    text = str(bwd)
    for name in MLP_ORDER:
        assert f"[fsdp] unit '{name}' reduce-scatter grads" in text
    if strategy == "zero3":
        assert "[fsdp] unit 'head.weight' all-gather" in text


# --- the code's shape: read with ast, no compile ---------------------------------------------------------------

PACKAGE = Path(fsdp_pass.__file__).resolve().parent
# the stages in the order data flows (docs/layout-and-versions.md): a stage imports only stages before it, and the
# modules every stage shares (errors, op names, predicates, text, ranks, models)
STAGES = ("plan", "cost", "search", "shard", "ops", "passes", "verify")
SHARED = ("fsdp_pass.errors", "fsdp_pass.op_names", "fsdp_pass.predicates", "fsdp_pass.text", "fsdp_pass.ranks",
          "fsdp_pass.models")
# imports inside a function, each with why it cannot be at the top of its module
LAZY_IMPORTS = {
    # an optional dependency (the hf extra) whose import costs ~2 s of CPU; --model hf:... says what to install
    ("fsdp_pass.models.hf_config", "_transformers"): "transformers",
    # importing it registers torch's fake backend and costs ~2 s of CPU: only dry runs and fake groups need it
    ("fsdp_pass.shard.groups", "fake_process_group"): "torch.testing._internal.distributed.fake_pg",
}
LONGEST_FUNCTION = 60  # lines, decorators excluded
# what is left to mend, each listed so that it can only go: a new one fails, and so does a mended one still listed
LATER_IMPORTS_LEFT = {
    ("fsdp_pass.plan.options", "fsdp_pass.cost.cost_model"),  # cost=: CostInputs, DEFAULTS
    ("fsdp_pass.plan.plan_units", "fsdp_pass.cost.candidate_costs"),  # ZeRO-3's last unit, decided while planning
    ("fsdp_pass.plan.plan_units", "fsdp_pass.cost.step_summary"),
    ("fsdp_pass.plan.plan_units", "fsdp_pass.search.last_unit"),
    ("fsdp_pass.shard.prologue", "fsdp_pass.ops.grad_accumulation"),
}
LONG_FUNCTIONS_LEFT: set[str] = set()


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = ast.parse(path.read_text(), str(path))
    return out


def _imported(module: str, node, modules) -> list[str]:
    """The fsdp_pass modules ``node`` (an import anywhere in ``module``) reads, each as the longest module name."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            here = module.split(".") if module in modules and _is_package(module) else module.split(".")[:-1]
            base = ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else []))
        names = [base] + [f"{base}.{a.name}" for a in node.names]
    found = []
    for name in names:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name.startswith("fsdp_pass") and name != module:
            found.append(name)
    return found


def _is_package(module: str) -> bool:
    return (PACKAGE.parent / module.replace(".", "/") / "__init__.py").exists()


@pytest.fixture(scope="module")
def import_graph():
    modules = _modules()
    return {
        m: {t for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)) for t in _imported(m, node, modules)}
        for m, tree in modules.items()
    }


def _a_cycle(graph) -> list[str] | None:
    """One import circle of ``graph`` (module -> modules it imports), as the modules around it, or None."""
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for t in sorted(graph.get(m, ())):
            if state.get(t) == "open":
                return stack[stack.index(t):] + [t]
            if t not in state and (found := visit(t)):
                return found
        state[m] = "done"
        stack.pop()
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_circle(import_graph):
    # imports inside functions count: one there only hides a circle until the function runs
    cycle = _a_cycle(import_graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_no_stage_imports_a_later_one(import_graph):
    def stage(m):
        parts = m.split(".")
        return parts[1] if len(parts) > 1 and parts[1] in STAGES else None

    later = [
        (m, t)
        for m, targets in import_graph.items()
        if stage(m)
        for t in targets
        if stage(t) != stage(m) and not t.startswith(SHARED)
        and (stage(t) is None or STAGES.index(stage(t)) > STAGES.index(stage(m)))
    ]
    assert set(later) == LATER_IMPORTS_LEFT, "\n".join(
        [f"{m} imports {t}, a later stage" for m, t in sorted(set(later) - LATER_IMPORTS_LEFT)]
        + [f"mended, take it off LATER_IMPORTS_LEFT: {m} -> {t}" for m, t in sorted(LATER_IMPORTS_LEFT - set(later))])


def test_no_import_inside_a_function():
    found = [
        (m, f.name, ast.unparse(n))
        for m, tree in _modules().items()
        for f in ast.walk(tree)
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
        for n in ast.walk(f)
        if isinstance(n, (ast.Import, ast.ImportFrom)) and (m, f.name) not in LAZY_IMPORTS
    ]
    assert found == [], "\n".join(f"{m}.{fn}: {text}" for m, fn, text in found)


def test_no_function_over_60_lines():
    long = dict(
        (f"{m}.{f.name}", f.end_lineno - f.lineno + 1)
        for m, tree in _modules().items()
        for f in ast.walk(tree)
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.end_lineno - f.lineno + 1 > LONGEST_FUNCTION
    )
    assert set(long) == LONG_FUNCTIONS_LEFT, "\n".join(
        [f"{name}: {long[name]} lines" for name in sorted(set(long) - LONG_FUNCTIONS_LEFT)]
        + [f"mended, take it off LONG_FUNCTIONS_LEFT: {name}" for name in sorted(LONG_FUNCTIONS_LEFT - set(long))])
