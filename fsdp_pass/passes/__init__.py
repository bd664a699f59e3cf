"""Pure trace passes: each takes a trace and a plan and returns a new trace (never mutates its input)."""
