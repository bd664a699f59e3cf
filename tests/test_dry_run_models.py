"""What the dry-run CLI takes as ``--model``: a Hugging Face config, factories with keyword inputs, counts
printed for people, and the device a dry run lowers for.

The compiles here are of a 2-layer Hugging Face Llama from ``tests/fixtures/hf_tiny_llama/config.json`` (about
25 s each on 2 cores): one through the CLI at world size 8 in bfloat16 (its rotary embedding opens
``torch.autocast`` on the input's device, which on the meta device failed with "unsupported scalarType" before
the dry run stood the CPU in for it), and one per target device in float32 at 1024 tokens, whose saved
activations are counted by hand.
"""

import functools
import json
import math
from pathlib import Path

import pytest
import torch
from thunder.extend import get_executor

from fsdp_pass import FSDPError
from fsdp_pass.__main__ import main
from fsdp_pass.models import zoo
from fsdp_pass.models.spec import build_model
from fsdp_pass.report.dry_run import dry_run
from fsdp_pass.text import human_bytes, human_count

HF_LLAMA = Path(__file__).parent / "fixtures" / "hf_tiny_llama"


def test_counts_read_as_people_write_them():
    assert [human_count(n) for n in (0, 7, 999, 1000, 1234, 112_000, 125_248, 999_499)] == [
        "0", "7", "999", "1 K", "1.23 K", "112 K", "125 K", "999 K",
    ]  # fmt: skip
    assert [human_count(n) for n in (999_500, 6_738_415_616, 13_015_864_320, 542_000_000, 1_500_000_000_000)] == [
        "1 M", "6.74 B", "13 B", "542 M", "1.5 T",
    ]  # fmt: skip
    assert human_count(-5000) == "-5 K" and human_count(2 * 10**15) == "2,000 T"


def llama_parameters(config: dict) -> int:
    """A Llama's parameter count from its config: embedding, head, and per layer attention, MLP, two norms."""
    d, hidden, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    kv = d // config["num_attention_heads"] * config["num_key_value_heads"]
    per_layer = 2 * d * d + 2 * d * kv + 3 * d * hidden + 2 * d
    return 2 * vocab * d + config["num_hidden_layers"] * per_layer + d


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_cli_dry_run_of_a_hugging_face_llama_config(tmp_path, capsys):
    pytest.importorskip("transformers")
    argv = ["explain", "--world-size", "8", "--model", f"hf:{HF_LLAMA}", "--seq", "8", "--out", str(tmp_path),
            "--param-dtype", "bfloat16", "--device", "cpu", "--units", "blocks"]
    assert main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    config = json.loads((HF_LLAMA / "config.json").read_text())
    n_params = llama_parameters(config)
    assert f": {human_count(n_params)} parameters (meta device" in out
    assert "example inputs per rank: input_ids=(1, 8) torch.int64, labels=(1, 8) torch.int64" in out
    assert "lowered for cpu: as on the CPU: attention on the CPU flash kernel (cpu_attention" in out
    assert "\n(lowered for cpu: as on the CPU" in (tmp_path / "explain.txt").read_text()
    layers = [f"model.layers.{i}" for i in range(config["num_hidden_layers"])]
    units = ["model.embed_tokens", *layers, "model.norm+lm_head"]
    assert f"FSDP explain: strategy=zero3 world_size=8 units={len(units)}" in out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] and line.split()[0] in units]
    assert [r[0] for r in rows] == units
    assert sum(int(r[2].replace(",", "")) for r in rows) == n_params  # every parameter in one unit
    backward = (tmp_path / "backward_trace.py").read_text()
    assert all(f"# [fsdp] unit {u!r} reduce-scatter grads" in backward for u in units)  # labels give a loss
    # it returns that loss (next to its logits, whose gradient the backward receives too): no note says otherwise
    assert "loss outside the model" not in out and "clipping: fsdp_pass.clip_grad_norm_" in out
    # the users' recipe, bfloat16 with a float32 reduce: gathers priced at 2 bytes a parameter, reduces at 4
    assert "mixed precision: gather+compute bfloat16" in out and ", reduce float32," in out
    floor = [line for line in out.splitlines() if line.startswith("  floor")]
    assert floor and floor[0].split()[1:3] == human_bytes(int(7 / 8 * (2 + 4) * n_params)).split(), floor
    forward = (tmp_path / "forward_trace.py").read_text()
    gathers = [line for line in forward.splitlines() if "all_gather(" in line and " = " in line]
    assert len(gathers) == len(units) and all('bf16[' in line for line in gathers), gathers
    # the module's own casts are traced as written: the rotary table is computed in float32, attention in bfloat16
    ops = [line for line in forward.splitlines() if not line.lstrip().startswith("#")]
    assert any("torch.cos(" in line and 'f32[' in line for line in ops)
    attention = [line for line in ops if "cpu_flash_attention(" in line]
    query = attention[0].split("cpu_flash_attention(")[1].split(",")[0]
    assert any(f'{query}: "' in line and "bf16[" in line for line in forward.splitlines()), attention


SEQ = 1024  # tokens: each layer's b*h*s*s attention probabilities (16 MiB in float32) would outweigh the rest of it


@functools.cache
def _saved_activations(device: str) -> int:
    """Bytes the forward of the HF Llama keeps for the backward, gathered parameters left out, lowered for ``device``."""
    model = build_model(f"hf:{HF_LLAMA}", seq=SEQ)
    run = dry_run(model.module, model.args, 2, "zero3", kwargs=model.kwargs, device=device, units="blocks")
    assert run.device == device and (("sdpa" in run.executors) == (device == "cuda")), run.executors
    step = run.explanation.memory.step
    return step.saved_bytes - step.saved_gathered_bytes


def _hand_count(device: str) -> int:
    """What each lowering keeps for the backward, counted from the model's shapes (float32: 4 bytes, int64: 8).

    Per layer, on the CPU: 8 activations of [b, s, d] (the norm's input, its two products, the attention's
    output, the residual, the MLP norm's), 4 of [b, s, hidden] (gate, up, silu, their product), 2 norm scales
    [b, s, 1], query, key, value and the output of the CPU flash kernel ([b, h, s, hd] each) and its float32
    log-sum-exp per row [b, h, s], no b*h*s*s probabilities (decomposed, the attention kept them: 16 MiB a layer
    here, and the causal mask [s, s] twice). On CUDA the fusion recomputes the elementwise ops: 4 of [b, s, d], 2 of
    [b, s, hidden] (gate, up), 2 norm scales, query, key, value and the output for the fused kernel's backward, one
    float32 log-sum-exp per row (the memory-efficient kernel, float32: rows rounded up to 32) and its random-number
    seed and offset. Besides the layers, both keep the rotary cos and sin [s, hd], the final norm's scale, the
    logits [b, s, V] and the log-probabilities [b*s, V], the loss's count and value; the CPU also keeps the
    embedding's output and the positions (int64).
    """
    config = json.loads((HF_LLAMA / "config.json").read_text())
    b, s, layers, vocab = 1, SEQ, config["num_hidden_layers"], config["vocab_size"]
    d, hidden, h = config["hidden_size"], config["intermediate_size"], config["num_attention_heads"]
    hd, f32, i64 = d // h, 4, 8
    bsd, bsh, rows, heads = b * s * d * f32, b * s * hidden * f32, b * s * f32, b * h * s * hd * f32
    shared = 2 * s * hd * f32 + rows + b * s * vocab * f32 + b * s * vocab * f32 + i64 + f32
    if device == "cpu":
        per_layer = 8 * bsd + 4 * bsh + 2 * rows + 4 * heads + b * h * s * f32
        return layers * per_layer + shared + bsd + s * i64
    per_layer = 4 * bsd + 2 * bsh + 2 * rows + 4 * heads + b * h * math.ceil(s / 32) * 32 * f32 + 2 * i64
    return layers * per_layer + shared


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_the_dry_run_keeps_what_the_target_devices_kernels_keep():
    pytest.importorskip("transformers")
    cpu, cuda = _saved_activations("cpu"), _saved_activations("cuda")
    assert (cpu, cuda) == (_hand_count("cpu"), _hand_count("cuda"))
    assert cuda < cpu, (cuda, cpu)  # the fusion recomputes the elementwise ops the CPU keeps


def test_the_default_device_follows_the_cost_inputs():
    from fsdp_pass.cost.cost_model import DEFAULTS
    from fsdp_pass.report.dry_run import target_device

    assert [target_device(c) for c in ("h100-nvlink", "cpu-gloo", None)] == ["cuda", "cpu", "cpu"]
    assert target_device(DEFAULTS["h100-nvlink"]) == "cuda"
    with pytest.raises(FSDPError, match="A dry run lowers for 'cuda' or 'cpu', not 'tpu'"):
        dry_run(torch.nn.Linear(2, 2, device="meta"), (torch.zeros(1, 2, device="meta"),), 2, device="tpu")


def test_copying_identical_layers_prints_the_plan_of_interpreting_them_all():
    """The shortcut (five layers interpreted, the rest copied) against the full interpretation, on the default
    CUDA lowering of the built-in Llama with 7 layers and Llama's rotary embedding (the tables every layer reads): the
    same printed plan, op positions and peaks included, and the same printed traces (the copies get the names the
    interpreter would have given). Two copies: the second reads the first's residual stream."""
    module, args = zoo.build("tiny", n_layer=7, rope_theta=10000.0)
    copied, full = (dry_run(module, args, 8, device="cuda", trace_every_layer=every) for every in (False, True))
    assert copied.copied_layers == "2 of 7 layers of model.layers copied from layer 3's ops (5 interpreted)"
    assert full.copied_layers == ""
    assert str(copied.explanation) == str(full.explanation)
    assert str(copied.forward) == str(full.forward) and str(copied.backward) == str(full.backward)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_copying_identical_hugging_face_layers_prints_the_plan_of_interpreting_them_all(tmp_path):
    """As above on the Hugging Face Llama of ``tests/fixtures/hf_tiny_llama`` with 7 layers (the path users take
    with ``--model hf:DIR``): its layers' code names the rotary function's ``q`` and ``k`` after the variables in
    layer 1 too, and its prologue checks each layer's attributes (``layer_idx``, the norms' ``variance_epsilon``),
    which the copies must pass. The same printed plan and traces with and without the shortcut."""
    pytest.importorskip("transformers")
    config = json.loads((HF_LLAMA / "config.json").read_text()) | {"num_hidden_layers": 7}
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = build_model(f"hf:{tmp_path}", seq=8)
    copied, full = (dry_run(model.module, model.args, 8, kwargs=model.kwargs, device="cuda", trace_every_layer=every)
                    for every in (False, True))
    assert copied.copied_layers == "2 of 7 layers of model.layers copied from layer 3's ops (5 interpreted)"
    assert full.copied_layers == ""
    assert str(copied.explanation) == str(full.explanation)
    assert str(copied.forward) == str(full.forward) and str(copied.backward) == str(full.backward)


class _ScaledLayer(torch.nn.Module):
    def __init__(self, scale: float):
        super().__init__()
        self.fc = torch.nn.Linear(16, 16, bias=False)
        self.scale = scale  # a number the trace bakes in (the prologue checks it), as a layer's window or eps

    def forward(self, x):
        return x + self.fc(x) * self.scale


class _ScaledStack(torch.nn.Module):
    def __init__(self, scales):
        super().__init__()
        self.layers = torch.nn.ModuleList(_ScaledLayer(s) for s in scales)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def test_layers_whose_checked_attributes_differ_are_interpreted_whole():
    """Seven layers of one class and shapes whose fifth (a copied one) scales by 0.5, the traced ones by 1.0, as
    models that alternate sliding-window and full attention differ in a number the trace bakes in: the shortcut
    says so and interprets every layer, and the traces are those of the full interpretation (copying layer 3's ops
    multiplied layer 4 by 1.0: the forward traces differed)."""
    with torch.device("meta"):
        module, x = _ScaledStack([1.0, 1.0, 1.0, 1.0, 0.5, 1.0, 1.0]), torch.zeros(2, 16)
    copied, full = (dry_run(module, (x,), 2, device="cpu", units="blocks", trace_every_layer=every)
                    for every in (False, True))
    assert copied.copied_layers == (
        "every layer of layers interpreted: they do not repeat (layers.4.scale is 0.5, traced as 1.0 in layer 3)")
    assert str(copied.forward) == str(full.forward) and str(copied.explanation) == str(full.explanation)


def test_hf_config_errors_say_what_to_do(tmp_path):
    pytest.importorskip("transformers")
    with pytest.raises(FSDPError, match="(?s)No Hugging Face config at .*What to do: Give the path of a model"):
        build_model(f"hf:{tmp_path / 'nowhere'}")
    with pytest.raises(FSDPError, match="config.json is not a file"):
        build_model(f"hf:{tmp_path}")  # a folder without a config
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5"}))
    with pytest.raises(FSDPError, match="not a causal language model"):
        build_model(f"hf:{tmp_path}")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(FSDPError, match="cannot read the config"):
        build_model(f"hf:{tmp_path}")


# factories for --model package.module:factory, in each form they may return
def _linear_and_input():
    return torch.nn.Linear(4, 2), torch.zeros(3, 4)


def positional_factory():
    module, x = _linear_and_input()
    return module, (x,)


def keyword_factory():
    module, x = _linear_and_input()
    return module, {"input": x}


def both_factory():
    module, x = _linear_and_input()
    return module, (x,), {"scale": 2}


def bad_factory():
    return torch.nn.Linear(4, 2)


def test_factories_return_positional_and_keyword_inputs():
    spec = f"{__name__}:{{}}"
    factories = ("positional_factory", "keyword_factory", "both_factory")
    positional, keyword, both = (build_model(spec.format(f)) for f in factories)
    assert positional.args[0].is_meta and positional.kwargs == {}
    assert keyword.args == () and keyword.kwargs["input"].is_meta
    assert both.args[0].shape == (3, 4) and both.kwargs == {"scale": 2}
    assert both.describe_inputs() == "(3, 4) torch.float32, scale=2"
    with pytest.raises(FSDPError, match=r"returned Linear, not \(module, args\), \(module, kwargs\)"):
        build_model(spec.format("bad_factory"))
    with pytest.raises(FSDPError, match="--seq cannot change the model of the factory"):
        build_model(spec.format("positional_factory"), seq=16)
    with pytest.raises(FSDPError, match="(?s)Unknown model 'llama-9000'.*hf:<config.json or folder>"):
        build_model("llama-9000")


@pytest.mark.parametrize("level", ["none", "selective", "full"])
def test_the_step_models_peak_agrees_with_the_traced_peak_at_each_checkpoint_level(level):
    """The step model's peak (the planner's, from the functional trace's summary) against the dry run's traced peak
    (every buffer of the final traces followed) of a 2-layer zoo Llama at 256 tokens lowered for the CPU with the
    torch executor alone (not the CPU list's cpu_attention), whose decomposed attention keeps b*h*s*s probabilities:
    within 3 % with every layer kept whole or selective
    (before, the probabilities were counted twice, the attention's backward working set not at all, and a unit's
    backward held all of its activations beside its largest working set). Full checkpointing within 3 % below and
    4 % above: its units keep what the traces keep (the residual sums and the next norm's input the ops after their
    last matmul make, which the model once left out: 96 KiB here), and its peak then comes out 3.1 % above the
    traces' (the backward's working set: the safe side)."""
    module, args = zoo.build("tiny", n_layer=2, seq=256, local_batch=1)
    run = dry_run(module, args, 8, device="cpu", units="blocks", executors=[get_executor("torch")],
                  checkpoint_activations=False if level == "none" else level)
    predicted, traced = run.predict_step().peak_bytes, run.explanation.memory.peak
    assert -0.03 < predicted / traced - 1 < (0.04 if level == "full" else 0.03), (level, predicted, traced)


def _traced_kept_per_unit(forward) -> dict[str, int]:
    """Per unit, the bytes of the floating-point results the final forward trace keeps for the backward that its ops
    made after that unit's parameters were unpacked (gathered parameters and the step's inputs left out)."""
    from fsdp_pass.predicates import is_float_tensor, is_unpack_gathered, unit_of_op
    from tests.trace_facts import saved_for_backward_names

    saved, unit, out = set(saved_for_backward_names(forward)), None, {}
    for bsym in forward.bound_symbols:
        if is_unpack_gathered(bsym):
            unit = unit_of_op(bsym)
            continue
        for o in bsym.flat_proxy_outs:
            if o.name in saved and is_float_tensor(o) and unit is not None:
                saved.discard(o.name)
                out[unit] = out.get(unit, 0) + int(o.numel) * o.dtype.bytes
    return out


def test_the_step_model_keeps_per_layer_what_the_fused_cuda_lowering_keeps():
    """Per decoder layer, the bytes the step model counts as kept for the backward (its pieces' activations) against
    what the dry run's CUDA lowering keeps (torchcompile's regions and the fused attention, rematerialized by
    Thunder), on the zoo's Llama with rotary embeddings, units='blocks'. Equal but for the fused kernel's
    log-sum-exp, which the model leaves out (b*h*s*4 bytes, 0.6 % here); the embedding's unit equal. Before, the
    model kept the projections added to the residual and let the next norm recompute its input from them across
    the block boundary: 10 % less than the traces, and the 7B's auto plan at 20 GiB did not fit its traced peak."""
    module, args = zoo.build("tiny", n_layer=2, seq=64, rope_theta=10000.0)
    run = dry_run(module, args, 8, device="cuda", units="blocks")
    traced = _traced_kept_per_unit(run.forward)
    modelled: dict[str, int] = {}
    for p in run.fsdp.compiled_step.plan.summary.pieces:
        modelled[p.block] = modelled.get(p.block, 0) + p.activation_bytes
    cfg = zoo.CONFIGS["tiny"]
    lse = cfg.local_batch * cfg.n_head * 64 * 4  # float32, rows of 64 tokens (a multiple of the kernel's 32)
    layers = ["model.layers.0", "model.layers.1"]
    assert all(traced[u] == modelled[u] + lse for u in layers), [(u, traced[u], modelled[u]) for u in layers]
    # the embedding's unit: its output, the first norm's normalized input and the rotary tables every layer reads
    assert traced["model.embed"] == modelled["model.embed"], (traced["model.embed"], modelled["model.embed"])


@pytest.mark.parametrize("level", ["none", "selective"])
def test_the_step_model_keeps_per_layer_what_the_bf16_gqa_lowering_keeps(level):
    """As above with Llama 3's shape in small (grouped-query attention, one k/v head for four query heads, rotary
    embeddings) and bf16 parameters, per unit what the model keeps at each level (``kept_and_recompute``) against
    the traces. Without checkpointing the traces keep the repeated k and v, with selective checkpointing the k and v
    projections (the model counted the repeated copies at both); the norms' backward keeps a float32 upcast of its
    bf16 argument, which the fused kernel recomputes from the argument (the model dropped it with the norm's
    intermediates: a residual sum a layer and the embedding's output missing). At the selective level the model keeps
    one norm's row statistic (its rsqrt, b*s bf16 values) a layer that the traces recompute: 256 B here, against
    8 KiB for each tensor it missed or counted too many before."""
    from fsdp_pass.cost.cost_model import DEFAULTS
    from fsdp_pass.plan.mixed_precision import MixedPrecision
    from fsdp_pass.cost.candidate_costs import kept_and_recompute

    module, args = zoo.build("tiny", n_layer=2, seq=64, n_head=4, n_kv_head=1, rope_theta=10000.0)
    run = dry_run(module, args, 8, device="cuda", units="blocks", checkpoint_activations=level,
                  mixed_precision=MixedPrecision(torch.bfloat16, torch.float32, output_dtype=torch.float32))
    traced = _traced_kept_per_unit(run.forward)
    summary = run.fsdp.compiled_step.plan.summary
    spans: dict[str, list[int]] = {}
    for i, p in enumerate(summary.pieces):
        spans.setdefault(p.block, []).append(i)
    modelled = {u: kept_and_recompute(summary, range(ix[0], ix[-1] + 1), level, DEFAULTS["h100-nvlink"])[0]
                for u, ix in spans.items()}
    cfg = zoo.CONFIGS["tiny"]
    lse = cfg.local_batch * 4 * 64 * 4  # the fused attention's float32 log-sum-exp (4 heads): the model leaves it out
    row_statistic = cfg.local_batch * 64 * 2 if level == "selective" else 0
    layers = ["model.layers.0", "model.layers.1"]
    over = {u: modelled[u] + lse - traced[u] for u in layers}
    assert all(0 <= b <= row_statistic for b in over.values()), (over, [(u, traced[u], modelled[u]) for u in layers])
    assert traced["model.embed"] == modelled["model.embed"], (traced["model.embed"], modelled["model.embed"])
    # the units the step model gathers again in the backward are the traces' (the embedding's is not: its gradient
    # reads the indices only; the model once gathered it again, 500 MiB on the 2-layer 7B's peak)
    from fsdp_pass.cost.price_plan import candidate_of
    from fsdp_pass.cost.candidate_costs import unit_costs

    step = run.fsdp.compiled_step
    candidate = candidate_of(summary, step.plan, step.options)
    units = unit_costs(summary, candidate, DEFAULTS["h100-nvlink"])
    again = [summary.pieces[span.start].block for span, u, r in
             zip(candidate.spans(len(summary.pieces)), units, candidate.reshard) if u.gathered_again(r)]
    gathers = [b for b in run.backward.bound_symbols if "all_gather" in b.sym.name]
    assert len(again) == len(gathers) and "model.embed" not in again, (again, len(gathers))
