"""What a user may do to a model after jitting it with FSDP (issue 17, items 2 and 4).

- Jitting the original module again starts from the jitted module's current weights (gathered from its
  shards), whether the model was built on the meta device or on the CPU; the jitted module itself is not
  jitted again; the released original is not called; a deleted holder is an FSDPError; a dry run's module
  (no weights) is jitted again as it is.
- ``requires_grad`` changed after compiling: the next call compiles a variant with the new flags and the
  gradients match a single process; the sharding plan carries them; not while no_sync() accumulates.
"""

import pytest
import thunder
import torch

from fsdp_pass import FSDP, FSDPError, fake_process_group, fsdp_of
from tests import misuse_cases, models


@pytest.mark.parametrize("name, built_on", [("mlp", "meta"), ("llama_gqa", "cpu"), ("gpt2_tied", "cpu")])
def test_rejit_starts_from_the_shards(ranks, name, built_on):
    for r in ranks(2).run(misuse_cases.rejit_keeps_weights, name, built_on):
        assert r["weights_kept"] and r["buffers_kept"] and r["released_again"], r
        assert r["tied_kept"] == ([("lm_head.weight", "wte.weight")] if name == "gpt2_tied" else []), r
        assert "full_state_dict(jm)" in r["call_original"] and "What to do" in r["call_original"], r
        assert "jit the original module" in r["jit_jitted"].lower(), r
        assert "deleted" in r["holder_gone"] and "What to do" in r["holder_gone"], r


def test_rejit_on_one_rank_only_raises(ranks):
    message, other = ranks(2).run(misuse_cases.rejit_on_one_rank_only, timeout=60)
    assert "of a module sharded before is collective" in message and "rank 1" in message, message
    assert other == "stayed"


def test_freeze_after_compile_recompiles(ranks):
    for r in ranks(2).run(misuse_cases.freeze_after_compile_then_rejit, timeout=400):
        assert all(e is not None and e < 1e-5 for e in r["step0"].values()), r
        assert r["step1"]["fc1.weight"] is None, r  # frozen: no gradient
        assert all(e is not None and e < 1e-5 for k, e in r["step1"].items() if k != "fc1.weight"), r
        assert r["plan_frozen"] and r["weights_kept"] and r["frozen_kept"], r
        assert r["output_error"] < 1e-5, r


def _run_pre_call_hooks(jm):
    """What calling ``jm`` does before Thunder looks up its cache (no compile needed)."""
    for hook in list(jm._forward_pre_hooks.values()):
        hook(jm, ())


def test_requires_grad_followed_from_either_side():
    with fake_process_group(2):
        model = models.build("frozen")  # fc1 frozen when jitted
        jm = thunder.jit(model, transforms=[FSDP("zero3")])
        jm.get_parameter("fc1.weight").requires_grad_(True)  # unfrozen on the jitted module
        model.head.weight.requires_grad_(False)  # frozen on the original (a meta tensor now)
        _run_pre_call_hooks(jm)
        sharding = fsdp_of(jm).sharding
        assert sharding.param("fc1.weight").requires_grad and not sharding.param("head.weight").requires_grad
        assert model.fc1.weight.requires_grad and not jm.get_parameter("head.weight").requires_grad

        fsdp_of(jm).accumulators.pending["fc2"] = torch.zeros(1)  # as if no_sync() held gradients
        jm.get_parameter("fc2.weight").requires_grad_(False)
        with pytest.raises(FSDPError, match="no_sync"):
            _run_pre_call_hooks(jm)


def test_released_original_and_jitted_module_refuse():
    with fake_process_group(2):
        model = models.build("mlp")
        jm = thunder.jit(model, transforms=[FSDP()])
        shards = [(n, p, p.detach().clone()) for n, p in jm.named_parameters()]
        with pytest.raises(FSDPError, match="full_state_dict"):
            model(torch.randn(2, 16))
        with pytest.raises(FSDPError, match="Jit the original module"):
            thunder.jit(jm, transforms=[FSDP("zero3")])
        # refused, and nothing changed: the same shard tensors, the same values, the original still released
        now = dict(jm.named_parameters())
        assert list(now) == [n for n, _, _ in shards] and all(now[n] is p for n, p, _ in shards)
        assert all(torch.equal(p, before) for _, p, before in shards)
        assert all(p.is_meta for p in model.parameters())


def test_dry_run_again_on_the_same_module():
    """A dry run holds no weights: jitting its module again (another strategy) plans it as before."""
    with fake_process_group(2):
        with torch.device("meta"):
            model = models.MLP()
        first = thunder.jit(model, transforms=[FSDP("zero2", device="meta")])
        second = thunder.jit(model, transforms=[FSDP("zero3", device="meta")])
        assert fsdp_of(second).sharding.params == fsdp_of(first).sharding.params
        assert all(p.is_meta for p in second.parameters())
