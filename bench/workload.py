"""What :mod:`bench.gpu` trains: the zoo's Llama-style LM or a Hugging Face causal LM built from its config.

``Workload.of(model, layers=..., d=..., heads=..., hidden=..., vocab=..., seq=..., batch=...)``:

1. ``model="zoo"`` (the default): :class:`fsdp_pass.models.zoo.LlamaLM` shaped by ``layers``, ``d``, ``heads``,
   ``hidden``, ``vocab`` (:data:`ZOO_DEFAULTS` where None). It returns logits; the loss is
   ``zoo.lm_loss(logits, targets)`` outside the module, from the logits cast to float32 where ``float_loss``
   (the recipe: as an HF model computes its loss, so a bfloat16 loss's rounding, 1/32 near 5, hides nothing).
2. ``model="hf:<config.json or folder>"``: the Hugging Face causal LM of that config
   (:func:`fsdp_pass.models.spec.build_model`: ``use_cache=False``, float32, nothing downloaded), ``layers`` and
   ``vocab`` overriding the config's where given. It takes ``input_ids`` and ``labels`` and returns its loss.
   With transformers 5 its forward records outputs through a module global Thunder cannot trace; the Thunder
   rows jit it with the lookasides of :mod:`fsdp_pass.models.hf_output_capture` (our rows through ``FSDP``,
   the plain ``thunder`` row by hand in :mod:`bench.systems_gpu`).
3. Built once on the meta device to learn its class, parameter count and vocabulary (nothing allocated).

``workload.build(device)`` builds it on the device from seed 0 in float32 (every row starts from the same
weights); ``batches(n, rank, device)`` gives rank ``rank``'s first ``n`` batches of the benchmark's toy language
(:func:`bench.model.make_batch`, tokens below the model's vocabulary); ``loss(module, batch)`` runs one forward and
returns the loss; ``decoder_layers(model)`` lists the modules that FSDP2 shards and checkpointing wraps one by one
(the zoo's ``model.layers``, an HF model's ``model.model.layers``, ``transformer.h`` or ``gpt_neox.layers``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from bench.model import make_batch
from fsdp_pass.models import zoo
from fsdp_pass.models.spec import build_model, spec_kind

ZOO = "zoo"
ZOO_DEFAULTS = {"layers": 8, "d": 2048, "heads": 16, "hidden": 5632, "vocab": 32000}
ZOO_ONLY = ("d", "heads", "hidden")  # the zoo model's shape; an HF model takes its own from its config
HF_LAYER_PATHS = (("model", "layers"), ("transformer", "h"), ("gpt_neox", "layers"))


@dataclass(frozen=True)
class Workload:
    model: str  # "zoo" or "hf:<config>"
    shape: dict  # the zoo model's layers, d, heads, hidden, vocab; an HF model's layers and vocab overrides
    seq: int
    batch: int
    class_name: str
    n_params: int
    vocab: int
    n_layers: int
    float_loss: bool = False  # the zoo model's loss from float32 logits

    @staticmethod
    def of(model: str = ZOO, *, seq: int, batch: int, float_loss: bool = False, **shape) -> Workload:
        """The workload ``model`` names, shaped by ``shape`` (see the module's docstring); ValueError if ``model``
        is neither ``zoo`` nor ``hf:...``, or an HF model is given a zoo-only shape."""
        if model == ZOO:
            shape = {k: shape.get(k) if shape.get(k) is not None else v for k, v in ZOO_DEFAULTS.items()}
        elif spec_kind(model) == "hf":
            given = [f"--{k}" for k in ZOO_ONLY if shape.get(k) is not None]
            if given:
                raise ValueError(f"{', '.join(given)} shape the zoo model; an HF model takes its own from its config "
                                 "(copy the config and edit it)")
            shape = {k: shape.get(k) for k in ("layers", "vocab")}
        else:
            raise ValueError(f"--model {model!r}: give 'zoo' or 'hf:<config.json or folder>'")
        sketch = Workload(model, shape, seq, batch, "", 0, 0, 0)
        meta = sketch._build("meta")
        vocab = meta.cfg.vocab if model == ZOO else meta.config.vocab_size
        layers = len(sketch.decoder_layers(meta))
        return Workload(model, shape, seq, batch, type(meta).__name__, zoo.param_count(meta), vocab, layers, float_loss)

    @property
    def is_hf(self) -> bool:
        return self.model != ZOO

    def build(self, device) -> nn.Module:
        """The model on ``device``, float32, from seed 0."""
        torch.manual_seed(0)
        return self._build(device)

    def batches(self, n: int, rank: int, device) -> list[dict]:
        """Rank ``rank``'s batches 0..n-1: ``input_ids``/``labels`` (HF: the model shifts them) or ``idx``/``targets``."""
        out = []
        for step in range(n):
            x, y = make_batch(step, self.batch, self.seq, rank, self.vocab)
            batch = {"input_ids": x, "labels": x} if self.is_hf else {"idx": x, "targets": y}
            out.append({k: v.to(device) for k, v in batch.items()})
        return out

    def loss(self, module, batch: dict) -> torch.Tensor:
        if self.is_hf:
            return module(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        logits = module(batch["idx"])
        return zoo.lm_loss(logits.float() if self.float_loss else logits, batch["targets"])

    def decoder_layers(self, model: nn.Module) -> nn.ModuleList:
        if not self.is_hf:
            return model.layers
        for outer, inner in HF_LAYER_PATHS:
            layers = getattr(getattr(model, outer, None), inner, None)
            if isinstance(layers, nn.ModuleList):
                return layers
        paths = ", ".join(f"model.{a}.{b}" for a, b in HF_LAYER_PATHS)
        raise ValueError(f"{type(model).__name__}: no decoder layers at {paths}")

    def describe(self) -> str:
        """The table header's model: class, source, shape, parameters."""
        if self.is_hf:
            return (f"{self.class_name} ({self.model}, {self.n_layers} decoder layers, vocab {self.vocab}), "
                    f"{self.n_params / 1e6:.1f} M parameters")
        s = self.shape
        return (f"zoo {self.class_name} ({s['layers']} layers, d {s['d']}, hidden {s['hidden']}, {s['heads']} heads, "
                f"vocab {s['vocab']}), {self.n_params / 1e6:.0f} M parameters")

    def _build(self, device) -> nn.Module:
        if self.is_hf:
            return build_model(self.model, device, layers=self.shape["layers"], vocab=self.shape["vocab"]).module
        s = self.shape
        cfg = zoo.Config(vocab=s["vocab"], d=s["d"], n_head=s["heads"], hidden=s["hidden"], n_layer=s["layers"],
                         seq=self.seq, local_batch=self.batch)
        with torch.device(device):
            return zoo.LlamaLM(cfg)

