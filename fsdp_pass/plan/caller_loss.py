"""The loss a caller computes outside the model, as the memory model and the planner price it: ``caller_loss(outputs,
dtype)``, its buffers at the backward's start, and ``has_own_loss(outputs)``, whether the model computes its own
loss instead. Here, before the cost stage and the report, so that both read the one definition.
"""

from __future__ import annotations


def has_own_loss(outputs) -> bool:
    """Whether one of the forward's outputs with a gradient (or one of those gradients) is 0-d: a loss computed
    inside the model, which the caller's loss (rule 6) is not added to."""
    return any(len(o.shape) == 0 for o in outputs)


def caller_loss(outputs, dtype=None) -> tuple[tuple[str, int], ...]:
    """Rule 6 of :mod:`fsdp_pass.report.memory`: the buffers ``(name, bytes)`` that a loss computed outside the model holds at the backward's start,
    given the forward's outputs with gradients (or those gradients: the same shapes and dtypes): a cross-entropy
    over each non-scalar one's last dimension, its log-probabilities and their gradient, each as large as the
    output (in ``dtype`` where given: the mixed precision's ``output_dtype``, which the outputs are cast to after
    planning). None where one of them is 0-d: that is a loss computed inside the model (a Hugging Face model fed
    labels), traced. The one definition the memory model (:func:`fsdp_pass.report.memory.step_memory`) and ZeRO-3's last-unit rule
    (:func:`fsdp_pass.cost.step_summary.caller_loss_bytes`) price the caller's loss by."""
    if has_own_loss(outputs):
        return ()
    return tuple(
        (f"{o.name}:{what}", int(o.numel) * (dtype or o.dtype).bytes) for o in outputs
        for what in ("log-probabilities", "their gradient")
    )
