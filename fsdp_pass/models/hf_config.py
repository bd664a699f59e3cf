"""A Hugging Face causal language model from its config alone, on the meta device: no weights, no network.

``hf_causal_lm(path, device="meta", *, layers=None, batch=None, seq=None, vocab=None) -> (module, kwargs)``, what
``python -m fsdp_pass explain --model hf:<path>`` dry-runs:

1. ``path`` is a ``config.json`` or a folder holding one (a model's folder as Hugging Face saves it; the
   weights, if there, are not read). It is read with ``AutoConfig.from_pretrained(local_files_only=True)``:
   a path that is not there is an error here, never a download.
2. ``use_cache=False``: a training step keeps no KV cache (and Thunder traces the step without one).
   ``layers`` overrides ``num_hidden_layers``; ``vocab`` overrides ``vocab_size`` (the training loop's byte
   vocabulary), and the special tokens (pad, bos, eos) whose ids do not fit in it are dropped: the model is fed
   no token but those of the vocabulary, and an embedding's padding row must lie inside it.
3. ``AutoModelForCausalLM.from_config`` under ``torch.device(device)``: float32 parameters, the master
   weights a training run keeps (``--param-dtype bfloat16`` for mixed precision), whatever the config's
   ``torch_dtype`` says about the published weights.
4. The keyword inputs of one rank's step: ``input_ids`` and ``labels`` (so the model returns its loss and
   the traces cover the whole step), ``batch`` x ``seq`` tokens. By default one sequence of the model's
   ``max_position_embeddings``, at most :data:`MAX_DEFAULT_SEQ`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from fsdp_pass.errors import check, fail

MAX_DEFAULT_SEQ = 4096  # the default sequence is the model's context, up to this
SEQ_WITHOUT_CONTEXT = 2048  # when the config names no max_position_embeddings
CONFIG_FILE = "config.json"
SPECIAL_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id")


def hf_causal_lm(path: str | Path, device="meta", *, layers=None, batch=None, seq=None, vocab=None):
    """``(module, kwargs)``: the causal LM of the config at ``path`` built on ``device``, and its inputs."""
    config = _read_config(_config_file(path))
    config.use_cache = False
    if layers is not None:
        _set_layers(config, layers, path)
    if vocab is not None:
        _set_vocab(config, vocab)
    module = _build(config, device, path)
    return module, example_inputs(config, device, batch or 1, seq or default_seq(config))


def default_seq(config) -> int:
    """The model's context length, at most :data:`MAX_DEFAULT_SEQ`."""
    context = getattr(config, "max_position_embeddings", None)
    return min(context, MAX_DEFAULT_SEQ) if context else SEQ_WITHOUT_CONTEXT


def example_inputs(config, device, batch: int, seq: int) -> dict[str, torch.Tensor]:
    """One rank's ``input_ids`` and ``labels`` (the same tokens: the model shifts them itself)."""
    with torch.device(device):
        input_ids = torch.zeros(batch, seq, dtype=torch.long)
    return {"input_ids": input_ids, "labels": input_ids.clone()}


def _transformers():
    try:
        import transformers
    except ImportError:
        fail(
            "--model hf:... builds the model with Hugging Face transformers, which is not installed here.",
            "pip install -e '.[hf]' (transformers; 4.52 was checked), or give a built-in name or "
            "package.module:factory.",
        )
    return transformers


def _config_file(path) -> Path:
    file = Path(path).expanduser()
    if file.is_dir():
        file = file / CONFIG_FILE
    check(
        file.is_file(),
        lambda: f"No Hugging Face config at {str(path)!r} ({file} is not a file).",
        "Give the path of a model's config.json, or of the folder that holds it (nothing is downloaded).",
    )
    return file


def _read_config(file: Path):
    try:
        return _transformers().AutoConfig.from_pretrained(str(file), local_files_only=True)
    except (OSError, ValueError) as e:
        fail(
            f"transformers cannot read the config {str(file)!r}: {_first_line(e)}",
            "Give a model's config.json as Hugging Face writes it (with its model_type, e.g. 'llama').",
        )


def _set_layers(config, layers: int, path) -> None:
    check(
        hasattr(config, "num_hidden_layers"),
        lambda: f"--layers overrides num_hidden_layers, and the config at {str(path)!r} has none.",
        "Leave out --layers, or edit the number of layers in a copy of the config.",
    )
    config.num_hidden_layers = layers


def _set_vocab(config, vocab: int) -> None:
    config.vocab_size = vocab
    for name in SPECIAL_TOKEN_IDS:
        if isinstance(getattr(config, name, None), int) and getattr(config, name) >= vocab:
            setattr(config, name, None)


def _build(config, device, path):
    transformers = _transformers()
    try:
        with torch.device(device):
            return transformers.AutoModelForCausalLM.from_config(config, **{_dtype_keyword(transformers): torch.float32})
    except ValueError as e:
        fail(
            f"The config at {str(path)!r} is not a causal language model transformers knows: {_first_line(e)}",
            "Give the config of a decoder LM (e.g. Llama, Mistral, Qwen2, GPT-2), or wrap the model in a "
            "package.module:factory that returns (module, args, kwargs).",
        )


def _dtype_keyword(transformers) -> str:
    """``from_config``'s dtype keyword: ``dtype`` from transformers 5 on (where ``torch_dtype`` warns that it is
    deprecated), ``torch_dtype`` before (where ``dtype`` would reach the model's constructor)."""
    return "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
