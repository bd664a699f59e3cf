"""A Hugging Face model's KV cache, which a training step does not use and Thunder cannot trace.

A model loaded with ``from_pretrained`` has ``config.use_cache=True`` (what generation wants), so its forward
builds a ``DynamicCache`` and fills it with every layer's keys and values, even in a training step. Thunder 0.2.6
cannot trace that cache under transformers 5: building it iterates the config's per-layer view, whose attributes
Thunder's interpreter loses ("'_PerLayerConfigView' object has no attribute '_config'"), and filling it
concatenates onto an empty tensor Thunder's ``cat`` refuses. Turning the cache off behind the user's back would
change more than the outputs: transformers reads packed ``position_ids`` as separate documents only without a
cache (its "training setup"), so the loss of a packed batch would differ from eager's.

So a call of a jitted transformers model that would build a cache (its config's ``use_cache`` on and the call not
saying ``use_cache=False``, or the call passing ``use_cache=True`` or ``past_key_values``, as ``generate`` does)
is an FSDPError that says what to do, raised before Thunder traces anything (:func:`check_no_kv_cache`, applied
to every call by :mod:`fsdp_pass.shard.forward_inputs`). Models that are not transformers' pass through.
"""

from __future__ import annotations

import inspect

from fsdp_pass.errors import fail


def _takes_use_cache(module) -> bool:
    try:
        return "use_cache" in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def builds_a_kv_cache(module, kwargs: dict) -> bool:
    """Whether a call of ``module`` (the user's model) with keyword inputs ``kwargs`` makes it build a KV cache."""
    if kwargs.get("past_key_values") is not None or kwargs.get("use_cache") is True:
        return True
    config = getattr(module, "config", None)
    return bool(getattr(config, "use_cache", False)) and "use_cache" not in kwargs and _takes_use_cache(module)


def check_no_kv_cache(module, kwargs: dict) -> None:
    """An FSDPError when the call would build a KV cache (see the module's docstring)."""
    if not builds_a_kv_cache(module, kwargs):
        return
    fail(
        f"This call would make {type(module).__name__} build a KV cache (its config has use_cache=True, what "
        "from_pretrained gives, or the call passes use_cache=True or past_key_values, as generate() does). "
        "A training step does not use one, and thunder.jit cannot trace transformers' cache: its interpreter loses "
        "the attributes of the config's per-layer view the cache is built from.",
        "Set model.config.use_cache = False before the first call (or pass use_cache=False in every call): "
        "transformers then also reads packed position_ids as separate documents, as it does in training. Generate "
        "with the model outside thunder.jit (fsdp_pass.full_state_dict(jitted) gives its weights).",
    )
