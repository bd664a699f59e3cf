"""transformers 5's output capture under ``thunder.jit`` (:mod:`fsdp_pass.models.hf_output_capture`).

Unit tests on ``tests/capture_stand_in.py``, the same mechanism on a two-layer model, put where transformers 5 keeps
it (``sys.modules``), one jit each (about 1 s): they run with any transformers, and show what Thunder does without
the lookasides. The real transformers 5 models (Llama, Qwen2, GPT-2, GPT-NeoX, Mixtral) train under FSDP in
``tests/test_hf_causal_mask.py``, which also holds the errors for outputs asked for.
"""

import sys

import pytest
import thunder
import torch
from fsdp_pass_executors import executors_for

from fsdp_pass import FSDP, FSDPError, full_state_dict
from fsdp_pass.models.hf_output_capture import CAPTURE_MODULE, capture_lookasides
from fsdp_pass.models.hf_tracing import trace_hf_models
from tests.one_rank import one_rank
from tests import capture_stand_in

ASKS_FOR_OUTPUTS = "(?s)asked to return its hidden_states.*What to do: Pass output_hidden_states=False"


@pytest.fixture
def transformers_5(monkeypatch):
    """The stand-in where transformers 5's ``output_capturing`` module would be imported."""
    monkeypatch.setitem(sys.modules, CAPTURE_MODULE, capture_stand_in)


def sgd_steps(module, model_call, batches):
    """The losses of one SGD step per batch."""
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    losses = []
    for batch in batches:
        loss = model_call(batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_thunder_cannot_replay_the_collectors_store():
    """What the stand-in stands for: Thunder fails on it as on transformers 5's models, without the lookasides."""
    with pytest.raises(AssertionError, match="(?s)trying to set .global_var.*_active_collector"):
        thunder.jit(capture_stand_in.Recorded())(torch.ones(2, 8))


def test_no_lookasides_without_transformers_5(monkeypatch):
    monkeypatch.delitem(sys.modules, CAPTURE_MODULE, raising=False)
    assert capture_lookasides() == {}
    assert set(capture_lookasides(capture_stand_in)) == {
        capture_stand_in.CompileableContextVar.set,
        capture_stand_in.CompileableContextVar.get,
        capture_stand_in.CompileableContextVar.reset,
    }


def test_fsdp_trains_a_capturing_model_as_eager(transformers_5):
    """FSDP gives its module the lookasides (FSDP.transform_module): two SGD steps at world 1 as in eager."""
    torch.manual_seed(0)
    eager, model = capture_stand_in.Recorded(), capture_stand_in.Recorded()
    model.load_state_dict(eager.state_dict())
    batches = [torch.randn(3, 8) for _ in range(2)]
    expected = sgd_steps(eager, lambda x: eager(x).square().mean(), batches)
    with one_rank():
        jm = thunder.jit(model, transforms=[FSDP("zero3")], executors=executors_for("cpu"))
        assert sgd_steps(jm, lambda x: jm(x).square().mean(), batches) == pytest.approx(expected, rel=1e-6)
        weights = full_state_dict(jm)
        with pytest.raises(FSDPError, match=ASKS_FOR_OUTPUTS):
            jm(batches[0], output_hidden_states=True)
    assert all(torch.allclose(weights[k], v, atol=1e-6) for k, v in eager.state_dict().items())


def test_a_plain_jit_takes_the_lookasides_by_hand(transformers_5):
    torch.manual_seed(0)
    model, x = capture_stand_in.Recorded(), torch.randn(3, 8)
    jm = trace_hf_models(thunder.jit(model))
    torch.testing.assert_close(jm(x), model(x))
    assert len(model(x, output_hidden_states=True)[1]) == 2  # eager records, the jitted model refuses to
    with pytest.raises(FSDPError, match=ASKS_FOR_OUTPUTS):
        jm(x, output_hidden_states=True)
