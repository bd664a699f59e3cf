"""transformers 5's causal mask and output capture under FSDP (:mod:`fsdp_pass.models.hf_causal_mask`,
:mod:`fsdp_pass.models.hf_output_capture`), against the real transformers: the CI's constraints pin transformers 5.

Each family's tiny model (seed 0, float32) runs one ZeRO-3 step under FSDP on a gloo group of this process alone,
and in eager, for each batch below: the loss and every parameter's gradient as eager's, and each attention call
with eager's mask and ``is_causal`` (eager's SDPA calls recorded by a spy). One FSDP jit per family, a compile per
batch that decides otherwise (a new outcome of a decision the prologue holds). ``.ci/run`` runs them again on the
oldest transformers supported (4.52.4), where the loss and gradients are checked. The last tests run without
transformers: the warnings when a function is missing.
"""

import sys
import types

import pytest
import thunder
import torch
import torch.nn.functional as F
from fsdp_pass_executors import executors_for

from fsdp_pass import FSDP, FSDPError
from fsdp_pass.models.hf_causal_mask import MASKING_MODULE, causal_mask_lookasides
from fsdp_pass.models.hf_output_capture import CAPTURE_MODULE, capture_lookasides
from tests.one_rank import one_rank

SDPA = "torch.nn.functional.scaled_dot_product_attention"
B, N, VOCAB = 2, 16, 256
IDS = torch.randint(0, VOCAB, (B, N), generator=torch.Generator().manual_seed(0))
ONES = torch.ones(B, N, dtype=torch.long)
RIGHT_PADDED = torch.cat([ONES[:, :11], torch.tensor([[1] * 5, [0] * 5])], 1)
LEFT_PADDED = torch.cat([torch.tensor([[1] * 3, [0] * 3]), ONES[:, 3:]], 1)
POSITIONS = torch.arange(N).expand(B, -1)
PACKED = torch.cat([torch.arange(6), torch.arange(N - 6)]).expand(B, -1)  # two documents in each row


def _transformers_major() -> int:
    try:
        import transformers
    except ImportError:
        return 0
    return int(transformers.__version__.split(".")[0])


FIVE = _transformers_major() >= 5
needs_transformers = pytest.mark.skipif(_transformers_major() == 0, reason="transformers is not installed")
needs_5 = pytest.mark.skipif(not FIVE, reason="transformers 5's output capture and experts implementations")


class MadeInside(torch.nn.Module):
    """Positions the traced function makes itself: ``packed`` two documents of N/2 tokens in one row (an arange
    expanded and reshaped), ``descending`` ``N - arange(N)``: neither is one sequence counting up by one."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels, how="packed"):
        n = input_ids.shape[1]
        positions = (torch.arange(n // 2).expand(2, n // 2).reshape(1, n) if how == "packed"
                     else (n - torch.arange(n)).unsqueeze(0))
        return self.model(input_ids=input_ids, labels=labels, position_ids=positions)


def _build(family: str) -> torch.nn.Module:
    import transformers as hf

    from bench.recipe_parity import build_hf

    if family == "qwen2-sliding":  # layer 0 full attention, layer 1 a window of 4 tokens
        torch.manual_seed(0)
        return hf.Qwen2ForCausalLM(hf.Qwen2Config(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, use_cache=False, use_sliding_window=True,
            sliding_window=4, max_window_layers=1))
    if family == "mixtral":  # the experts as batched matmuls: the default loops over the experts each token picked
        torch.manual_seed(0)
        return hf.MixtralForCausalLM(hf.MixtralConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
            use_cache=False, router_aux_loss_coef=0.5, experts_implementation="batched_mm"))
    if family == "llama-made-positions":
        return MadeInside(build_hf("llama", 1))
    return build_hf(family, 1)


@pytest.fixture(scope="module")
def group():
    with one_rank():
        yield


_pairs: dict = {}


@pytest.fixture
def pair(group, request):
    """(eager, FSDP-jitted) copies of the family's model, one per module."""
    family = request.param
    if family not in _pairs:
        eager, model = _build(family), _build(family)
        model.load_state_dict(eager.state_dict())
        _pairs[family] = eager, thunder.jit(model, transforms=[FSDP("zero3")], executors=executors_for("cpu"))
    yield _pairs[family]
    for module in _pairs[family]:
        module.zero_grad(set_to_none=True)


def _eager_attention(eager, inputs) -> tuple[torch.Tensor, list]:
    """The eager loss, its backward done, and each SDPA call's (a mask is passed, is_causal)."""
    calls, sdpa = [], F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        calls.append((attn_mask is not None, is_causal))
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kwargs)

    F.scaled_dot_product_attention = spy
    try:
        loss = eager(input_ids=IDS, labels=IDS, **inputs).loss
    finally:
        F.scaled_dot_product_attention = sdpa
    loss.backward()
    return loss, calls


def _jitted_attention(jm) -> list:
    forward = thunder.last_traces(jm)[0]
    return [(b.args[3] is not None, b.args[5]) for b in forward.bound_symbols if b.sym.id == SDPA]


CAUSAL, MASKED = (False, True), (True, False)  # an SDPA call: (a mask is passed, is_causal)
CASES = [  # id, family, inputs, eager's attention calls, whether an earlier case made the compile this one takes
    ("llama", "llama", {}, [CAUSAL], False),
    ("llama-all-ones", "llama", {"attention_mask": ONES}, [CAUSAL], False),
    ("llama-right-padded", "llama", {"attention_mask": RIGHT_PADDED}, [MASKED], False),
    ("llama-all-ones-again", "llama", {"attention_mask": ONES}, [CAUSAL], True),
    ("llama-positions", "llama", {"position_ids": POSITIONS}, [CAUSAL], False),
    ("llama-packed", "llama", {"position_ids": PACKED}, [MASKED], False),
    ("llama-packed-made-inside", "llama-made-positions", {"how": "packed"}, [MASKED], False),
    ("llama-descending-made-inside", "llama-made-positions", {"how": "descending"}, [MASKED], False),
    ("qwen2-sliding", "qwen2-sliding", {}, [CAUSAL, MASKED], False),  # the window is shorter than the row
    ("qwen2-sliding-all-ones", "qwen2-sliding", {"attention_mask": ONES}, [CAUSAL, MASKED], False),
    ("qwen2-sliding-left-padded", "qwen2-sliding", {"attention_mask": LEFT_PADDED}, [MASKED, MASKED], False),
    ("qwen2-sliding-packed", "qwen2-sliding", {"position_ids": PACKED}, [MASKED, MASKED], False),
    ("gpt2", "gpt2", {}, [CAUSAL], False),
    ("gpt2-all-ones", "gpt2", {"attention_mask": ONES}, [CAUSAL], False),
    ("gpt2-right-padded", "gpt2", {"attention_mask": RIGHT_PADDED}, [MASKED], False),
    ("neox", "neox", {}, [CAUSAL], False),
    ("neox-right-padded", "neox", {"attention_mask": RIGHT_PADDED}, [MASKED], False),
    ("neox-packed", "neox", {"position_ids": PACKED}, [MASKED], False),
]


@needs_transformers
@pytest.mark.parametrize(("pair", "inputs", "calls", "reuses"), [c[1:] for c in CASES], ids=[c[0] for c in CASES],
                         indirect=["pair"])
def test_fsdp_step_is_eagers(pair, inputs, calls, reuses):
    """The loss, every gradient and each attention's mask and is_causal as in eager; a batch whose decisions an
    earlier compile made (all ones again) takes that compile, its prologue holding them. With transformers 4 (the
    range's other end) the loss and gradients: it decides otherwise, and on an all-ones mask keeps the mask under
    Thunder where eager drops it (no lookasides there)."""
    eager, jm = pair
    compiles = thunder.cache_misses(jm)
    expected, eager_calls = _eager_attention(eager, inputs)
    loss = jm(input_ids=IDS, labels=IDS, **inputs).loss
    loss.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=0)
    for name, p in eager.named_parameters():
        torch.testing.assert_close(jm.get_parameter(name).grad, p.grad, msg=name)
    if not FIVE:
        return
    assert eager_calls == calls  # what the case stands for
    assert _jitted_attention(jm) == calls
    if reuses and compiles > 0:  # (not when the case runs alone)
        assert thunder.cache_misses(jm) == compiles
        assert "fsdp_pass_decision_holds(" in str(thunder.last_prologue_traces(jm)[-1])


@needs_5
@pytest.mark.parametrize("pair", ["llama"], indirect=True)
def test_outputs_asked_for_raise_what_to_do(pair):
    eager, jm = pair
    with pytest.raises(FSDPError, match="(?s)asked to return its hidden_states.*Pass output_hidden_states=False"):
        jm(input_ids=IDS, labels=IDS, output_hidden_states=True)


@needs_transformers
@pytest.mark.parametrize("pair", ["llama"], indirect=True)
def test_a_call_that_would_build_a_kv_cache_says_what_to_do(pair):
    """A model whose config has use_cache=True (what from_pretrained gives) builds a KV cache in its forward, which
    Thunder cannot trace under transformers 5; turned off silently, transformers would read packed positions
    differently from eager. So the call is an FSDPError, raised before Thunder traces anything (no compile here),
    as is a call that asks for a cache. (The cases above step the same model with use_cache=False.)"""
    eager, jm = pair
    what_to_do = "(?s)would make LlamaForCausalLM build a KV cache.*What to do: Set model.config.use_cache = False"
    for asked in ({"use_cache": True}, {"past_key_values": object()}):
        with pytest.raises(FSDPError, match=what_to_do):
            jm(input_ids=IDS, labels=IDS, **asked)
    compiles = thunder.cache_misses(jm)
    jm._model.config.use_cache = True
    try:
        with pytest.raises(FSDPError, match=what_to_do):
            jm(input_ids=IDS, labels=IDS)
    finally:
        jm._model.config.use_cache = False
    assert thunder.cache_misses(jm) == compiles


@needs_5
@pytest.mark.parametrize("pair", ["mixtral"], indirect=True)
def test_router_logits_raise_what_to_do(pair):
    """A mixture of experts asked for its router logits (the load-balancing loss): an FSDPError says which flag to
    turn off and that the loss then has no load-balancing term. (The router's in-place ``top /= top.sum(-1)``, which
    Thunder 0.2.6 differentiates wrongly, is held to eager's gradients by tests/test_in_place_ops.py.)"""
    eager, jm = pair
    with pytest.raises(FSDPError, match="(?s)router_logits.*Pass output_router_logits=False.*load-balancing"):
        jm(input_ids=IDS, labels=IDS, output_router_logits=True)


def test_a_missing_function_warns_with_its_name():
    masking = types.ModuleType(MASKING_MODULE)  # find_packed_sequence_indices renamed
    masking._ignore_causal_mask_sdpa = lambda padding_mask, *lengths: False
    sdpa = types.ModuleType("transformers.integrations.sdpa_attention")
    sdpa.use_gqa_in_sdpa = lambda mask, key, value: False
    with pytest.warns(UserWarning, match="no function transformers.masking_utils.find_packed_sequence_indices"):
        lookasides = causal_mask_lookasides(masking, sdpa)
    assert set(lookasides) == {masking._ignore_causal_mask_sdpa, sdpa.use_gqa_in_sdpa}
    capturing = types.ModuleType(CAPTURE_MODULE)
    capturing.CompileableContextVar = type("CompileableContextVar", (), {"get": lambda s: None})
    with pytest.warns(UserWarning, match="has no CompileableContextVar.set, CompileableContextVar.reset"):
        assert capture_lookasides(capturing) == {}


def test_no_lookasides_without_transformers_5(monkeypatch):
    monkeypatch.delitem(sys.modules, MASKING_MODULE, raising=False)
    monkeypatch.delitem(sys.modules, CAPTURE_MODULE, raising=False)
    assert causal_mask_lookasides() == {} and capture_lookasides() == {}
