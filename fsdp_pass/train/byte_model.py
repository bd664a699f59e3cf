"""The model the training loop trains: what ``--model`` names (:mod:`fsdp_pass.models.spec`), with a byte vocabulary,
and how one batch of byte windows becomes its loss.

``byte_model(spec, device, layers=None, seq=None) -> ByteModel``:

1. ``spec`` is a built-in config (the zoo's Llama-style LM, its loss inside) or ``hf:<config>`` (a Hugging Face
   causal LM from its config); ``package.module:factory`` is refused, since its inputs are its own, not bytes.
2. The model is built by :func:`~fsdp_pass.models.spec.build_model` on ``device`` (initialized by the
   current torch seed) with its vocabulary set to :data:`~fsdp_pass.train.text_data.BYTE_VOCAB` (256 tokens,
   one per byte); ``layers`` and ``seq`` override the spec as they do for ``explain``.
3. ``ByteModel.loss(jm, windows)``: the mean next-byte cross-entropy of ``(rows, seq + 1)`` windows. The
   built-in model is called ``jm(windows[:, :-1], windows[:, 1:])`` (inputs and their next bytes); a Hugging
   Face model ``jm(input_ids=windows[:, :-1], labels=windows[:, :-1]).loss``: it shifts the labels itself,
   so its ``seq`` inputs predict ``seq - 1`` bytes and the window's last byte is not read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fsdp_pass.errors import check
from fsdp_pass.models.spec import HF_PREFIX, build_model, spec_kind
from fsdp_pass.train.text_data import BYTE_VOCAB


@dataclass(frozen=True)
class ByteModel:
    """A module built for byte tokens, and whether it is a Hugging Face model (called with keyword inputs)."""

    module: nn.Module
    spec: str
    hugging_face: bool

    def loss(self, jm, windows: torch.Tensor) -> torch.Tensor:
        """The mean next-byte loss of ``windows`` through ``jm`` (the jitted :attr:`module`): item 3 above."""
        inputs = windows[:, :-1]
        if self.hugging_face:
            return jm(input_ids=inputs, labels=inputs).loss
        return jm(inputs, windows[:, 1:])

    def parameters(self) -> int:
        return sum(p.numel() for p in self.module.parameters())


def byte_model(spec: str, device, layers: int | None = None, seq: int | None = None) -> ByteModel:
    """The model ``spec`` names, built on ``device`` with a vocabulary of bytes (items 1-2 above)."""
    kind = spec_kind(spec)
    check(
        kind != "factory",
        lambda: f"--model {spec}: the loop trains on bytes of text, and a factory builds a model with inputs of "
        "its own.",
        f"Name a built-in config or give {HF_PREFIX}<config.json or folder>; the loop sets its vocabulary to "
        f"{BYTE_VOCAB} bytes.",
    )
    built = build_model(spec, device, layers=layers, seq=seq, vocab=BYTE_VOCAB)
    return ByteModel(built.module, spec, hugging_face=kind == "hf")
