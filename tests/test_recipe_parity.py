"""The users' recipe, side by side with PyTorch FSDP2: Hugging Face Llama-family models, bfloat16 parameters with a
float32 reduce, on 2 gloo ranks (``tests/recipe_cases.py``).

Each case compiles one model (a single decoder layer: a Thunder compile of an HF model costs 15-40 s here) and
covers what the recipe is run with: activation checkpointing with no_sync accumulation, no_sync alone, CPU offload.
The comparisons, per step (SGD, whose step scales with the gradient, unless the case is about the recipe's AdamW):

- each parameter's full gradient, by name, against FSDP2's with the same ``MixedPrecisionPolicy`` within
  :data:`GRAD_FSDP2`, a few bfloat16 units in the last place of the parameter's largest gradient: the two round
  differently (Thunder decomposes the ops FSDP2 runs eagerly), by bfloat16 roundings;
- each parameter's gradient against a one-process reference that casts the same way (the same decomposed ops, a
  float32 reduce) within :data:`GRAD_SAME_CASTS`, every step;
- the mean loss against FSDP2's within :data:`TOL_FSDP2` and the reference's within :data:`TOL_SAME_CASTS`; both
  sides return their logits in bfloat16, and ours is many times closer to the reference than to FSDP2 in float32.

The Qwen2 case also trains its first step with a bug planted on our side (gradients summed over the ranks instead
of averaged; the micro-batches accumulated under no_sync not divided): the gradient checks must catch both.
"""

import pytest

from tests import recipe_cases

pytest.importorskip("transformers")

BF16_EPS = 2.0**-8
# the worst relative difference of a step's loss to FSDP2's measured over the cases below: 4.4e-05
TOL_FSDP2 = 5e-4
TOL_SAME_CASTS = 1e-6
# max |ours - FSDP2's| / max |FSDP2's| of one parameter's gradient at the first step, in bfloat16 epsilons (2**-8);
# worst measured 5.04 eps (2.0e-2, NeoX's input_layernorm.weight: a sum over every token of bfloat16 products),
# 1.90 on Qwen2, 1.86 on Llama. Later steps are not held to it: the two sides' parameters drift apart by the first
# step's roundings (4.2 eps at the third Qwen2 step against 1.9 at the first)
GRAD_FSDP2 = 6 * BF16_EPS
# the same against the one-process reference, every step; worst measured 0.0 (the same casts and sums)
GRAD_SAME_CASTS = 1e-6
# except a tied tensor's (GPT-2's embedding and head): the two sides round the sum of its two gradients
# differently (which op of ours does is not traced yet): worst measured 0.61 eps (2.4e-3) at the first step. The
# steps after start from parameters that differ by that update, so a model with a tied tensor is held to the
# reference at the first step only (its later gradients then lie within 2.8 eps, its losses within 2.8e-5)
GRAD_TIED = 1 * BF16_EPS

CASES = {
    "llama-zero3-checkpointed-no_sync": ("llama", "zero3", {"checkpoint_activations": True, "micro_batches": 2}),
    "qwen2-zero2-no_sync-planted": ("qwen2", "zero2", {"micro_batches": 2, "plants": ("summed", "undivided")}),
    "gpt2-zero3-offload": ("gpt2", "zero3", {"offload_to": "cpu"}),
    # the recipe's own optimizer on the float32 master shards
    "neox-zero2-adamw": ("neox", "zero2", {"optimizer": "adamw"}),
}


def _worst(a, b) -> float:
    """The worst relative difference of a step's loss ``a`` to ``b``'s."""
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def _failing(errors: dict[str, float], tolerance: float) -> dict[str, float]:
    """The parameters whose gradient lies farther than ``tolerance`` (NaN counts as far)."""
    return {name: e for name, e in errors.items() if not e <= tolerance}


@pytest.fixture(scope="module")
def trained(ranks):
    """Case name -> rank 0's results, each case run once on 2 ranks for every test that reads it."""
    results = {}

    def run(name: str) -> dict:
        if name not in results:
            kind, strategy, options = CASES[name]
            results[name] = ranks(2).run(recipe_cases.side_by_side, kind, strategy, **options)[0]
        return results[name]
    return run


@pytest.mark.parametrize("name", list(CASES))
def test_recipe_matches_fsdp2(trained, name):
    r = trained(name)
    losses, errors = r["losses"], r["grad_errors"]
    assert set(errors["fsdp2"][0]) == set(errors["one_process"][0]) != set(), errors  # every parameter, by name
    assert _failing(errors["fsdp2"][0], GRAD_FSDP2) == {}, "first step's gradients farther than GRAD_FSDP2 from FSDP2's"
    tied = set(r["tied"])
    held = 1 if tied else len(losses["ours"])  # the steps held to the reference (GRAD_TIED says why)
    for step, per_param in enumerate(errors["one_process"][:held]):
        exact = {n: e for n, e in per_param.items() if n not in tied}
        assert _failing(exact, GRAD_SAME_CASTS) == {}, f"step {step}'s gradients, against the one-process reference"
        assert _failing({n: per_param[n] for n in tied}, GRAD_TIED) == {}, f"step {step}'s tied gradients"
    assert _worst(losses["ours"], losses["fsdp2"]) <= TOL_FSDP2, losses
    same_casts = _worst(losses["ours"][:held], losses["one_process"][:held])
    assert same_casts <= TOL_SAME_CASTS, losses
    assert _worst(losses["ours"], losses["fsdp2_fp32"]) > 10 * max(same_casts, 1e-7), losses
    assert r["logits_dtypes"] == {"ours": ["torch.bfloat16"], "fsdp2": ["torch.bfloat16"],
                                  "fsdp2_fp32": ["torch.float32"]}, r
    assert r["shard_dtypes"] == ["torch.float32"], r  # the optimizer steps on float32 master weights


def test_gradient_checks_catch_planted_bugs(trained):
    """The first step's gradients with each bug planted on our side fail both gradient checks, every parameter."""
    planted = trained("qwen2-zero2-no_sync-planted")["planted"]
    assert sorted(planted) == ["summed", "undivided"], planted
    for bug, against in planted.items():
        for other, tolerance in (("fsdp2", GRAD_FSDP2), ("one_process", GRAD_SAME_CASTS)):
            errors = against[other]
            assert _failing(errors, tolerance) == errors, (bug, other, errors)
