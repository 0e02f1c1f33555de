"""What a new user meets first: flags checked before a load, plan's limits, help texts, `cache ls`, a cut GGUF."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from pathlib import Path

import gguf
import pytest
from click.testing import CliRunner

import mlxinfer
from mlxinfer.cli import main
from mlxinfer.engine import check_max_tokens
from mlxinfer.engine.sampling import SamplingParams
from mlxinfer.errors import DefaultModelError, SamplingError
from mlxinfer.library import disk_bytes, local_models
from mlxinfer.memory import MachineMemory, plan_memory
from mlxinfer.paths import cache_dir
from tests.conftest import TINY
from tests.test_gguf import write_tiny_gguf

MIB = 1 << 20
MODEL_FORMS = "MODEL: a model folder, a .gguf file, or none for the default SmolLM2-135M-Instruct."


def run(*args: str, input: str | None = None):
    return CliRunner().invoke(main, list(args), input=input)


@pytest.fixture
def loads(monkeypatch) -> list[object]:
    """Calls of the CLI's model loader; each one ends the command with a one-line error instead of loading."""
    calls: list[object] = []

    def load(path, **kwargs):
        calls.append(path)
        raise DefaultModelError("the loader was reached")

    monkeypatch.setattr("mlxinfer.cli.common.load", load)
    return calls


BAD_FLAGS = [
    (["--temperature", "-1"], "'--temperature'", "temperature must be"),
    (["--top-p", "2"], "'--top-p'", "top_p must be"),
    (["--top-k", "-1"], "'--top-k'", "top_k must be"),
    (["--min-p", "2"], "'--min-p'", "min_p must be"),
    (["--repetition-penalty", "0"], "'--repetition-penalty'", "repetition_penalty must be"),
    (["--seed", "-1"], "'--seed'", "seed must be"),
    (["--max-tokens", "0"], "'--max-tokens'", "max_tokens must be"),
    (["--max-tokens", "1000001"], "'--max-tokens'", "max_tokens must be an integer in [1, 1000000], got 1000001"),
    (["--stop", ""], "'--stop'", "empty stop string"),
    (["--stop", "x" * 300], "'--stop'", "at most 256 characters"),
]


@pytest.mark.parametrize("command", [["generate", "-p", "hi"], ["chat"]])
@pytest.mark.parametrize(("flag", "named", "words"), BAD_FLAGS)
def test_a_bad_flag_fails_before_the_model_loads(loads, command, flag, named, words):
    result = run(*command, str(TINY / "llama_classic"), *flag, input="hello\n")
    assert result.exit_code == 2, result.output
    assert f"Invalid value for {named}" in result.stderr and words in result.stderr, result.stderr
    assert loads == []


def test_good_flags_reach_the_loader(loads):
    flags = ["--temperature", "0.7", "--top-p", "1", "--top-k", "5", "--min-p", "0", "--seed", "1", "--stop", "."]
    result = run("generate", "-p", "hi", "--max-tokens", "1", *flags)
    assert result.exit_code == 1 and "the loader was reached" in result.stderr, result.output
    assert loads == [None]  # the default model


@pytest.mark.parametrize("value", [0, -1, 1_000_001, "5", 2.0, None])
def test_max_tokens_has_one_check_for_the_engine_and_the_cli(value):
    with pytest.raises(SamplingError, match=r"max_tokens must be an integer in \[1, 1000000\], got "):
        check_max_tokens(value)
    check_max_tokens(1)
    check_max_tokens(1_000_000)


def test_a_sampling_field_without_a_flag_is_left_to_its_default(loads, monkeypatch):
    @dataclasses.dataclass(frozen=True)
    class Later(SamplingParams):  # a field added to the engine before the CLI grows its flag
        typical_p: float = 1.0

    monkeypatch.setattr("mlxinfer.cli.options.SamplingParams", Later)
    result = run("generate", "-p", "hi", "--top-k", "5")
    assert result.exit_code == 1 and "the loader was reached" in result.stderr, result.output
    assert run("generate", "-p", "hi", "--top-k", "-1").exit_code == 2  # the flags it has are still checked


def test_plan_names_the_trained_limit_when_the_context_is_past_it():
    trained = json.loads((TINY / "qwen2" / "config.json").read_text())["max_position_embeddings"]
    result = run("plan", str(TINY / "qwen2"), "--context", str(4 * trained))
    assert result.exit_code == 0, result.output
    expected = f"the model's trained limit is {trained} tokens (max_position_embeddings); {4 * trained} is past it"
    assert f"verdict: fits at {4 * trained} tokens; {expected}" in result.stdout
    data = json.loads(run("plan", str(TINY / "qwen2"), "--context", str(4 * trained), "--json").stdout)
    assert data["max_context"] == trained and expected in data["context_limit"]


def test_plan_says_when_memory_is_the_limit():
    footprint = dataclasses.replace(mlxinfer.load(TINY / "qwen2").footprint, max_positions=200_000)
    tight = MachineMemory(4 << 30, (1 << 30) + 64 * MIB + 20 * MIB, 0, "cpu", None, None)
    plan = plan_memory(tight, footprint, context=200_000, prefix_cache_bytes=0)
    longest = plan.max_context()
    assert 0 < longest < plan.footprint.max_positions  # memory, not training, stops it
    assert plan.context_limit() == f"memory is the limit: the largest context that fits is {longest} tokens"


def _help(*command: str) -> str:
    result = run(*command, "--help")
    assert result.exit_code == 0, result.output
    return " ".join(result.output.split())  # click rewraps paragraphs to the terminal's width


@pytest.mark.parametrize("command", ["generate", "chat", "plan", "serve", "menubar", "bench", "eval", "cache warm"])
def test_each_command_taking_model_says_which_forms_it_takes(command):
    assert MODEL_FORMS in _help(*command.split())


def test_readme_and_help_name_the_linux_cache_folder_platformdirs_uses(tmp_path, monkeypatch):
    monkeypatch.delenv("MLXINFER_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    if sys.platform == "linux":
        assert cache_dir() == tmp_path / "mlxinfer"
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| the default model |"))
    assert "`$XDG_CACHE_HOME/mlxinfer` on Linux (default `~/.cache/mlxinfer`)" in row
    assert "$XDG_CACHE_HOME/mlxinfer, default ~/.cache/mlxinfer, on Linux" in _help()


def test_help_says_where_models_are_and_never_this_mac():
    top = _help()
    assert ".gguf file" in top and "mlxinfer cache ls" in top and "MLXINFER_MODELS_DIR" in top
    assert "this machine" in _help("plan")
    for command in main.commands:
        assert "this Mac" not in _help(command), command
    assert "--bits [4|8|16] Bits per quantized weight" in _help("convert")


def _write(path: Path, n_bytes: int) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\0" * n_bytes)
    return n_bytes


def test_cache_ls_lists_models_with_sizes_then_warmed_prefixes(tmp_path, monkeypatch):
    cache, models = tmp_path / "cache", tmp_path / "models"
    monkeypatch.setenv("MLXINFER_CACHE_DIR", str(cache))
    monkeypatch.setenv("MLXINFER_MODELS_DIR", str(models))
    gguf_size = _write(cache / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf", 3 * MIB)
    folder = models / "m-4bit"
    folder_size = _write(folder / "model.safetensors", 2 * MIB) + _write(folder / "config.json", 2)
    folder_size += _write(folder / "sub" / "extra.bin", MIB // 2)
    outside = tmp_path / "elsewhere"
    _write(outside / "huge.bin", 5 * MIB)
    (folder / "linked").symlink_to(outside, target_is_directory=True)  # not walked into
    bench_size = _write(cache / "bench-models" / "x-bf16" / "model.safetensors", MIB)
    bench_size += _write(cache / "bench-models" / "x-bf16" / "config.json", 2)
    _write(models / "notes.txt", 10)  # not a model
    mlxinfer.load(TINY / "qwen2").warm("You are a terse assistant.")

    result = run("cache", "ls")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert len(lines) == 4 and "notes.txt" not in result.stdout
    for line, name, size in [(lines[0], "SmolLM2-135M-Instruct.Q4_1 ", gguf_size), (lines[1], "m-4bit ", folder_size)]:
        assert line.startswith(name) and f"{size / MIB:,.1f} MiB" in line
        assert name.strip() in run("ls").stdout.split()  # the name `mlxinfer ls` gives it (a GGUF's without .gguf)
    assert lines[2].startswith("x-bf16") and f"{bench_size / MIB:,.1f} MiB" in lines[2]
    assert lines[3].startswith("qwen2")
    total = (gguf_size + folder_size + bench_size) / MIB
    assert f"3 models ({total:,.1f} MiB) in {cache / 'models'}, {models}, {cache / 'bench-models'}" in result.stderr
    assert "1 warmed prefix (" in result.stderr and str(cache / "prefixes") in result.stderr

    cleared = run("cache", "clear")
    assert "removed 1 warmed prefix (1 file) from" in cleared.stdout, cleared.output
    assert (cache / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf").exists()


def test_empty_cache_ls_says_where_it_looked_and_how_to_fill_it(tmp_path, monkeypatch):
    monkeypatch.setenv("MLXINFER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("MLXINFER_MODELS_DIR", str(tmp_path / "models"))
    result = run("cache", "ls")
    assert result.exit_code == 0 and result.stdout == "", result.output
    assert f"no models yet in {tmp_path / 'cache' / 'models'}, {tmp_path / 'models'}: `mlxinfer chat`" in result.stderr
    assert f"`mlxinfer convert SRC -o {tmp_path / 'models' / 'NAME'}` adds one" in result.stderr
    assert "no warmed prefixes in" in result.stderr and "mlxinfer cache warm --prefix-file" in result.stderr


def test_disk_bytes_stops_after_max_entries(tmp_path):
    for i in range(5):
        _write(tmp_path / f"f{i}", 100)
    assert disk_bytes(tmp_path) == (500, True)
    assert disk_bytes(tmp_path, max_entries=3) == (300, False)


def test_disk_bytes_reads_a_huge_folder_only_up_to_its_limit(tmp_path, monkeypatch):
    for i in range(50):
        _write(tmp_path / f"f{i:02}", 1)
    read: list[str] = []
    real_scandir = os.scandir

    class CountingScandir:  # the entries disk_bytes pulls from the listing
        def __init__(self, path):
            self.listing = real_scandir(path)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.listing.close()

        def __iter__(self):
            for entry in self.listing:
                read.append(entry.name)
                yield entry

    monkeypatch.setattr(os, "scandir", CountingScandir)
    assert disk_bytes(tmp_path, max_entries=3) == (3, False)
    assert len(read) == 4  # three counted, the fourth says there are more: not the other 46


def test_cache_ls_skips_an_unreadable_models_folder_with_a_warning(tmp_path, monkeypatch, caplog):
    cache, models = tmp_path / "cache", tmp_path / "models"
    monkeypatch.setenv("MLXINFER_CACHE_DIR", str(cache))
    monkeypatch.setenv("MLXINFER_MODELS_DIR", str(models))
    size = _write(cache / "models" / "a.gguf", MIB)
    _write(cache / "models" / "locked.gguf", MIB)
    _write(models / "b.gguf", MIB)
    real_iterdir, real_is_file = Path.iterdir, Path.is_file

    def iterdir(path):  # what a folder of mode 000 does (tests run as root here, where it does not)
        if path == models:
            raise PermissionError(13, "Permission denied", str(path))
        return real_iterdir(path)

    def is_file(path):  # an entry that cannot be looked at
        if path.name == "locked.gguf":
            raise PermissionError(13, "Permission denied", str(path))
        return real_is_file(path)

    monkeypatch.setattr(Path, "iterdir", iterdir)
    monkeypatch.setattr(Path, "is_file", is_file)
    with caplog.at_level(logging.WARNING, logger="mlxinfer"):
        result = run("cache", "ls")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[0].startswith("a ") and len(result.stdout.splitlines()) == 1
    assert f"1 model ({size / MIB:,.1f} MiB) in {cache / 'models'}, {models}" in result.stderr
    assert f"skipping models folder {models}: Permission denied" in caplog.messages
    assert local_models(models) == []  # the menubar's Switch Model menu opens without it


def _last_tensor(path: Path) -> tuple[str, int]:
    """The tensor whose data ends last, and where, read by the `gguf` package's own reader."""
    end, name = max((t.data_offset + t.n_bytes, t.name) for t in gguf.GGUFReader(path).tensors)
    return name, end


@pytest.mark.parametrize("kept", [0.5, 0.99])
def test_a_cut_off_gguf_names_the_tensor_and_says_it_is_incomplete(tmp_path, kept):
    whole = write_tiny_gguf(tmp_path / "whole.gguf")
    data, (name, needed) = whole.read_bytes(), _last_tensor(whole)
    header = gguf.GGUFReader(whole).tensors[0].data_offset
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: header + int(kept * (needed - header))])
    result = run("generate", str(cut), "-p", "hi")
    assert result.exit_code == 1, result.output
    expected = (
        f"{cut}: the file is cut off or corrupt: tensor {name} needs bytes up to {needed:,} "
        f"but the file has {os.path.getsize(cut):,}; it is incomplete: download it again"
    )
    assert result.stderr.endswith(f"\nError: {expected}\n")  # after "Loading ...", one line


def test_a_gguf_offset_far_past_the_end_is_called_corrupt_not_incomplete(tmp_path):
    path = write_tiny_gguf(tmp_path / "hostile.gguf")
    reader = gguf.GGUFReader(path, "r+")
    tensor = reader.tensors[0]
    tensor.field.parts[-1][0] = 1 << 40  # 1 TiB into a file of a few hundred KB
    reader.data.flush()
    name, needed = tensor.name, reader.data_offset + (1 << 40) + tensor.n_bytes
    del reader, tensor  # the memory map, written
    result = run("generate", str(path), "-p", "hi")
    assert result.exit_code == 1, result.output
    assert (
        f"tensor {name} needs bytes up to {needed:,} "
        f"but the file has {os.path.getsize(path):,}; its header is damaged" in result.stderr
    )
    assert "incomplete" not in result.stderr and result.stderr.endswith("download it again\n")


def test_a_gguf_cut_inside_its_header_says_download_it_again(tmp_path):
    whole = write_tiny_gguf(tmp_path / "whole.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole.read_bytes()[:200])
    result = run("generate", str(cut), "-p", "hi")
    assert result.exit_code == 1 and "the file ends inside its header" in result.stderr, result.output
    assert "incomplete or not GGUF; download it again" in result.stderr
