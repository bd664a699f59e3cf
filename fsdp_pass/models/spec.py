"""What ``python -m fsdp_pass explain --model SPEC`` names: a model and one rank's example inputs, on meta.

``build_model(spec, device="meta", *, layers=None, seq=None, batch=None, vocab=None) -> ExampleModel``; ``spec``
(of the kind ``spec_kind(spec)`` names: ``"builtin"``, ``"hf"`` or ``"factory"``) is

- a built-in config of :data:`fsdp_pass.models.zoo.CONFIGS` (``tiny``, ``bench``, ``llama2-7b``, ...): the zoo's
  Llama-style model with its loss inside; ``layers``, ``seq``, ``batch``, ``vocab`` override the config;
- ``hf:<config.json or folder>``: a Hugging Face causal LM built from its config alone
  (:mod:`fsdp_pass.models.hf_config`); ``layers``, ``seq``, ``batch``, ``vocab`` apply too;
- ``package.module:factory``: a function of no arguments, called under ``torch.device(device)``, returning
  the module and its inputs in one of three forms: ``(module, args)``, ``(module, kwargs)`` with ``kwargs``
  a dict of keyword inputs, or ``(module, args, kwargs)``. It builds its own inputs, so ``layers``,
  ``seq``, ``batch``, ``vocab`` are refused.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

import torch
from torch import nn

from fsdp_pass.errors import check, fail
from fsdp_pass.models import zoo
from fsdp_pass.models.hf_config import hf_causal_lm

HF_PREFIX = "hf:"
FACTORY_FORMS = "(module, args), (module, kwargs) or (module, args, kwargs)"


@dataclass(frozen=True)
class ExampleModel:
    """A module and one rank's example inputs: ``module(*args, **kwargs)`` is one step's forward."""

    module: nn.Module
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)

    def describe_inputs(self) -> str:
        """``(4, 64) torch.int64, labels=(4, 64) torch.int64``: shapes and dtypes, keyword inputs by name."""
        named = [(None, a) for a in self.args] + list(self.kwargs.items())
        return ", ".join((f"{name}=" if name else "") + _describe(value) for name, value in named)


def spec_kind(spec: str) -> str:
    """``"hf"`` (``hf:<config>``), ``"factory"`` (``package.module:factory``) or ``"builtin"`` (a zoo config's name)."""
    if spec.startswith(HF_PREFIX):
        return "hf"
    return "factory" if ":" in spec else "builtin"


def build_model(spec: str, device="meta", *, layers=None, seq=None, batch=None, vocab=None) -> ExampleModel:
    """The model ``spec`` names (see the module's docstring), built on ``device``, with its example inputs."""
    kind = spec_kind(spec)
    if kind == "hf":
        module, kwargs = hf_causal_lm(spec[len(HF_PREFIX) :], device, layers=layers, batch=batch, seq=seq, vocab=vocab)
        return ExampleModel(module, (), kwargs)
    if kind == "factory":
        _refuse_overrides(spec, layers=layers, seq=seq, batch=batch, vocab=vocab)
        return _from_factory(spec, device)
    check(
        spec in zoo.CONFIGS,
        lambda: f"Unknown model {spec!r}.",
        f"Name one of {sorted(zoo.CONFIGS)}, give hf:<config.json or folder> (a Hugging Face config), or "
        f"'package.module:factory' (a function returning {FACTORY_FORMS}).",
    )
    module, args = zoo.build(spec, device, n_layer=layers, seq=seq, local_batch=batch, vocab=vocab)
    return ExampleModel(module, args)


def _refuse_overrides(spec: str, **overrides) -> None:
    given = [f"--{name}" for name, value in overrides.items() if value is not None]
    check(
        not given,
        lambda: f"{', '.join(given)} cannot change the model of the factory {spec!r}: it builds its own inputs.",
        "Leave them out, or let the factory read them (e.g. from environment variables) and build accordingly.",
    )


def _from_factory(spec: str, device) -> ExampleModel:
    module_name, _, attr = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        fail(f"Cannot load the model factory {spec!r}: {e}.", "Give 'package.module:function', importable here.")
    with torch.device(device):
        built = factory()
    return _example_of(spec, built)


def _example_of(spec: str, built) -> ExampleModel:
    """The factory's result in one of :data:`FACTORY_FORMS`, as an :class:`ExampleModel`."""
    check(
        isinstance(built, tuple) and len(built) in (2, 3) and isinstance(built[0], nn.Module),
        lambda: f"The factory {spec!r} returned {_kind(built)}, not {FACTORY_FORMS}.",
        f"Return one of {FACTORY_FORMS} from the factory: a torch.nn.Module, a tuple of positional inputs, "
        "a dict of keyword inputs.",
    )
    if len(built) == 3:
        module, args, kwargs = built
    elif isinstance(built[1], dict):
        (module, kwargs), args = built, ()
    else:
        (module, args), kwargs = built, {}
    check(
        isinstance(kwargs, dict) and all(isinstance(k, str) for k in kwargs),
        lambda: f"The factory {spec!r} returned keyword inputs of type {_kind(kwargs)}, not a dict of names.",
        "Return the keyword inputs as a dict, e.g. {'input_ids': ids, 'labels': ids}.",
    )
    return ExampleModel(module, tuple(args) if isinstance(args, (tuple, list)) else (args,), dict(kwargs))


def _kind(value) -> str:
    if isinstance(value, tuple):
        return f"a tuple of {len(value)} ({', '.join(type(v).__name__ for v in value)})"
    return type(value).__name__


def _describe(value) -> str:
    return f"{tuple(value.shape)} {value.dtype}" if isinstance(value, torch.Tensor) else repr(value)
