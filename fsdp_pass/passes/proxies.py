"""Proxy helpers shared by the passes."""

from __future__ import annotations

from thunder.core.trace import TraceCtx, tracectx


def with_shape(proxy, shape):
    """A copy of ``proxy`` (same name) with another shape: the sharded view of a parameter argument.

    Built in a scratch trace so the name is not registered twice in the trace being rewritten.
    """
    with tracectx(TraceCtx(None)):
        return proxy.replace(shape=tuple(shape))
