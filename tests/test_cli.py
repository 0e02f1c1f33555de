"""The command line: exit codes, one-line errors, chat sessions."""

from __future__ import annotations

import json

from click.testing import CliRunner

from mlxinfer.cli import main
from tests.conftest import TINY

MODEL = str(TINY / "llama_classic")


def run(*args: str, input: str | None = None):
    return CliRunner().invoke(main, list(args), input=input)


def test_generate_raw_prints_text_and_stats():
    result = run("generate", MODEL, "-p", "hello", "--raw", "--max-tokens", "5")
    assert result.exit_code == 0, result.output
    assert "5 generated" in result.stderr


def test_generate_reads_the_prompt_from_stdin():
    by_flag = json.loads(run("generate", MODEL, "-p", "hello", "--raw", "--max-tokens", "4", "--json").stdout)
    by_stdin = json.loads(
        run("generate", MODEL, "-p", "-", "--raw", "--max-tokens", "4", "--json", input="hello").stdout
    )
    assert by_stdin["text"] == by_flag["text"]


def test_errors_are_one_line_with_non_zero_exit(tmp_path):
    cases = [  # a bad flag is a usage error (exit code 2), found before the model loads
        (["generate", str(tmp_path / "missing"), "-p", "x"], "not a model folder", 1),
        (["generate", MODEL, "-p", "x", "--temperature", "nan"], "temperature must be a finite number", 2),
        (["generate", MODEL, "-p", "x", "--top-p", "0"], "top_p", 2),
        (["generate", MODEL, "-p", "x", "--max-tokens", "0"], "max_tokens", 2),
    ]
    for args, words, code in cases:
        result = run(*args)
        assert result.exit_code == code, (args, result.output)
        error_lines = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
        assert len(error_lines) == 1 and words in error_lines[0], result.stderr


def test_chat_keeps_history_and_handles_commands():
    session = "hello\n/reset\nhi again\n/exit\n"
    result = run("chat", MODEL, "--max-tokens", "3", input=session)
    assert result.exit_code == 0, result.output
    assert result.stderr.count("3 generated") == 2
    assert "Chatting with llama_classic" in result.stderr


def test_chat_ends_on_end_of_input():
    result = run("chat", MODEL, "--max-tokens", "2", input="hello\n")
    assert result.exit_code == 0, result.output


def test_help_lists_the_commands():
    result = run("--help")
    assert result.exit_code == 0 and "generate" in result.output and "chat" in result.output


def test_chat_sends_earlier_turns_with_each_new_one():
    result = run("chat", MODEL, "--max-tokens", "3", input="hello\nhello\n/reset\nhello\n")
    prompt_tokens = [int(line.split()[0]) for line in result.stderr.splitlines() if "prompt tokens" in line]
    assert len(prompt_tokens) == 3
    assert prompt_tokens[1] > prompt_tokens[0] == prompt_tokens[2]


def test_a_failing_turn_does_not_end_the_chat(tmp_path):
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(TINY / "llama_classic", folder)
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
        "{% endif %}{{ m['content'] }}{% endfor %}"
    )
    result = run("chat", str(folder), "--system", "be brief", "--max-tokens", "2", input="hello\n/exit\n")
    assert result.exit_code == 0, result.output
    assert "System role not supported" in result.stderr
