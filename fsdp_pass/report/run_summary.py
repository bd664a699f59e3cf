"""The text of a short training run, as the main job (:mod:`fsdp_pass.demo`) prints it.

1. ``progress_line(step, steps, loss, seconds)``: one step, with a bar over the run;
   ``Progress(stream)`` writes them in place on a terminal (``\\r``) and one line per step otherwise (logs);
2. ``summary_lines(losses, step_seconds, wait_seconds, measured)``: the loss first -> last, the time per step
   after the compile step and the part of it blocked waiting on collectives, and one more step measured
   next to ``explain()``'s prediction (:class:`Measured`).
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_pass.text import human_bytes


def progress_line(step: int, steps: int, loss: float, seconds: float, bar: int = 20) -> str:
    """``step`` (from 1) of ``steps``, a bar of ``bar`` characters, the loss and the step's time."""
    done = round(bar * step / steps)
    digits = len(str(steps))
    return f"step {step:>{digits}}/{steps} [{'#' * done}{'.' * (bar - done)}] loss {loss:.4f}  {seconds * 1000:.0f} ms"


class Progress:
    """Progress lines on ``stream``: rewritten in place on a terminal, one per line otherwise."""

    def __init__(self, stream):
        self.stream = stream
        self.in_place = stream.isatty()
        self.width = 0  # of the line now shown in place

    def show(self, line: str) -> None:
        if self.in_place:
            self.stream.write("\r" + line.ljust(self.width))
            self.width = len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End the line shown in place (nothing to do when each step had its own line)."""
        if self.in_place and self.width:
            self.stream.write("\n")
            self.stream.flush()
        self.width = 0


@dataclass(frozen=True)
class Measured:
    """More forward + backward passes on one rank, measured, next to what ``explain()`` predicted."""

    bytes_sent: float  # handed to the process group, per pass
    bytes_predicted: float
    peak_bytes: tuple[int, ...]  # peak tensor memory of each pass (frees the profiler lost put back)
    peak_predicted: int
    scratch_bytes: int  # the process group's own copies, which neither side counts
    recorded_peak_bytes: tuple[int, ...] = ()  # the same peaks from the profiler's events as recorded

    def lines(self) -> list[str]:
        peaks = sorted(set(self.peak_bytes))
        measured = f"{peaks[0]:,} B" if len(peaks) == 1 else " / ".join(f"{p:,}" for p in self.peak_bytes) + " B"
        return [
            f"  peak memory    {measured} measured in each of {len(self.peak_bytes)} more forward + backward "
            f"passes, {self.peak_predicted:,} B predicted ({human_bytes(self.peak_predicted)}, "
            f"{max(self.peak_bytes) - self.peak_predicted:+,} B)",
            *([f"                 as the profiler recorded them: {' / '.join(f'{p:,}' for p in self.recorded_peak_bytes)} B "
               "(the frees it lost are put back above, at their collective's wait)"] if self.recorded_peak_bytes else []),
            f"  bytes sent     {self.bytes_sent:,.0f} B per pass measured, {self.bytes_predicted:,.0f} B predicted "
            f"(not counted: the process group's own scratch copies, up to {human_bytes(self.scratch_bytes)})",
        ]


def _time_lines(step_seconds: list[float], wait_seconds: float) -> list[str]:
    """The time per step after the first (it compiles), and the part spent blocked waiting on collectives."""
    compile_ms = step_seconds[0] * 1000
    if len(step_seconds) < 2:
        return [f"  time           only the first step ran ({compile_ms:,.0f} ms, compile included)"]
    timed = step_seconds[1:]
    per_step = sum(timed) / len(timed)
    waiting = wait_seconds / len(timed)
    share = waiting / per_step if per_step > 0 else 0.0
    return [
        f"  time per step  {per_step * 1000:.1f} ms over steps 2-{len(step_seconds)} "
        f"(step 1 compiled: {compile_ms:,.0f} ms)",
        f"  waiting        {waiting * 1000:.1f} ms per step ({share:.0%}) blocked on collective waits",
    ]


def summary_lines(
    losses: list[float], step_seconds: list[float], wait_seconds: float, measured: Measured | None = None, rank: int = 0
) -> list[str]:
    """The end of a run: ``losses`` and ``step_seconds`` one per step (the first step compiles);
    ``wait_seconds``: host time blocked in collective waits over every step after the first; all but the
    losses measured on ``rank``."""
    lines = [
        f"summary (timings and memory on rank {rank}, loss averaged over ranks)",
        f"  loss           {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} step{'s' if len(losses) > 1 else ''}",
        *_time_lines(step_seconds, wait_seconds),
    ]
    return lines + (measured.lines() if measured is not None else [])
