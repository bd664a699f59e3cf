"""The ops the pass inserts into the forward trace, and the gradient rules Thunder's autodiff derives the
backward from.

- :mod:`~fsdp_pass.ops.unshard`: ``unshard_unit`` (pack, all-gather, wait, cut out) and its gradient rule
  (pack the gradients, reduce-scatter, wait, divide);
- :mod:`~fsdp_pass.ops.grad_accumulation`: the ops that accumulate unsharded gradients under ``no_sync``.
"""
