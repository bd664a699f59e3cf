"""The text the training loop prints: a progress line every ``--log-every`` steps and a summary at the end.

1. ``Window``: what the steps since the last printed line took (their seconds, tokens, FLOPs per rank), so a
   line shows their mean time per step, tokens per second over every rank, and the MFU where a peak is known.
2. ``progress_line(step, loss, val, norm, lr, window, peak)``: ``step 120  loss 1.8234  val 1.9011  grad norm
   0.41  lr 3.0e-03  21,345 tok/s  96.0 ms/step  MFU 31.2%``; no ``val`` where none was measured, no MFU
   without a peak (the CPU).
3. ``summary_lines(run, peak)``: the train loss first -> last, the validation loss first -> last, the tokens
   trained on, the speed after the first step (it and its evaluation compile), the MFU; with float16, the loss
   scale and the steps skipped for gradients that overflowed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fsdp_pass.train.throughput import mfu


@dataclass
class Window:
    """Steps timed since the last printed line."""

    seconds: float = 0.0
    steps: int = 0
    tokens: int = 0  # over every rank
    flops_per_rank: float = 0.0

    def add(self, seconds: float, tokens: int, flops_per_rank: float) -> None:
        self.seconds += seconds
        self.steps += 1
        self.tokens += tokens
        self.flops_per_rank += flops_per_rank


@dataclass
class LoopRun:
    """What one run of the loop measured, keyed by step (the number of optimizer steps done before it)."""

    losses: dict[int, float] = field(default_factory=dict)  # the step's training loss, mean over ranks
    val_losses: dict[int, float] = field(default_factory=dict)  # held-out loss of the parameters before the step
    seconds: dict[int, float] = field(default_factory=dict)  # the step's wall time on rank 0
    first_step_seconds: float = 0.0  # the first step with its evaluation: the compiles happen in it
    tokens_per_step: int = 0  # over every rank
    flops_per_rank_step: float = 0.0  # model FLOPs of one step on one rank (throughput.model_flops)
    loss_scale: float | None = None  # float16: the GradScaler's scale after the last step
    skipped_steps: list[int] = field(default_factory=list)  # float16: steps whose gradients overflowed


def progress_line(step: int, loss: float, val: float | None, norm: float, lr: float, window: Window,
                  peak: float | None) -> str:
    """One line for ``step`` (item 2 of the module's docstring)."""
    parts = [f"step {step:4d}", f"loss {loss:.4f}"]
    if val is not None:
        parts.append(f"val {val:.4f}")
    parts += [f"grad norm {norm:.3f}", f"lr {lr:.1e}"]
    if window.steps and window.seconds > 0:
        parts += [f"{window.tokens / window.seconds:,.0f} tok/s", f"{window.seconds / window.steps * 1000:.1f} ms/step"]
        share = mfu(window.flops_per_rank, window.seconds, peak)
        if share is not None:
            parts.append(f"MFU {share:.1%}")
    return "  ".join(parts)


def _first_last(values: dict[int, float]) -> str:
    first, last = min(values), max(values)
    return f"{values[first]:.4f} -> {values[last]:.4f} (step {first} -> {last})"


def summary_lines(run: LoopRun, peak: float | None) -> list[str]:
    """The end of a run (item 3 of the module's docstring)."""
    steps = sorted(run.losses)
    lines = ["summary (loss averaged over ranks, times on rank 0)"]
    if not steps:
        return lines + ["  no step ran (the checkpoint was already at --steps)"]
    lines.append(f"  loss       {_first_last(run.losses)}")
    if run.val_losses:
        lines.append(f"  val loss   {_first_last(run.val_losses)}, {len(run.val_losses)} evaluations")
    tokens = run.tokens_per_step * len(steps)
    lines.append(f"  tokens     {tokens:,} trained on ({len(steps)} steps of {run.tokens_per_step:,})")
    timed = [run.seconds[s] for s in steps[1:]]
    compile_note = f"step {steps[0]} with its evaluation and the compiles: {run.first_step_seconds:.1f} s"
    if timed:
        per_step = sum(timed) / len(timed)
        over = f"step {steps[1]}" if len(timed) == 1 else f"steps {steps[1]}-{steps[-1]}"
        lines.append(
            f"  speed      {per_step * 1000:.1f} ms/step, {run.tokens_per_step / per_step:,.0f} tok/s over {over}; "
            f"{compile_note}"
        )
        share = mfu(run.flops_per_rank_step, per_step, peak)
        if share is not None:
            lines.append(f"  MFU        {share:.1%} of {peak / 1e12:,.1f} TFLOP/s per device "
                         f"({run.flops_per_rank_step / 1e9:,.2f} GFLOP per rank per step)")
    else:
        lines.append(f"  speed      {compile_note}")
    if run.loss_scale is not None:
        skipped = len(run.skipped_steps)
        lines.append(f"  float16    loss scale {run.loss_scale:g} after the last step; {skipped} step{'s' if skipped != 1 else ''} "
                     f"skipped (inf/NaN gradients){': ' + str(run.skipped_steps) if skipped else ''}")
    return lines
