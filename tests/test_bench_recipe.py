"""bench.gpu's recipe mode without running the benchmark (one process, no process group): ``--model hf:<config>``
builds the Hugging Face model from its config, ``--recipe`` gives ours and FSDP2 the same mixed-precision policy,
``--checkpoint-activations`` wraps the decoder layers, and the table's header names the model, the policy and
the command. The benchmark itself (every row trained) is run by hand: ``python -m bench.gpu --help``."""

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from bench.gpu import parse_args, table  # noqa: E402
from bench.systems_gpu import _checkpoint_layers  # noqa: E402

TINY = "hf:tests/fixtures/hf_tiny_llama"
ONE_B = "hf:bench/configs/llama-1b"
RECIPE = ["--device", "cpu", "--model", TINY, "--recipe", "--seq", "16", "--batch", "2"]


def test_recipe_arguments_build_the_hf_model_and_its_policies():
    args = parse_args(RECIPE)
    w, p = args.workload, args.precision
    assert (w.class_name, w.n_params, w.n_layers, w.vocab) == ("LlamaForCausalLM", 125248, 2, 256)
    assert p.is_recipe and p.model_dtype == torch.float32 and p.compute_dtype == torch.bfloat16
    fsdp2 = p.fsdp2_policy()
    assert (fsdp2.param_dtype, fsdp2.reduce_dtype) == (torch.bfloat16, torch.float32)
    ours = p.ours()
    assert (ours.param_dtype, ours.reduce_dtype) == (torch.bfloat16, torch.float32)
    plain = parse_args(["--device", "cpu", "--model", TINY]).precision
    assert plain.ours() is None and plain.fsdp2_policy().param_dtype is None


def test_the_1b_config_is_tinyllamas_shape():
    w = parse_args(["--model", ONE_B, "--recipe"]).workload
    assert (w.class_name, w.n_layers, w.vocab, w.n_params) == ("LlamaForCausalLM", 22, 32000, 1_100_048_384)
    assert Path(ONE_B[3:], "config.json").is_file()


@pytest.mark.parametrize("extra", [["--dtype", "bfloat16"], ["--d", "128"], ["--model", "llama2-7b"]],
                         ids=["recipe-with-dtype", "zoo-width-on-hf", "unknown-model"])
def test_contradictory_arguments_are_refused(extra, capsys):
    with pytest.raises(SystemExit):
        parse_args([*RECIPE, *extra])
    assert "error:" in capsys.readouterr().err


def test_hf_model_is_seeded_returns_its_loss_and_checkpoints_its_layers():
    w = parse_args(RECIPE).workload
    a, b = w.build("cpu"), w.build("cpu")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert all(p.dtype == torch.float32 for p in a.parameters())
    assert w.decoder_layers(a) is a.model.layers
    batch = w.batches(1, rank=0, device="cpu")[0]
    assert batch["input_ids"].shape == (2, 16) and int(batch["input_ids"].max()) < w.vocab
    loss = w.loss(a, batch)
    loss.backward()
    _checkpoint_layers(b, w.decoder_layers)
    assert all(type(layer).__name__ == "CheckpointWrapper" for layer in w.decoder_layers(b))
    checkpointed = w.loss(b, batch)
    checkpointed.backward()
    assert torch.equal(loss, checkpointed)
    assert torch.equal(a.model.layers[0].mlp.up_proj.weight.grad,
                       w.decoder_layers(b)[0]._checkpoint_wrapped_module.mlp.up_proj.weight.grad)


def test_table_names_model_policy_and_command_and_compares_losses():
    args = parse_args([*RECIPE, "--checkpoint-activations", "--only", "fsdp2,ours zero3"])
    row = {"ms": 10.0, "warmup_s": 1.0, "peak": 1 << 20}
    text = table([{"name": "fsdp2", "loss": 5.0, **row}, {"name": "ours zero3", "loss": 5.0002, **row}], args)
    head, policy, command, *_ = text.splitlines()
    assert "LlamaForCausalLM (hf:tests/fixtures/hf_tiny_llama, 2 decoder layers, vocab 256), 0.1 M parameters" in head
    assert "bfloat16 compute, float32 reduce" in policy and "activation checkpointing" in policy
    assert command.endswith("--checkpoint-activations --only 'fsdp2,ours zero3'")
    assert "+4.0e-05" in text  # ours' loss relative to fsdp2's
    assert "torch.autocast" not in text  # no row without FSDP ran, so no autocast note
    failed = table([{"name": "fsdp2", "loss": 5.0, **row}, {"name": "thunder", "error": "TypeError: boom"}], args)
    assert "thunder: TypeError: boom" in failed and "torch.autocast(bfloat16)" in failed
