"""Benchmark of FSDP/DDP systems on a small Llama-style LM, 2 gloo ranks on CPU.

    .venv/bin/python -m bench.run

See :mod:`bench.run` for the flags and the printed table.
"""
