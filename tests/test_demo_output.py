"""Tier 1: what the main job (fsdp_pass.demo) prints, piece by piece, without running it.

The excerpt of one unit's trace lines is read off the tests' shared compiled steps (tests/llama_steps.py:
compiled once per session, no compile of its own); the progress line and the summary are plain text.
"""

import io
import re

import pytest

from fsdp_pass.demo import unit_to_show
from fsdp_pass.report.run_summary import Measured, Progress, progress_line, summary_lines
from fsdp_pass.report.trace_excerpt import unit_excerpt
from tests import llama_steps

FORWARD_OPS = ["fsdp_pack_shards", "fsdp_all_gather", "fsdp_wait", "fsdp_unpack_gathered"]
REDUCE_OPS = ["fsdp_pack_grads", "fsdp_reduce_scatter", "fsdp_wait", "fsdp_unpack_grad_shard"]


def _ops(excerpt: list[str]) -> list[str]:
    """The pass's ops in an excerpt, in order (the lines that are not comments)."""
    return [m.group(1) for line in excerpt for m in [re.search(r"= (fsdp_\w+)\(", line)] if m and "# [fsdp]" not in line]


def _labels(excerpt: list[str]) -> list[str]:
    return [line for line in excerpt if "# [fsdp]" in line]


@pytest.fixture(scope="module")
def steps():
    """(forward text, backward text, unit shown) of the shared ZeRO-2 and ZeRO-3 steps."""
    out = {}
    for strategy in ("zero2", "zero3"):
        fwd, bwd, fsdp = llama_steps.shared_step(strategy)
        out[strategy] = str(fwd), str(bwd), unit_to_show(fsdp.unit_plan)
    return out


def test_the_unit_shown_is_a_middle_transformer_block(steps):
    _, _, unit = steps["zero3"]
    assert unit.startswith("layers.") and unit not in ("layers.0", f"layers.{llama_steps.LAYERS - 1}")


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_forward_excerpt_is_the_units_pack_gather_wait_unpack_under_their_labels(steps, strategy):
    forward, _, unit = steps[strategy]
    excerpt = unit_excerpt(forward, unit)
    assert _ops(excerpt) == FORWARD_OPS
    labels = _labels(excerpt)
    assert len(labels) == len(FORWARD_OPS) and all(f"unit '{unit}'" in line for line in labels)
    assert "all-gather" in labels[1] and "wait:" in labels[2]


def test_zero3_backward_excerpt_gathers_again_then_reduce_scatters(steps):
    _, backward, unit = steps["zero3"]
    assert _ops(unit_excerpt(backward, unit)) == FORWARD_OPS + REDUCE_OPS


def test_zero2_backward_excerpt_only_reduce_scatters(steps):
    _, backward, unit = steps["zero2"]
    assert _ops(unit_excerpt(backward, unit)) == REDUCE_OPS


def test_excerpt_lines_are_numbered_as_in_the_trace_and_gaps_are_counted(steps):
    forward, _, unit = steps["zero3"]
    lines = forward.splitlines()
    excerpt = unit_excerpt(forward, unit, width=10_000)
    shown = [int(line.split()[0]) for line in excerpt if line.split()[0].isdigit()]
    for number, line in zip(shown, (line for line in excerpt if line.split()[0].isdigit())):
        assert lines[number - 1].strip() == line.split(maxsplit=1)[1].strip()
    gaps = [int(line.split()[1]) for line in excerpt if line.split()[0] == "..."]
    assert sum(gaps) + len(shown) == shown[-1] - shown[0] + 1 and all(g >= 2 for g in gaps)


def test_excerpt_does_not_take_a_unit_whose_name_extends_the_one_asked_for():
    text = "\n".join([
        "def computation(a):",
        "  # [fsdp] unit 'layers.10' all-gather: 1 param(s)",
        "  t0 = fsdp_all_gather(a)",
        "  # [fsdp] unit 'layers.1' all-gather: 1 param(s)",
        "  t1 = fsdp_all_gather(a)",
        "  del a",
        "  # [fsdp] wait: unit 'layers.1' all-gather: 1 param(s)",
        "  t2 = fsdp_wait(t1)",
        "  return t2",
    ])
    assert unit_excerpt(text, "layers.1") == [
        "4  # [fsdp] unit 'layers.1' all-gather: 1 param(s)",
        "5  t1 = fsdp_all_gather(a)",
        "6  del a",
        "7  # [fsdp] wait: unit 'layers.1' all-gather: 1 param(s)",
        "8  t2 = fsdp_wait(t1)",
    ]
    assert unit_excerpt(text, "layers.2") == []
    assert all(len(line) <= 20 and line.endswith(" ...") for line in unit_excerpt(text, "layers.1", width=20)[:1])


def test_progress_is_one_line_per_step_in_a_log_and_rewritten_in_place_on_a_terminal():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    log, terminal = io.StringIO(), Terminal()
    for stream in (log, terminal):
        progress = Progress(stream)
        progress.show(progress_line(1, 10, 4.25, 9.5))
        progress.show(progress_line(10, 10, 1.5, 0.03))
        progress.close()
    assert log.getvalue().splitlines() == [progress_line(1, 10, 4.25, 9.5), progress_line(10, 10, 1.5, 0.03)]
    assert terminal.getvalue().count("\n") == 1 and terminal.getvalue().count("\r") == 2
    assert terminal.getvalue().split("\r")[-1].rstrip() == progress_line(10, 10, 1.5, 0.03)
    assert "[" + "#" * 20 + "]" in progress_line(10, 10, 1.5, 0.03) and "loss 1.5000" in progress_line(10, 10, 1.5, 0.03)


def test_summary_reports_loss_first_to_last_time_after_compile_and_waiting():
    measured = Measured(bytes_sent=1000.0, bytes_predicted=1000.0, peak_bytes=(5000, 5000), peak_predicted=4990,
                        scratch_bytes=64, recorded_peak_bytes=(5000, 7000))
    lines = summary_lines([4.0, 3.0, 2.5, 2.0], [7.0, 0.010, 0.020, 0.030], wait_seconds=0.015, measured=measured)
    text = "\n".join(lines)
    assert "4.0000 -> 2.0000 over 4 steps" in text
    assert "20.0 ms over steps 2-4" in text and "7,000 ms" in text  # the compile step is not averaged in
    assert "5.0 ms per step (25%)" in text
    assert "5,000 B measured" in text and "4,990 B predicted" in text and "+10 B" in text
    assert "as the profiler recorded them: 5,000 / 7,000 B" in text  # the raw figures beside the re-timed ones
    assert "only the first step ran" in "\n".join(summary_lines([4.0], [7.0], 0.0))
