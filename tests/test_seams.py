"""The seam matrix: the features users combine, each pair of them met in at least one combination, every
combination trained for two steps (SGD with momentum) on 2 gloo ranks against one process (``tests/seam_cases.py``: the factors,
the construction, the reference, and which pairs a user cannot ask for).

The combinations, as the test ids print them (precision-feature-units-strategy-lengths): the pairwise covering, then
one case beyond it (``seam_cases.ONE_PLAN``: the default units with the cost a CUDA user gets, ``cost="h100-nvlink"``,
and first batches that would make each rank choose other units, planning alone)::

     0  fp32-check_finite-default-zero2-equal
     1  fp32-offload-blocks-zero3-ragged
     2  fp32-no_sync-auto-hsdp-equal
     3  fp32-checkpoint-default-zero3-equal
     4  bf16-check_finite-blocks-hsdp-ragged
     5  bf16-offload-default-zero2-equal
     6  bf16-no_sync-default-zero3-ragged
     7  bf16-checkpoint-blocks-zero2-ragged
     8  int8-check_finite-auto-zero3-ragged
     9  int8-offload-default-hsdp-equal
    10  int8-no_sync-blocks-zero2-equal
    11  int8-checkpoint-default-hsdp-equal
    12  fp16-check_finite-default-zero2-equal
    13  fp16-offload-auto-zero3-ragged
    14  fp16-no_sync-blocks-hsdp-equal
    15  fp16-checkpoint-default-zero2-equal
    16  bf16-check_finite-auto-zero3-equal
    17  fp32-check_finite-default-zero3-plans-h100-nvlink

Each case checks, on every rank: its own loss on each micro-batch and the mean loss over the ranks, every
trainable parameter's gradient gathered whole (each parameter on its own, every step) and every parameter after
each optimizer step, within its precision's tolerance (``seam_cases.TOLERANCE``: float32 against the eager model,
the low precisions against a reference that makes the same casts); every rank planned the same units; the feature
is on (the finite checks are in the trace, no_sync's micro-batches sent no reduce-scatter, float16's scaler did not
skip); in the one-plan case, that each rank alone would have planned other units from its first batch (else the case
shows nothing) and that every rank compiled the plan of the step they agreed on (rank 1's, the larger) at every step.
"""

from __future__ import annotations

import itertools

import pytest

from fsdp_pass import FSDP, FSDPError
from tests import seam_cases
from tests.seam_cases import CASES, FACTORS, TOLERANCE, all_pairs, allowed, case_id

LISTED = [line.split()[1] for line in __doc__.split("::")[1].strip().split("\n\n")[0].splitlines()]


def test_the_cases_cover_every_pair_a_user_can_ask_for():
    """Every allowed pair of values of two factors is in some case; no case holds a pair that is not allowed; the
    construction is deterministic, and the docstring lists what it builds."""
    for (a, va), (b, vb) in ((x, y) for a, b in itertools.combinations(FACTORS, 2)
                             for x, y in itertools.product([(a, v) for v in FACTORS[a]], [(b, v) for v in FACTORS[b]])):
        met = any(c[a] == va and c[b] == vb for c in CASES)
        assert met == allowed({a: va, b: vb}), (a, va, b, vb)
    covering, beyond = CASES[:-1], CASES[-1]
    assert all_pairs(FACTORS) == covering and beyond == seam_cases.ONE_PLAN
    assert [case_id(c) for c in CASES] == LISTED
    assert len(covering) <= 17  # 16 (the two four-valued factors' pairs) is the least any covering can have


def test_what_cannot_be_combined_says_so():
    """The pairs left out are refused with an FSDPError that says what to do."""
    with pytest.raises(FSDPError, match="chooses checkpoint_activations itself"):
        FSDP("auto", checkpoint_activations=True)
    with pytest.raises(FSDPError, match="zero2"):
        FSDP("auto", reshard_after_forward=False)


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_seam(ranks, case):
    results = ranks(2).run(seam_cases.seam_case, case)
    tol = TOLERANCE[case["precision"]]
    for rank, r in enumerate(results):
        assert max(r["loss"]) <= tol and max(r["mean_loss"]) <= tol, (rank, r["loss"], r["mean_loss"])
        worst = {name: err for name, err in r["grad"].items() if not err <= tol}
        assert not worst, (rank, worst)
        assert max(r["param"]) <= tol, (rank, r["param"])
        assert r["units"] == results[0]["units"], (rank, r["units"], results[0]["units"])
        assert (r["finite_checks"] > 0) == (case["feature"] == "check_finite"), (rank, r["finite_checks"])
        assert r["scale"] in (None, seam_cases.SCALE), (rank, r["scale"])  # float16: no step skipped
        # under no_sync the first micro-batch reduces nothing, the second all; otherwise every step reduces
        assert all(n[-1] > 0 and not any(n[:-1]) for n in r["reductions"]), (rank, r["reductions"])
        assert len(r["reductions"][0]) == (2 if case["feature"] == "no_sync" else 1)
    if "cost" in case:  # the one-plan seam: planning alone, the ranks' first batches give other units
        alone = [r["alone"] for r in results]
        assert alone[0][0] != alone[1][0], alone
        for rank, r in enumerate(results):
            assert all(p == alone[1] for p in r["plans"]), (rank, r["plans"], alone)
