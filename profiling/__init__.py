"""Profiling tools: `python -m profiling.resources` reports registers, spills and shared memory."""
