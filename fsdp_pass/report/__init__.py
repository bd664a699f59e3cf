"""Reports: read the traces and plan of a compile (and measure real steps) to say what FSDP does and costs.

- :mod:`~fsdp_pass.report.explain`: per-unit schedule, bytes per rank, predicted memory;
- :mod:`~fsdp_pass.report.memory`, :mod:`~fsdp_pass.report.step_stats`, :mod:`~fsdp_pass.report.overlap`:
  what the final traces allocate, communicate, and overlap;
- :mod:`~fsdp_pass.report.measure`: what a real step allocates and sends;
- :mod:`~fsdp_pass.report.timeline`: a real gloo step recorded and drawn;
- :mod:`~fsdp_pass.report.dry_run`: all of it at any world size, in one process, without allocating.
"""
