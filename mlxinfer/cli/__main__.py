"""`python -m mlxinfer.cli`: the same command line as the `mlxinfer` script (tests and benchmarks run it so)."""

from . import main

main()
