"""transformers 5's causal mask under ``thunder.jit`` (:mod:`fsdp_pass.models.hf_causal_mask`): SDPA gets
``is_causal=True`` and no mask where eager's does, and keeps the mask wherever eager's decision reads values.

The CI runs transformers 4, whose Llama passes ``is_causal=True`` under Thunder already: these tests use
``tests/mask_stand_in.py``, the same decisions on a one-layer attention model, put where transformers 5 keeps them
(``sys.modules``); one plain jit for the cases (a recompile each) and one FSDP jit. The Hugging Face Llama under
transformers 5 is checked in ``tests/test_hf_output_capture.py`` where transformers 5 is installed.
"""

import sys

import pytest
import thunder
import torch
from fsdp_pass_executors import executors_for

from fsdp_pass import FSDP
from fsdp_pass.models.hf_causal_mask import MASKING_MODULE, SDPA_MODULE, causal_mask_lookasides
from fsdp_pass.models.hf_tracing import trace_hf_models
from tests.one_rank import one_rank
from tests import mask_stand_in

SDPA = "torch.nn.functional.scaled_dot_product_attention"
B, N, D = 2, 8, 16


@pytest.fixture(scope="module")
def transformers_5():
    """The stand-in where transformers 5's ``masking_utils`` and ``integrations.sdpa_attention`` would be."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, MASKING_MODULE, mask_stand_in)
        patch.setitem(sys.modules, SDPA_MODULE, mask_stand_in)
        yield


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return mask_stand_in.Attention(D)


@pytest.fixture(scope="module")
def jitted(transformers_5, model):
    return trace_hf_models(thunder.jit(model, executors=executors_for("cpu")))


def attention_calls(jm) -> list[tuple[bool, bool]]:
    """``(a mask is passed, is_causal)`` of each SDPA call in the latest compile's forward."""
    calls = [b for b in thunder.last_traces(jm)[0].bound_symbols if b.sym.id == SDPA]
    return [(b.args[3] is not None, b.args[5]) for b in calls]


def test_thunder_traces_a_mask_without_the_lookasides(model):
    """What the stand-in stands for: under Thunder the decisions keep the mask, as transformers 5's do."""
    x = torch.randn(B, N, D)
    jm = thunder.jit(model, executors=executors_for("cpu"))
    torch.testing.assert_close(jm(x), model(x))
    assert attention_calls(jm) == [(True, False)]


def test_no_lookasides_without_transformers_5(monkeypatch):
    monkeypatch.delitem(sys.modules, MASKING_MODULE, raising=False)
    assert causal_mask_lookasides() == {}
    assert set(causal_mask_lookasides(mask_stand_in, mask_stand_in)) == {
        mask_stand_in.find_packed_sequence_indices,
        mask_stand_in._ignore_causal_mask_sdpa,
        mask_stand_in.use_gqa_in_sdpa,
    }


POSITIONS = torch.arange(N).expand(B, -1)
PACKED = torch.cat([torch.arange(3), torch.arange(N - 3)]).expand(B, -1)
RIGHT_PADDED = torch.cat([torch.ones(B, N - 2), torch.zeros(B, 2)], 1).long()


@pytest.mark.parametrize(
    "inputs, mask_kept",
    [
        ({}, False),  # the model's own positions: is_causal, no mask, as in eager
        ({"position_step": 2}, True),  # its own, not counting up by one: every token its own sequence
        ({"position_ids": POSITIONS}, True),  # the caller's: values the trace cannot read
        ({"position_ids": PACKED}, True),
        ({"attention_mask": RIGHT_PADDED}, True),
    ],
    ids=["own-positions", "own-positions-step-2", "given-positions", "packed", "padded"],
)
def test_is_causal_where_eager_decides_on_shapes(jitted, model, inputs, mask_kept):
    x = torch.randn(B, N, D, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(jitted(x, **inputs), model(x, **inputs))
    assert attention_calls(jitted) == [(mask_kept, not mask_kept)]


def test_fsdp_gives_its_module_the_lookasides(transformers_5):
    """FSDP.transform_module applies them: the sharded step's attention is causal, gradients as eager's."""
    torch.manual_seed(0)
    eager, model = mask_stand_in.Attention(D), mask_stand_in.Attention(D)
    model.load_state_dict(eager.state_dict())
    x = torch.randn(B, N, D)
    eager(x).square().mean().backward()
    with one_rank():
        jm = thunder.jit(model, transforms=[FSDP("zero3")], executors=executors_for("cpu"))
        jm(x).square().mean().backward()
        assert attention_calls(jm) == [(False, True)]
        for name, p in eager.named_parameters():
            torch.testing.assert_close(jm.get_parameter(name).grad, p.grad, msg=name)
