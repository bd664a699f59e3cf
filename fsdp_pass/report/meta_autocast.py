"""``torch.autocast`` on the meta device, for dry runs: what it fails with, and what it means there.

Model code often opens an autocast region on the device of its input, e.g. Hugging Face's rotary embeddings
(``LlamaRotaryEmbedding.forward``)::

    with torch.autocast(device_type=x.device.type, enabled=False):  # force float32

On the meta device torch has no autocast state: ``torch.autocast("meta", ...)`` asks for
``torch.get_autocast_dtype("meta")``, which raises ``RuntimeError: unsupported scalarType`` (and with a dtype
given, ``is_autocast_available("meta")`` is False). It fails the same in eager and under ``thunder.jit``,
which runs the constructor as it is, so a model like that could not be traced on meta at all.

In a dry run the meta device stands for the device the real run will compute on; its traces are lowered
for the CPU. :func:`autocast_on_meta_as` makes ``torch.autocast("meta", ...)`` open the same region on that
device type while a dry run compiles, and puts torch back after. A region that *disables* autocast (the
usual case) then means what it means in the real run; Thunder records its enter and exit in the trace.
"""

from __future__ import annotations

from contextlib import contextmanager

from torch.amp.autocast_mode import autocast

META = "meta"


@contextmanager
def autocast_on_meta_as(stand_in: str = "cpu"):
    """While inside, ``torch.autocast("meta", ...)`` is ``torch.autocast(stand_in, ...)``."""
    original = autocast.__init__

    def init_for_stand_in_device(self, device_type, *args, **kwargs):  # torch's parameter name: callers pass it by name
        original(self, stand_in if device_type == META else device_type, *args, **kwargs)

    autocast.__init__ = init_for_stand_in_device
    try:
        yield
    finally:
        autocast.__init__ = original
