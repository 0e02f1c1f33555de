"""The repository's benchmark harness: mlxinfer against mlx-lm on the same files, in one run.

Run it with `python -m bench [--quick]`; see bench/README.md for the latest results.
"""
