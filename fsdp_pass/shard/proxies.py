"""Proxy helpers shared by the shard stage and the passes after it."""

from __future__ import annotations

from thunder.core import devices, dtypes
from thunder.core.trace import TraceCtx, tracectx


def with_shape(proxy, shape, device=None, dtype=None):
    """A copy of ``proxy`` (same name) with another shape, and another device and dtype if given: the shard of
    a parameter argument (on the offload device when offloading; in the master weights' dtype where the trace
    computes in a mixed-precision ``param_dtype``).

    Built in a scratch trace so the name is not registered twice in the trace being rewritten.
    """
    changes = {"shape": tuple(shape)}
    if device is not None:
        changes["device"] = devices.to_device(device)
    if dtype is not None:
        changes["dtype"] = dtypes.to_dtype(dtype)
    with tracectx(TraceCtx(None)):
        return proxy.replace(**changes)
