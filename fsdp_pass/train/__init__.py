"""The training loop around the step: what a user calls between ``backward()`` and ``optimizer.step()``.

- :mod:`~fsdp_pass.train.grad_norm`: the gradient norm of the whole model from the shards (one
  all-reduce), clipping by it, and a per-unit table of norms to find where a NaN or an inf came from.
"""
