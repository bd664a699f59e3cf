"""What ``thunder.jit`` needs to trace Hugging Face transformers 5's models as eager runs them: Thunder lookasides
for transformers' output capture (:mod:`~fsdp_pass.models.hf_output_capture`, without which the first call fails)
and for its causal mask (:mod:`~fsdp_pass.models.hf_causal_mask`, without which every layer's attention gets an
explicit mask and loses the flash kernels).

``FSDP`` applies them to every module it is given (``FSDP.transform_module``); a plain ``thunder.jit`` takes them
by hand, ``jm = trace_hf_models(thunder.jit(model))``. With transformers 4 or none imported they add nothing.
"""

from __future__ import annotations

import thunder

from fsdp_pass.models.hf_causal_mask import causal_mask_lookasides
from fsdp_pass.models.hf_output_capture import capture_lookasides


def trace_hf_models(jitted):
    """``jitted`` (what ``thunder.jit`` returned), its compiles given both modules' lookasides."""
    lookasides = {**capture_lookasides(), **causal_mask_lookasides()}
    if lookasides:
        thunder.compile_data(jitted).executor_lookasides.update(lookasides)
    return jitted
