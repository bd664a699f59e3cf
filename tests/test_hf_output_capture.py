"""transformers 5's output capture under ``thunder.jit`` (:mod:`fsdp_pass.models.hf_output_capture`).

The CI runs transformers 4, which has no output capture: the tests that need none use
``tests/capture_stand_in.py``, the same mechanism on a two-layer model, put where transformers 5 keeps it
(``sys.modules``), and one jit each (about 1 s). The last test trains the tiny Hugging Face Llama of
``tests/fixtures/hf_tiny_llama`` and runs only where transformers 5 is installed (about 60 s there); it checks too
that its attention is causal with no mask (:mod:`fsdp_pass.models.hf_causal_mask`).
"""

import importlib.metadata
import sys
from pathlib import Path

import pytest
import thunder
import torch
from fsdp_pass_executors import executors_for

from fsdp_pass import FSDP, FSDPError, full_state_dict
from fsdp_pass.models import hf_output_capture
from fsdp_pass.models.hf_output_capture import CAPTURE_MODULE, capture_lookasides
from fsdp_pass.models.hf_tracing import trace_hf_models
from tests.one_rank import one_rank
from tests import capture_stand_in

HF_LLAMA = Path(__file__).parent / "fixtures" / "hf_tiny_llama"
SDPA = "torch.nn.functional.scaled_dot_product_attention"
ASKS_FOR_OUTPUTS = "(?s)asked to return its hidden_states.*What to do: Leave output_hidden_states"


@pytest.fixture
def transformers_5(monkeypatch):
    """The stand-in where transformers 5's ``output_capturing`` module would be imported."""
    monkeypatch.setitem(sys.modules, CAPTURE_MODULE, capture_stand_in)


def transformers_version() -> str | None:
    """The installed transformers' version (None: not installed), without importing it (a second here)."""
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return None


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


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_hugging_face_llama_with_transformers_5_trains_as_eager():
    installed = transformers_version()
    if installed is None or int(installed.split(".")[0]) < 5:
        pytest.skip(f"transformers {installed} has no output capture (5 has)")
    from fsdp_pass.models.hf_config import hf_causal_lm

    torch.manual_seed(0)
    eager, _ = hf_causal_lm(HF_LLAMA, "cpu")
    model, _ = hf_causal_lm(HF_LLAMA, "cpu")
    model.load_state_dict(eager.state_dict())
    batches = [torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    expected = sgd_steps(eager, lambda x: eager(input_ids=x, labels=x).loss, batches)
    assert hf_output_capture.CAPTURE_MODULE in sys.modules  # the model was built with it
    with one_rank():
        jm = thunder.jit(model, transforms=[FSDP("zero3")], executors=executors_for("cpu"))
        assert sgd_steps(jm, lambda x: jm(input_ids=x, labels=x).loss, batches) == pytest.approx(expected, rel=1e-5)
        attention = [b for b in thunder.last_traces(jm)[0].bound_symbols if b.sym.id == SDPA]
        assert len(attention) == 2 and all(b.args[3] is None and b.args[5] for b in attention)  # hf_causal_mask
        with pytest.raises(FSDPError, match=ASKS_FOR_OUTPUTS):
            jm(input_ids=batches[0], labels=batches[0], output_hidden_states=True)
