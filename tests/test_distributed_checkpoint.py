"""Sharded checkpoints across gloo ranks: state dicts of DTensor views saved by torch.distributed.checkpoint,
resumed exactly at the same world size (bitwise) and at another (2 -> 1, 2 -> 4: within float32 summation
order), the full and flat forms, an interrupted save, and the errors of state dicts that do not fit.
One compile per case and world size."""

import collections
import io
import pickle

import pytest
import torch

from fsdp_pass import MixedPrecision
from fsdp_pass.train.loop_state import refused_part
from fsdp_pass.train.rank_extras import first_difference, value_digest
from tests import checkpoint_cases

TOL = 1e-6  # another world size sums the same gradients in another order


def _rel(ours: dict, theirs: dict) -> float:
    diff = sum(float((ours[k].double() - theirs[k].double()).pow(2).sum()) for k in theirs)
    ref = sum(float(theirs[k].double().pow(2).sum()) for k in theirs)
    return (diff / ref) ** 0.5


def _check_same_world_resume(results, plain=()):
    """``plain``: the keys a state dict holds as plain tensors (0-d parameters, saved whole)."""
    for r in results:
        assert r["save_changed_nothing"] and r["loaded_params_exact"], r
        assert r["resumed"][0] == 2 and r["resumed"][1] == {"seen": 8}, r
        assert r["resumed_losses"] == r["losses"], r  # bitwise
        assert r["resumed_params_bitwise"], r
        assert r["jm_state_dict_keys_match"] and r["jm_state_dict_plain"] == list(plain), r


def same_nested(a, b) -> bool:
    """Equal structure, equal values, tensors bitwise."""
    if isinstance(a, dict):
        return isinstance(b, dict) and sorted(a) == sorted(b) and all(same_nested(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same_nested(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def _check_resumed_elsewhere(saved, results, param_tol=TOL):
    """The state loaded at another world size is the saved one, bitwise (model and optimizer, gathered whole);
    training on matches the uninterrupted run within ``param_tol``."""
    assert same_nested(results[0]["state_at_load"], saved["state_at_save"])
    for r in results:
        assert r["resumed"] == (2, {"seen": 8}), r
        assert max(abs(a - b) / abs(b) for a, b in zip(r["losses"], saved["losses"])) <= TOL, (
            r["losses"],
            saved["losses"],
        )
    assert sorted(results[0]["params"]) == sorted(saved["params"])
    assert _rel(results[0]["params"], saved["params"]) <= param_tol


@pytest.fixture(scope="module")
def odd_shapes_checkpoint(ranks, tmp_path_factory):
    """Odd row counts, a 1-D and a 0-d parameter (at world 4 one rank holds no row of some), ZeRO-2, SGD with
    momentum: saved at world 2."""
    directory = str(tmp_path_factory.mktemp("odd_shapes"))
    results = ranks(2).run(checkpoint_cases.save_and_continue, "odd_shapes", "zero2", "sgd", directory)
    return directory, results


def test_resume_at_the_same_world_size_is_bitwise(odd_shapes_checkpoint):
    _check_same_world_resume(odd_shapes_checkpoint[1], plain=["temperature"])


@pytest.mark.parametrize("world_size", [1, 4])
def test_resume_at_another_world_size(ranks, odd_shapes_checkpoint, world_size):
    directory, saved = odd_shapes_checkpoint
    results = ranks(world_size).run(checkpoint_cases.resume_elsewhere, "odd_shapes", "zero2", "sgd", directory)
    _check_resumed_elsewhere(saved[0], results)


def test_tied_zero3_adamw_saved_at_2_resumed_at_4(ranks, tmp_path):
    """A tied GPT-2 (one entry for the tied weight, both keys in the model's state dict), ZeRO-3, AdamW. One block:
    the tie is outside the blocks, and a second block made the test ~28 % more CPU time (six ranks compile)."""
    one_block = {"n_layer": 1}
    saved = ranks(2).run(checkpoint_cases.save_and_continue, "gpt2_tied", "zero3", "adamw", str(tmp_path),
                         model_config=one_block)
    _check_same_world_resume(saved)
    results = ranks(4).run(checkpoint_cases.resume_elsewhere, "gpt2_tied", "zero3", "adamw", str(tmp_path),
                           model_config=one_block)
    # AdamW divides by the root of the second moment, so float32 noise in a gradient that is zero in exact
    # arithmetic (the key biases: softmax ignores them) becomes a full-size update: two uninterrupted runs at
    # worlds 2 and 4 differ by 6e-5 in these parameters, checkpoint or not. The bitwise check above is the exact one.
    _check_resumed_elsewhere(saved[0], results, param_tol=2e-4)


def test_resume_with_mixed_precision_and_offload(ranks, tmp_path):
    """bf16 gathers and compute, float32 shards and optimizer state offloaded to the host: the checkpoint holds
    the float32 master weights, and the resumed run is bitwise the uninterrupted one."""
    precision = MixedPrecision(torch.bfloat16, output_dtype=torch.float32)
    results = ranks(2).run(
        checkpoint_cases.save_and_continue,
        "llama_gqa",
        "zero3",
        "adamw",
        str(tmp_path),
        mixed_precision=precision,
        offload_to="cpu",
    )
    _check_same_world_resume(results)


def test_full_form_through_rank0_and_flat_optimizer_form(ranks):
    results = ranks(2).run(checkpoint_cases.full_and_flat_forms, "gpt2_tied", "zero2", "adamw")
    assert results[0]["full_keys"] > 0 and results[1]["full_keys"] == 0  # cpu_offload: rank 0 only
    assert results[0]["full_devices"] == ["cpu"] and results[0]["full_shapes_match"]
    assert results[0]["full_optim_entries"] > 0 and results[1]["full_optim_entries"] == 0
    for r in results:
        assert r["broadcast_params_exact"] and r["broadcast_optimizer_exact"], r
        assert r["broadcast_groups"] == [0.1, 0.0], r
        assert r["flat_optimizer_exact"] and all(
            k.startswith(("param_groups.", "state.")) for k in r["flat_keys_sample"]
        )
        assert r["tied"] == ["lm_head.weight"] and r["loads_without_tied_names"], r
        assert "lm_head.weight" in r["untied_values_error"] and "tied" in r["untied_values_error"], r


@pytest.fixture(scope="module")
def misuse_results(ranks, tmp_path_factory):
    """One compile at world 2 for the failed save, the misfit state dicts and the damaged and foreign checkpoints."""
    directory = str(tmp_path_factory.mktemp("misuse"))
    return ranks(2).run(checkpoint_cases.interrupted_save_and_misuse, "odd_shapes", "zero3", "sgd", directory)


def test_interrupted_save_keeps_the_last_checkpoint_and_misfits_fail_loudly(misuse_results):
    for r in misuse_results:
        # every rank learns the save failed, which rank failed and why, and which checkpoint is still good
        assert r["failed_save"].startswith("FSDPError") and "rank 1: OSError" in r["failed_save"], r
        assert "step-00000002, is untouched" in r["failed_save"], r
        assert r["complete_steps"] == [2] and r["resumed_step"] == 2 and r["resumed_exact"], r
        assert r["state_with_grads_present"] and r["grads_kept"], r
        errors, first = r["errors"], r["first_key"]
        assert all(message is not None for message in errors.values()), errors
        assert "full_state_dict=True" in errors["full_into_sharded"] and first in errors["full_into_sharded"]
        assert "DTensor" in errors["sharded_into_full"]
        assert "missing keys" in errors["missing"] and first in errors["missing"]
        assert "unexpected keys" in errors["unexpected"] and "bogus.weight" in errors["unexpected"]
        assert (
            "(4, 4)" in errors["wrong_shape"]
            and str(r["first_shape"]) in errors["wrong_shape"]
            and first in errors["wrong_shape"]
        )
        assert "jm.parameters()" in errors["foreign_optimizer"]
        assert "momentum_buffer" in errors["optimizer_of_other_kind"] or "exp_avg" in errors["optimizer_of_other_kind"]
        assert all("What to do" in message for message in errors.values())
        assert r["nothing_loaded"], r


# The README's loop saved by 2 ranks and resumed on 1 with the same losses: tests/test_loop.py
# (test_resumed_on_one_rank_it_goes_on_with_the_two_ranks_losses), on the run its module makes anyway.


def test_a_damaged_newest_checkpoint_names_the_file_and_the_newest_that_verifies(misuse_results):
    """The newest of two checkpoints with one .distcp file cut in half: the same FSDPError on both ranks, naming
    the folder, the file and the older folder, nothing loaded; step= loads the older one and training goes on with
    the losses of the run that saved it (bitwise: the same world size)."""
    damaged = [r["damaged"] for r in misuse_results]
    assert damaged[0]["damaged_error"] == damaged[1]["damaged_error"]
    for d in damaged:
        error = d["damaged_error"]
        assert f"{d['newest']} is damaged" in error and d["damaged_file"] in error, error
        assert "cut short" in error and f"newest checkpoint that verifies is {d['older']}" in error, error
        assert "step=2" in error and "What to do" in error, error
        assert d["damaged_loaded_nothing"], d
        assert "holds steps [2, 3]" in d["no_such_step_error"], d["no_such_step_error"]
        assert d["older_resumed"] == (2, "step-00000002") and d["older_exact"], d
    for r in misuse_results:
        assert r["damaged"]["older_losses"] == r["losses_after_save"], r


def test_loading_runs_no_code_from_the_checkpoint_and_extra_must_load_without_it(misuse_results):
    """loop.pt replaced by a pickle that creates a file when unpickled (its manifest entry rewritten to match):
    an FSDPError on every rank, the file not created, nothing loaded. An extra that holds a function is refused
    at save, naming where it is, and nothing is published."""
    for r in misuse_results:
        d = r["damaged"]
        assert "weights_only=True" in d["code_error"] and "loop.pt" in d["code_error"], d["code_error"]
        assert not d["code_ran"] and d["code_loaded_nothing"], d
        assert "extra['schedule']['lr_lambda'] is a function" in d["extra_error"], d["extra_error"]
        assert d["steps_after_refused_extra"] == [2, 3], d
    assert misuse_results[0]["damaged"]["plant_runs_code_when_unpickled"]  # the test's plant is a real one


def test_a_checkpoint_of_another_width_or_optimizer_names_the_first_key_and_both_shapes(misuse_results):
    """An MLP of hidden width 48 saved, one of width 32 loaded: the first key and both shapes; the same model with
    SGD instead of AdamW: the state SGD lacks; another model: its keys. Nothing loaded, fresh optimizers stay fresh."""
    for r in misuse_results:
        d = r["damaged"]
        width, kind, keys = d["width_error"], d["optimizer_error"], d["keys_error"]
        assert "wide/step-00000001 does not fit" in width, width
        assert "model.fc1.weight has shape (48, 16) in the checkpoint and (32, 16) here" in width, width
        assert "momentum_buffer" in kind and "not in the checkpoint" in kind, kind
        assert "model.gain (3,), which it is loaded into, is not in the checkpoint" in keys, keys
        assert all(len(e.splitlines()) <= 3 for e in (width, kind, keys)), (width, kind, keys)
        assert d["foreign_loaded_nothing"] and d["fresh_optimizers_left_fresh"], d


class Tagged(torch.Tensor):
    """A tensor subclass (DTensor is one): weights_only loads it only when allowlisted."""


def _schedulers_state() -> dict:
    opt = torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1)
    warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 4))
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    return {
        "lambda": warmup.state_dict(),
        "sequential": torch.optim.lr_scheduler.SequentialLR(opt, [warmup, cosine], milestones=[4]).state_dict(),
        "one_cycle": torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1.0, total_steps=10).state_dict(),
    }


ACCEPTED = {
    "schedulers": _schedulers_state(),
    "everything": {
        "t": torch.arange(3.0), "p": torch.nn.Parameter(torch.ones(2)), "n": None, "b": True, "i": 2**70,
        "f": float("nan"), "c": 1j, "s": "x", "y": b"\x00", "dtype": torch.bfloat16, "device": torch.device("cpu"),
        "size": torch.Size([2, 3]), "ordered": collections.OrderedDict(a=[1, (2, {3})]), 4: {None: [torch.ones(())]},
    },
}
REFUSED = {
    "function": ({"schedule": {"fn": _schedulers_state}}, "extra['schedule']['fn'] is a function"),
    "defaultdict": ([collections.defaultdict(list)], "extra[0] is a collections.defaultdict"),
    "frozenset": ({"a": frozenset([1])}, "extra['a'] is a frozenset"),
    "range": ((1, range(3)), "extra[1] is a range"),
    "key": ({range(2): 0}, "a key of extra is a range"),
    "tensor subclass": ({"m": torch.ones(1).as_subclass(Tagged)}, f"extra['m'] is a {__name__}.Tagged"),
}


def _loads_without_code(value) -> bool:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
        return True
    except pickle.UnpicklingError:
        return False


@pytest.mark.parametrize("label", sorted(ACCEPTED))
def test_extra_accepted_is_what_weights_only_loads(label):
    assert refused_part(ACCEPTED[label]) is None and _loads_without_code(ACCEPTED[label])


@pytest.mark.parametrize("label", sorted(REFUSED))
def test_extra_refused_is_what_weights_only_refuses_named_by_its_path(label):
    value, named = REFUSED[label]
    assert refused_part(value) == named and not _loads_without_code(value)


def test_each_rank_gets_its_own_extra_back_and_another_world_size_needs_a_rule(ranks, tmp_path):
    """Saved at world 2 with extras that differ by rank: each rank's own is written (extra-0000r.pt) and comes back
    to it, bitwise; one extra for every rank is written once. At world 4 the per-rank extras are an FSDPError naming
    the first difference, and nothing is loaded; with per_rank_extra='all' every rank gets the 2 saved extras; the
    model and optimizer state load as saved (the manifest of this format, at another world size)."""
    saved = ranks(2).run(checkpoint_cases.save_per_rank_extras, str(tmp_path))
    own_files, same_files = saved[0]["files"]["own"], saved[0]["files"]["same"]
    assert {"extra-00000.pt", "extra-00001.pt"} <= set(own_files), own_files
    assert not any(name.startswith("extra-") for name in same_files), same_files
    for rank, r in enumerate(saved):
        assert same_nested(r["own_extra"], checkpoint_cases.rank_extra(rank)), (rank, r["own_extra"])
        assert same_nested(r["same_extra"], checkpoint_cases.rank_extra(0))
    assert same_nested(saved[0]["state_at_load"], saved[0]["state_at_save"])

    elsewhere = ranks(4).run(checkpoint_cases.load_per_rank_extras_elsewhere, str(tmp_path))
    for r in elsewhere:
        error = r["own_error"]
        assert "saved by 2 ranks whose extras differ (extra['data']['offset'] on rank 1 differs" in error, error
        assert "at world size 4 no rank's extra is its own" in error and "per_rank_extra='all'" in error, error
        assert r["loaded_nothing"]
        assert len(r["all_extras"]) == 2
        assert all(same_nested(r["all_extras"][i], checkpoint_cases.rank_extra(i)) for i in range(2))
        assert same_nested(r["same_extra"], checkpoint_cases.rank_extra(0))
    assert same_nested(elsewhere[0]["state_at_load"], saved[0]["state_at_save"])


def _round_trip(value):
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("label", sorted(ACCEPTED))
def test_extras_compare_by_value_what_a_save_and_a_load_keep(label):
    """The ranks' extras compare by value_digest: an extra and its round trip through torch.save and a
    weights_only load are the same."""
    value = ACCEPTED[label]
    assert value_digest(_round_trip(value)) == value_digest(value) and first_difference(value, value) is None


def test_the_first_difference_between_two_extras_is_named_by_its_path():
    a = {"data": {"offset": 7, "seen": [1, 2]}, "rng": torch.zeros(4, dtype=torch.uint8), "on": {1, 2}}
    changed = {
        "extra['data']['offset']": {**a, "data": {"offset": 8, "seen": [1, 2]}},
        "extra['data']['seen'][0]": {**a, "data": {"offset": 7, "seen": [True, 2]}},  # True == 1, not the same
        "extra['rng']": {**a, "rng": torch.tensor([0, 0, 0, 1], dtype=torch.uint8)},
        "extra['on']": {**a, "on": {1, 3}},
        "the keys of extra": {k: v for k, v in a.items() if k != "on"} | {"off": {1, 2}},
    }
    for path, b in changed.items():
        assert first_difference(a, b) == path and value_digest(a) != value_digest(b), path
    reordered = {"on": {2, 1}, "rng": a["rng"].clone(), "data": {"seen": [1, 2], "offset": 7}}
    assert value_digest(reordered) == value_digest(a)  # dicts and sets whatever their order
    assert value_digest(torch.tensor(0.0)) != value_digest(torch.tensor(-0.0))  # tensors bitwise
