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


def test_chat_commands_say_what_they_did_and_never_reach_the_model(tmp_path):
    saved, kept = tmp_path / "chat.json", tmp_path / "kept.json"
    kept.write_text("mine")
    session = "\n".join(["/help", "/system", "/system Answer in French.", "hello", f"/save {saved}", f"/save {kept}",
                         "/nonsense", "/reset", "hi", "/bye", "never sent"]) + "\n"  # fmt: skip
    result = run("chat", MODEL, "--max-tokens", "3", input=session)
    assert result.exit_code == 0, result.output
    err = result.stderr
    assert "/system TEXT" in err and "/save FILE" in err  # /help
    assert "No system prompt; /system TEXT sets one." in err and "Set the system prompt" in err
    assert f"Saved 3 messages to {saved}." in err and f"{kept} exists" in err and kept.read_text() == "mine"
    assert json.loads(saved.read_text())["messages"][0] == {"role": "system", "content": "Answer in French."}
    assert "Unknown command /nonsense; /help lists the commands." in err
    assert "Cleared the conversation (the system prompt stays)." in err and err.rstrip().endswith("Bye.")
    prompts = [int(line.split()[0]) for line in err.splitlines() if "prompt tokens" in line]
    assert len(prompts) == 2  # "hello" and "hi": no command went to the model, nothing after /bye


def test_ctrl_c_at_the_prompt_says_how_to_quit_and_goes_on(monkeypatch, capsys):
    from click import termui

    from mlxinfer.cli.generation import _read_line

    typed = iter([KeyboardInterrupt, "hi"])

    def prompt(text):
        item = next(typed)
        if item is KeyboardInterrupt:
            raise KeyboardInterrupt
        return item

    monkeypatch.setattr(termui, "visible_prompt_func", prompt)
    assert _read_line() == "hi"
    assert "(Ctrl-C stops an answer; /bye or Ctrl-D quits.)" in capsys.readouterr().err


def test_chat_attaches_an_image_to_the_next_message():
    from safetensors.numpy import load_file

    photo = TINY.parent / "images" / "hopper.jpg"
    session = f"/image {photo.parent / 'missing.jpg'}\n/image {photo}\nWho is this?\n/bye\n"
    result = run("chat", str(TINY / "gemma3_vision"), "--max-tokens", "8", input=session)
    assert result.exit_code == 0, result.output
    assert "missing.jpg" in result.stderr and "Attached hopper.jpg; your next message asks about it." in result.stderr
    golden = load_file(TINY / "gemma3_vision" / "golden_image.safetensors")  # transformers' prompt for it
    prompts = [int(line.split()[0]) for line in result.stderr.splitlines() if "prompt tokens" in line]
    assert prompts == [len(golden["portrait.input_ids"])]


def test_a_stop_whose_counts_never_came_says_so(capsys):
    from mlxinfer.cli.generation import _stream_answer
    from mlxinfer.engine import GenerationStats
    from mlxinfer.resident_client import RemoteModel

    class Stopped:  # a stream cut by Ctrl-C after one chunk whose server never answered the stop
        stats = GenerationStats(total_s=1.5)

        def __iter__(self):
            yield "Hel"
            raise KeyboardInterrupt

    remote = RemoteModel.__new__(RemoteModel)
    remote.stream = lambda history, chat, **options: Stopped()
    assert _stream_answer(remote, [], {}) == "Hel"
    err = capsys.readouterr().err
    assert "stopped after 1.50 s; the server sent no token counts" in err
    assert "0 prompt tokens" not in err
