"""Profiling tools: Proton traces (`python -m profiling.trace`), timing and the command-line
plumbing the benchmarks share. Compiler resources: `python -m tools.resources`."""
