"""`mlxinfer doctor`: this machine's checks (mlxinfer.doctor) printed with their fixes; exit 1 when one is broken."""

from __future__ import annotations

import json
import sys

import click

from .common import errors_as_one_line


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print every check as one JSON object.")
@errors_as_one_line
def doctor(as_json: bool) -> None:
    """Check this machine for mlxinfer: device, MLX versions, BLAS speed, memory, disk, caches, default model.

    Prints a fix for anything slow (a warning) or broken; exits 1 when something is broken. Changes nothing.
    """
    from ..doctor import as_dict, diagnose, worst

    checks = diagnose()
    if as_json:
        click.echo(json.dumps(as_dict(checks), indent=1))
    else:
        for check in checks:
            click.echo(f"{check.status.upper():<7}{check.name:<15}{check.summary}")
            if check.fix:
                click.echo(f"{'':<22}fix: {check.fix}")
    if worst(checks) == "broken":
        sys.exit(1)
