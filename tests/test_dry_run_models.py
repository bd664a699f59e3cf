"""What the dry-run CLI takes as ``--model``: a Hugging Face config, factories with keyword inputs, and counts
printed for people.

The one compile here is a 2-layer Hugging Face Llama from ``tests/fixtures/hf_tiny_llama/config.json`` at
world size 8 (about 25 s on 2 cores): its rotary embedding opens ``torch.autocast`` on the input's device,
which on the meta device failed with "unsupported scalarType" before the dry run stood the CPU in for it.
"""

import json
from pathlib import Path

import pytest
import torch

from fsdp_pass import FSDPError
from fsdp_pass.__main__ import main
from fsdp_pass.models.spec import build_model
from fsdp_pass.report.text import human_bytes, human_count

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
            "--param-dtype", "bfloat16"]
    assert main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    config = json.loads((HF_LLAMA / "config.json").read_text())
    n_params = llama_parameters(config)
    assert f": {human_count(n_params)} parameters (meta device" in out
    assert "example inputs per rank: input_ids=(1, 8) torch.int64, labels=(1, 8) torch.int64" in out
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
    assert [line for line in ops if "torch.matmul(" in line and "bf16[" in line]


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
