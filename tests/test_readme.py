"""The README is what a new user tries first: its commands parse, its Python examples print what they say."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import subprocess
import sys
from importlib.metadata import requires
from pathlib import Path

import click
import pytest

from mlxinfer.cli import main

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def fenced_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def readme_commands() -> list[list[str]]:
    """Every `mlxinfer ...` line of the README's bash blocks, split as a shell would (comments dropped)."""
    commands = []
    for block in fenced_blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                words = shlex.split(part, comments=True)
                if words[:1] == ["mlxinfer"]:
                    commands.append(words[1:])
    return commands


def test_readme_has_commands_to_check():
    assert len(readme_commands()) >= 20  # the parser below found the examples, not an empty list


@pytest.mark.parametrize("args", readme_commands(), ids=" ".join)
def test_readme_command_parses(args):
    """Each subcommand, option and option value the README shows exists (paths need not exist here)."""
    command: click.Command = main
    while isinstance(command, click.Group) and args and args[0] in command.commands:
        command, args = command.commands[args[0]], args[1:]
    assert not isinstance(command, click.Group) or not args, f"unknown subcommand {args[0]!r}"
    with click.Context(command) as ctx:
        values, extra, _ = command.make_parser(ctx).parse_args(list(args))  # unknown options raise here
        assert len(extra) <= sum(isinstance(p, click.Argument) for p in command.params), extra
        for param in command.params:
            if param.name in values and not isinstance(param.type, click.Path):
                param.type_cast_value(ctx, values[param.name])  # a bad choice or number raises here


def test_readme_stream_example_prints_the_stats_on_their_own_line(tiny_llama):
    """The Python example's stream loop, run as written: the stats must not be glued to the text."""
    block = next(b for b in fenced_blocks("python") if "model.stream(" in b)
    lines = block.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("run = model.stream("))
    last = next(i for i, line in enumerate(lines) if line.startswith("print(run.stats.summary())"))
    snippet = "\n".join(lines[first : last + 1])
    scope = {"model": tiny_llama}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(snippet, scope)  # the README's own lines
    printed = out.getvalue().splitlines()
    assert printed[-1] == scope["run"].stats.summary()
    assert "".join(printed[:-1]) == scope["run"].text()


def test_readme_installs_the_notebook_extra_from_the_checkout():
    # mlxinfer is not on PyPI: `pip install "mlxinfer[notebook]"` would fail for a new user.
    assert 'pip install "mlxinfer[' not in README
    assert 'pip install -e ".[notebook]"' in README


@pytest.mark.slow
def test_notebook_extra_installs_a_jupyter_front_end():
    notebook = [dep for dep in requires("mlxinfer") or [] if re.search(r"extra\s*==\s*.notebook.", dep)]
    assert any(re.match(r"(jupyterlab|notebook)\b", dep) for dep in notebook), notebook
    # The test extra includes the notebook extra, so the front end is installed here and starts.
    result = subprocess.run(
        [sys.executable, "-m", "jupyterlab", "--version"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert re.match(r"\d+\.\d+", result.stdout.strip())


def test_the_architecture_table_is_the_registrys():
    from mlxinfer.models.support import support_markdown

    table = README.split("<!-- architectures -->\n")[1].split("<!-- /architectures -->")[0]
    assert table == support_markdown(), "regenerate it: python -m mlxinfer.models.support"


def test_every_family_the_table_calls_verified_has_a_fixture_checked_against_transformers():
    import json

    from mlxinfer.models.multimodal import WRAPPERS
    from mlxinfer.models.registry import ARCHITECTURES as REGISTRY
    from tests.conftest import ARCHITECTURES, TINY

    checked = set()
    for name in ARCHITECTURES:  # each runs tests/test_parity.py and tests/test_mlx_lm_roundtrip.py
        model_type = json.loads((TINY / name / "config.json").read_text())["model_type"]
        checked.add(WRAPPERS[model_type].text_type if model_type in WRAPPERS else model_type)
    assert set(REGISTRY) <= checked, sorted(set(REGISTRY) - checked)
