"""Warmed prefixes of models whose layers cannot be cut back (sliding windows, recurrent state), on disk.

The file keeps the full-attention layers over the whole prefix and the other
layers' state at each snapshot position. A new process resumes from it at a
snapshot and answers what transformers answers (the fixtures' golden greedy
tokens); a damaged file is quarantined and the prompt prefilled cold.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import mlxinfer
from mlxinfer.cache import prefix_file
from mlxinfer.cli import main
from mlxinfer.engine import Finished, Job, SchedulerConfig, ServingThread
from mlxinfer.errors import CacheError, UnsupportedModelError
from tests.conftest import HYBRID as CONFTEST_HYBRID
from tests.conftest import TINY, golden
from tests.reliability.test_prefix_files import read_parts, write_parts
from tests.test_scheduler import Collector

# Sliding windows and recurrent state (short convolutions, Gated DeltaNet, Mamba-2), and the text models of
# two multimodal checkpoints; a family that does not load yet is skipped.
HYBRID = [*CONFTEST_HYBRID, "gemma3_vl", "qwen3_5_vl"]
WARMED = 16  # of the golden prompt's 24 tokens


def load(arch: str, **options) -> mlxinfer.Model:
    try:
        return mlxinfer.load(TINY / arch, **options)
    except UnsupportedModelError as e:
        pytest.skip(f"{arch} does not load yet: {e}")


def prompt(arch: str) -> list[int]:
    return golden(arch)["input_ids"].tolist()


def greedy(arch: str) -> list[int]:
    return golden(arch)["greedy"].tolist()


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MLXINFER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("MLXINFER_MODELS_DIR", str(tmp_path / "models"))
    return tmp_path / "cache" / "prefixes"


def warm_in_a_new_process(arch: str, ids: list[int]) -> Path:
    """Warm `ids` in another process (same MLXINFER_CACHE_DIR); returns the file it wrote."""
    code = f"import mlxinfer; print(mlxinfer.load({str(TINY / arch)!r}).warm({ids!r}))"
    done = subprocess.run([sys.executable, "-c", code], env=os.environ, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == str(len(ids)), done.stderr
    assert "memory only" not in done.stderr, done.stderr
    (path,) = Path(os.environ["MLXINFER_CACHE_DIR"]).glob("prefixes/*/*.safetensors")
    return path


@pytest.mark.slow
@pytest.mark.parametrize("arch", HYBRID)
def test_a_prefix_warmed_in_another_process_resumes_here_as_transformers_answers(arch, root, caplog):
    load(arch)  # skips a family that does not load yet, before a process is started for it
    ids = prompt(arch)
    path = warm_in_a_new_process(arch, ids[:WARMED])
    model = load(arch)
    assert model.cache_stats.entries == 1 and model.cache_stats.bytes_held == 0  # found, still on disk
    result = model.generate(ids, max_tokens=16)
    assert result.stats.cached_tokens == WARMED and result.stats.prefilled_tokens == len(ids) - WARMED
    assert result.token_ids == greedy(arch)
    assert result.token_ids == load(arch, prefix_cache_bytes=0).generate(ids, max_tokens=16).token_ids
    assert path.exists() and not (root / "quarantine").exists() and "prefix cache" not in caplog.text


@pytest.mark.parametrize("arch", ["gemma3", "lfm2"])
def test_a_prompt_sharing_less_than_a_snapshot_never_reads_the_file(arch, root):
    ids = prompt(arch)
    load(arch).warm(ids[:WARMED])
    model = load(arch)
    # 12 tokens shared, no snapshot there: the positions from the header say so without loading the state.
    result = model.generate(ids[:12] + [7, 8, 9], max_tokens=4)
    assert result.stats.cached_tokens == 0 and model.cache_stats.bytes_held > 0  # only what generate added
    assert not any(e.layers for e in model.prefix_cache._entries.values() if e.stored)


@pytest.mark.parametrize("arch", ["gemma2", "lfm2"])
def test_warm_keeps_the_snapshots_of_the_entry_it_resumed_from(arch, root):
    ids = prompt(arch)
    model = load(arch)
    model.generate(ids[:10], max_tokens=1)  # snapshots at 9 and 10 (the end of its prompt)
    assert model.warm(ids[:WARMED]) == WARMED  # resumed at 10, prefilled 6
    (path,) = root.glob("*/*.safetensors")
    metadata, tensors = read_parts(path)
    assert metadata["snapshots"] == f"9,10,{WARMED}" and metadata["format"] == "mlxinfer-prefix-v3"
    restarted = load(arch)
    shorter = restarted.generate(ids[:10] + ids[WARMED:], max_tokens=16)  # leaves the warmed prefix at 10
    assert shorter.stats.cached_tokens == 10
    cold = load(arch, prefix_cache_bytes=0).generate(ids[:10] + ids[WARMED:], max_tokens=16)
    assert shorter.token_ids == cold.token_ids
    assert restarted.generate(ids, max_tokens=16).token_ids == greedy(arch)


def test_the_file_holds_full_layers_whole_and_windows_and_states_at_each_snapshot(root):
    ids = prompt("gemma3")
    load("gemma3").warm(ids[:WARMED])
    (path,) = root.glob("*/*.safetensors")
    _, tensors = read_parts(path)
    # gemma3 fixture: layers 0-4 slide over 8 positions, layer 5 sees all; 2 KV heads of 16, float32.
    expected = {"token_ids": ["I32", [WARMED]]}
    expected |= {f"layers.5.{j}": ["F32", [1, 2, WARMED, 16]] for j in (0, 1)}
    expected |= {f"snapshots.{WARMED}.{i}.{j}": ["F32", [1, 2, 7, 16]] for i in range(5) for j in (0, 1)}
    assert {name: parts[:2] for name, parts in tensors.items()} == expected
    load("lfm2").warm(ids[:WARMED])
    (lfm2,) = [p for p in root.glob("*/*.safetensors") if p != path]
    _, tensors = read_parts(lfm2)
    # lfm2 fixture: conv (kernel 3: the last 2 inputs of 64 channels) / attention / conv / attention.
    expected = {"token_ids": ["I32", [WARMED]]}
    expected |= {f"layers.{i}.{j}": ["F32", [1, 2, WARMED, 16]] for i in (1, 3) for j in (0, 1)}
    expected |= {f"snapshots.{WARMED}.{i}.0": ["F32", [1, 2, 64]] for i in (0, 2)}
    assert {name: parts[:2] for name, parts in tensors.items()} == expected


def test_snapshots_count_in_the_budget_of_a_stored_entry(root, monkeypatch):
    ids = prompt("gemma3")
    load("gemma3").warm(ids[:WARMED])
    # The full layer over 16 positions, and 5 windows of 7 positions: keys and values, float32.
    full, windows = 2 * (2 * WARMED * 16 * 4), 5 * 2 * (2 * 7 * 16 * 4)
    reads = []
    monkeypatch.setattr(prefix_file, "_tensor_digest", lambda: reads.append(1) or hashlib.sha256())
    short = load("gemma3", prefix_cache_bytes=full + windows - 1)
    assert short.generate(ids, max_tokens=2).stats.cached_tokens == 0 and not reads  # known too big: never read
    exact = load("gemma3", prefix_cache_bytes=full + windows)
    assert exact.generate(ids, max_tokens=2).stats.cached_tokens == WARMED and len(reads) == 1
    assert exact.cache_stats.bytes_held == full + windows  # the answer's own entry did not fit besides


def test_warming_a_prefix_held_in_memory_still_writes_it(root):
    ids = prompt("gemma3")
    model = load("gemma3")
    model.generate(ids[:WARMED], max_tokens=1)  # in memory, with a snapshot at 16
    assert model.warm(ids[:WARMED]) == WARMED and len(list(root.glob("*/*.safetensors"))) == 1
    assert load("gemma3").generate(ids, max_tokens=16).stats.cached_tokens == WARMED


@pytest.mark.parametrize("arch", ["gemma3", "lfm2"])
def test_evicting_a_stored_entry_frees_its_snapshots_and_a_reload_resumes_again(arch, root):
    ids = prompt(arch)
    load(arch).warm(ids[:WARMED])
    model = load(arch, prefix_cache_bytes=1 << 20)
    first = model.generate(ids[:WARMED] + [5], max_tokens=1)
    assert first.stats.cached_tokens == WARMED
    model.prefix_cache.clear()
    (entry,) = model.prefix_cache._entries.values()
    assert model.cache_stats.bytes_held == 0 and entry.layers is None
    assert set(entry.snapshots) == {WARMED} and entry.snapshots[WARMED] is None  # the position stays known
    again = model.generate(ids, max_tokens=16)
    assert again.stats.cached_tokens == WARMED and again.token_ids == greedy(arch)


# -- a damaged file is quarantined with a warning and the prompt prefilled cold ---------------------------------------


@pytest.fixture(params=["gemma3", "lfm2"])
def warmed(request, root: Path) -> tuple[str, Path]:
    ids = prompt(request.param)
    load(request.param).warm(ids[:WARMED])
    (path,) = root.glob("*/*.safetensors")
    return request.param, path


def assert_cold(arch: str, path: Path, root: Path, caplog: pytest.LogCaptureFixture, why: str) -> None:
    result = load(arch).generate(prompt(arch), max_tokens=16)
    assert result.stats.cached_tokens == 0 and result.token_ids == greedy(arch)
    assert not path.exists() and (root / "quarantine" / f"{path.parent.name}-{path.name}").is_file()
    assert f"ignoring prefix cache file {path}: " in caplog.text and "moved to quarantine/" in caplog.text
    assert why in caplog.text


@pytest.mark.parametrize("where", [0.0, 0.5, 1.0])
def test_a_flipped_byte_in_a_snapshot_tensor_is_quarantined(where, warmed, root, caplog):
    arch, path = warmed
    raw = bytearray(path.read_bytes())
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    begin, end = header[f"snapshots.{WARMED}.0.0"]["data_offsets"]
    raw[8 + length + begin + int((end - begin - 1) * where)] ^= 0x01
    path.write_bytes(raw)
    assert_cold(arch, path, root, caplog, "the checksum of its tensors does not match its sha256 metadata")


@pytest.mark.parametrize("keep", [-1, -100, "the header"])
def test_a_truncated_file_is_quarantined(keep, warmed, root, caplog):
    arch, path = warmed
    raw = path.read_bytes()
    path.write_bytes(raw[: 8 + struct.unpack("<Q", raw[:8])[0] if keep == "the header" else keep])
    assert_cold(arch, path, root, caplog, "bytes, but its header describes")


def _positions(value: str | None):
    def edit(metadata: dict) -> None:
        metadata.pop("snapshots")
        if value is not None:
            metadata["snapshots"] = value

    return edit


def _rename_snapshots(to: int):
    """Snapshots written at `to` instead of the end: the header and the tensors agree, the checksum too."""

    def edit(metadata: dict, tensors: dict) -> None:
        metadata["snapshots"] = str(to)
        for name in [n for n in tensors if n.startswith("snapshots.")]:
            tensors[name.replace(f"snapshots.{WARMED}.", f"snapshots.{to}.")] = tensors.pop(name)

    return edit


POSITIONS = {  # what the header says; the tensors are those of a snapshot at 16, the end
    "not the end": ("15", "metadata snapshots='15' is not 1 to 64 increasing positions in [1, 16], the last 16"),
    "past the end": ("17", "metadata snapshots='17' is not 1 to 64 increasing positions in [1, 16], the last 16"),
    "zero": ("0,16", "metadata snapshots='0,16'"),
    "twice": ("16,16", "metadata snapshots='16,16'"),
    "unsorted": ("16,8", "metadata snapshots='16,8'"),
    "one without its tensors": ("8,16", "tensors snapshots.8.0.0, snapshots.8."),
    "none": ("", "metadata snapshots='' is not 1 to 64"),
    "missing": (None, "metadata snapshots=None"),
    "a number": (16, "metadata snapshots=16"),
    "negative": ("-16", "metadata snapshots='-16'"),
    "spaced": ("8, 16", "metadata snapshots='8, 16'"),
    "65 of them": (",".join(map(str, range(1, 66))), "metadata snapshots='1,2,3"),
    "a long string": ("1" * 5000, "metadata snapshots='111111"),
}


@pytest.mark.slow
@pytest.mark.parametrize("value, why", POSITIONS.values(), ids=POSITIONS.keys())
def test_wrong_snapshot_positions_in_the_header_are_quarantined(value, why, warmed, root, caplog):
    arch, path = warmed
    metadata, tensors = read_parts(path)
    _positions(value)(metadata)
    write_parts(path, metadata, tensors)
    assert_cold(arch, path, root, caplog, why)


def test_a_snapshot_not_at_the_end_is_quarantined_even_when_consistent(warmed, root, caplog):
    arch, path = warmed
    metadata, tensors = read_parts(path)
    _rename_snapshots(12)(metadata, tensors)
    write_parts(path, metadata, tensors)
    assert_cold(arch, path, root, caplog, "metadata snapshots='12' is not 1 to 64 increasing positions")


@pytest.mark.parametrize("change", ["one position more", "one position less", "a batch of 2"])
def test_a_snapshot_of_the_wrong_shape_is_quarantined(change, warmed, root, caplog):
    arch, path = warmed
    metadata, tensors = read_parts(path)
    name = f"snapshots.{WARMED}.0.0"  # a window's keys (B, heads, positions, dim); a convolution's last inputs
    dims = list(tensors[name][1])
    axis = 0 if change == "a batch of 2" else 2 if len(dims) == 4 else 1
    dims[axis] += -1 if change == "one position less" else 1
    tensors[name][1:] = [dims, b"\0" * (4 * math.prod(dims))]
    write_parts(path, metadata, tensors)
    assert_cold(arch, path, root, caplog, f"tensor {name} is not F32 of shape")


def test_a_file_without_a_snapshot_tensor_is_quarantined(warmed, root, caplog):
    arch, path = warmed
    metadata, tensors = read_parts(path)
    del tensors[f"snapshots.{WARMED}.2.0"]
    write_parts(path, metadata, tensors)
    assert_cold(arch, path, root, caplog, f"tensors snapshots.{WARMED}.2.0 do not match")


def test_a_v2_file_in_the_folder_is_quarantined(warmed, root, caplog):
    arch, path = warmed
    metadata, tensors = read_parts(path)
    metadata["format"] = "mlxinfer-prefix-v2"
    metadata.pop("snapshots")
    write_parts(path, metadata, tensors)
    assert_cold(arch, path, root, caplog, "format 'mlxinfer-prefix-v2' is not mlxinfer-prefix-v3")


def test_v2_files_in_their_own_folder_are_ignored_listed_and_cleared(root, caplog):
    """A format bump changes the fingerprint: older files sit in a folder no model reads any more."""
    ids = prompt("qwen2")
    load("qwen2").warm(ids[:WARMED])
    (path,) = root.glob("*/*.safetensors")
    metadata, tensors = read_parts(path)
    metadata["format"] = "mlxinfer-prefix-v2"
    metadata.pop("snapshots")
    old = root / ("f" * 24) / path.name
    old.parent.mkdir()
    write_parts(old, metadata, tensors)
    path.unlink()
    before = old.read_bytes()
    result = load("qwen2").generate(ids, max_tokens=4)
    assert result.stats.cached_tokens == 0 and old.read_bytes() == before and "prefix cache" not in caplog.text
    listed = CliRunner().invoke(main, ["cache", "ls"])
    assert listed.exit_code == 0 and str(old) in listed.stdout and "qwen2" in listed.stdout
    cleared = CliRunner().invoke(main, ["cache", "clear"])
    assert cleared.exit_code == 0 and not old.exists()


def test_cache_ls_lists_the_files_of_windowed_and_recurrent_models(root):
    ids = prompt("gemma3")
    for arch in ("gemma3", "lfm2"):
        load(arch).warm(ids[:WARMED])
    result = CliRunner().invoke(main, ["cache", "ls"])
    assert result.exit_code == 0 and "2 warmed prefixes" in result.stderr, result.output
    lines = result.stdout.splitlines()
    assert len(lines) == 2 and all(str(WARMED) in line for line in lines)
    assert any("gemma3" in line for line in lines) and any("lfm2" in line for line in lines)


def test_warm_keeps_the_deepest_snapshots_a_file_may_hold(root):
    ids = [(7 * t) % 250 for t in range(100)]
    model = load("gemma3")
    model.generate(ids[:64], max_tokens=1, snapshot_every=1)  # a snapshot at every position up to 64
    model.warm(ids)  # resumes at 64: its 64 snapshots and the end are more than a file holds
    (path,) = root.glob("*/*.safetensors")
    metadata, _ = read_parts(path)
    assert metadata["snapshots"] == ",".join(map(str, [*range(2, 65), 100]))  # the deepest 64
    restarted = load("gemma3")
    probe = ids[:50] + [3, 4, 5]
    result = restarted.generate(probe, max_tokens=4)
    assert result.stats.cached_tokens == 50
    assert result.token_ids == load("gemma3", prefix_cache_bytes=0).generate(probe, max_tokens=4).token_ids


def test_the_store_refuses_snapshots_no_file_may_hold(root):
    store = load("gemma3").prefix_cache.store
    ids = prompt("gemma3")[:WARMED]
    for positions in ([*range(1, 66), WARMED][-65:], [8], []):  # 65 of them; not at the end; none at all
        with pytest.raises(CacheError, match="cannot be stored with a 16-token prefix"):
            store.save(ids, [None] * 6, {p: [None] * 6 for p in positions})
    assert not list(root.glob("*/*.safetensors"))


@pytest.mark.parametrize("arch", ["gemma3", "lfm2"])
def test_the_server_s_scheduler_resumes_from_the_file_too(arch, root):
    ids = prompt(arch)
    load(arch).warm(ids[:WARMED])
    model = load(arch)
    scheduler = ServingThread(model.runtime, SchedulerConfig(max_batch=2, prefill_chunk=8))
    try:
        done = [Collector() for _ in range(2)]
        for prompt_ids, collector in zip([ids, ids[:WARMED] + [9, 8, 7]], done):
            scheduler.submit(Job(prompt_ids, collector, max_tokens=16))
        ends = [collector.wait().end for collector in done]
    finally:
        scheduler.stop()
    assert all(isinstance(end, Finished) and end.stats.cached_tokens == WARMED for end in ends)
    assert done[0].text == model.tokenizer.decode(greedy(arch))
