"""The converter's output folder under hostile conditions.

OUT never overlaps the source; --force replaces only what mlxinfer wrote (an empty folder or an
earlier conversion); leftovers are removed only when they are ours and never through a symlink;
disk full, file-size limits, read-only and unwritable folders end in one line, with no half-written
model and the previous OUT intact. Every refusal is checked to leave the whole test folder as it was.
"""

from __future__ import annotations

import builtins
import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest
from click.testing import CliRunner
from mlxinfer.convert import (
    ConvertSettings,
    convert,
    output_folder,
    pipeline,
    plan_conversion,
    run_conversion,
    writer,
)

import mlxinfer
from mlxinfer import disk
from mlxinfer.cli import main
from mlxinfer.errors import ConversionError
from mlxinfer.memory import MachineMemory
from mlxinfer.tokenizer.tokenizer import MAX_TOKENIZER_BYTES
from mlxinfer.untrusted import MAX_SIDE_FILE_BYTES

MANIFEST = output_folder.MANIFEST


# --- helpers -----------------------------------------------------------------------------------


def run(*args: str | Path):
    return CliRunner().invoke(main, ["convert", *map(str, args), "--no-eval", "--method", "rtn"])


def assert_one_line(result, *words: str) -> str:
    """Exit 1 through click (not an escaped exception), one printable Error line holding `words`."""
    output = result.stdout + result.stderr
    assert "Traceback" not in output, output
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), (result.exception, output)
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and errors[0].isprintable(), result.stderr
    for word in words:
        assert word in errors[0], errors[0]
    return errors[0]


def snapshot(root: Path) -> dict[str, tuple]:
    """Everything under `root` (links not followed): kind and content digest or link target."""
    state: dict[str, tuple] = {}

    def record(path: Path) -> None:
        rel = os.path.relpath(path, root)
        if path.is_symlink():
            state[rel] = ("link", os.readlink(path))
        elif path.is_file():
            state[rel] = ("file", hashlib.sha256(path.read_bytes()).hexdigest())
        elif path.is_dir():
            state[rel] = ("dir",)
            for child in path.iterdir():
                record(child)
        else:
            state[rel] = ("other", path.lstat().st_mode)

    if os.path.lexists(root):
        record(root)
    return state


def assert_complete(out: Path, bits: int = 4) -> None:
    """OUT is a finished conversion: every file listed with its digest, nothing else, and it loads."""
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["settings"]["bits"] == bits
    digests = writer.sha256_files(out)
    assert digests.pop(MANIFEST) and digests == manifest["files"] and set(os.listdir(out)) == {*digests, MANIFEST}
    assert mlxinfer.load(out).config.model_type == "llama"


def leftovers(folder: Path, out_name: str = "out") -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.startswith(f".{out_name}."))


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", ""])
    process.wait()
    return process.pid


@pytest.fixture
def src(tiny_copy) -> Path:
    return tiny_copy("llama_classic")


@pytest.fixture
def earlier(src: Path, tmp_path: Path) -> Path:
    """An earlier 8-bit conversion at tmp_path/out: ours to replace with --force."""
    out = tmp_path / "out"
    convert(src, out, bits=8, evaluate=False, progress=False)
    return out


@pytest.fixture
def mount_tmpfs(tmp_path: Path):
    """mount(size) -> a fresh tmpfs folder; unmounted afterwards. Skipped where mounting is not allowed."""
    points: list[Path] = []

    def mount(size: str) -> Path:
        point = tmp_path / f"mnt{len(points)}"
        point.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)], capture_output=True)
        if done.returncode != 0:
            reason = f"cannot mount a tmpfs here: {done.stderr.decode(errors='replace').strip()}"
            if os.environ.get("CI") == "true" and sys.platform == "linux":
                pytest.fail(reason + " (CI runs as root and must be able to)")
            pytest.skip(reason)
        points.append(point)
        return point

    yield mount
    for point in reversed(points):
        subprocess.run(["umount", "-l", str(point)], capture_output=True)


def remount(point: Path, options: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{options}", str(point)], check=True, capture_output=True)


# --- OUT and the source ------------------------------------------------------------------------


def _models_holding_src(t: Path, s: Path):
    (t / "models").mkdir()
    s.rename(t / "models" / "src")
    (t / "l").symlink_to(t / "models" / "src")
    return t / "l", t / "models", "contains the source"


def _gguf_inside(t: Path, s: Path):
    (t / "models").mkdir()
    (t / "models" / "m.gguf").write_bytes(b"GGUF" + bytes(60))
    return t / "models" / "m.gguf", t / "models", "contains the source"


def _linked(t: Path, s: Path) -> Path:
    (t / "link").symlink_to(s)
    return t / "link"


OVERLAPS = {
    "out is src": lambda t, s: (s, s, "is the source itself"),
    "out is src via ..": lambda t, s: (s, s / ".." / s.name, "is the source itself"),
    "out is src via a trailing .": lambda t, s: (s, f"{s}/.", "is the source itself"),
    "out inside src": lambda t, s: (s, s / "out", "inside the source"),
    "out deep inside src": lambda t, s: (s, s / "a" / "b" / "c", "inside the source"),
    "out inside src via ..": lambda t, s: (s, s / "x" / ".." / "out", "inside the source"),
    "out inside src given through a symlink": lambda t, s: (_linked(t, s), s / "out", "inside the source"),
    "out inside src through a symlinked parent": lambda t, s: (s, _linked(t, s) / "out", "inside the source"),
    "out is src through a symlink": lambda t, s: (s, _linked(t, s), "symbolic link"),
    "out is src via link/..": lambda t, s: (s, _linked(t, s) / ".." / s.name, "is the source itself"),
    "out contains src": lambda t, s: (s, t, "contains the source"),
    "out contains src two levels up": lambda t, s: (s, t.parent, "contains the source"),
    "out contains src given through a symlink": _models_holding_src,
    "out contains a gguf source": _gguf_inside,
}


@pytest.mark.parametrize("force", [False, True], ids=["plain", "force"])
@pytest.mark.parametrize("layout", OVERLAPS)
def test_output_overlapping_the_source_is_refused(tmp_path, src, layout, force):
    source, out, words = OVERLAPS[layout](tmp_path, src)
    before = snapshot(tmp_path)
    result = run(source, "-o", out, *(["--force"] if force else []))
    assert_one_line(result, words)
    assert snapshot(tmp_path) == before


# --- what --force may replace ------------------------------------------------------------------


def _edit_manifest(edit):
    def apply(out: Path) -> None:
        manifest = json.loads((out / MANIFEST).read_text())
        edit(manifest)
        (out / MANIFEST).write_text(json.dumps(manifest))

    return apply


def _manifest_bytes(data: bytes):
    return lambda out: (out / MANIFEST).write_bytes(data)


def _replace(out: Path, make) -> None:
    shutil.rmtree(out)
    make(out)


def _huge_manifest(out: Path) -> None:
    with open(out / MANIFEST, "r+b") as f:
        f.truncate(output_folder.MAX_MANIFEST_BYTES + 1)  # sparse: costs no disk


def _manifest_moved_behind_a_link(out: Path) -> None:
    (out / MANIFEST).rename(out.parent / "elsewhere.json")
    (out / MANIFEST).symlink_to(out.parent / "elsewhere.json")


def _tokenizer_as_link(out: Path) -> None:
    (out / "tokenizer.json").rename(out.parent / "tok.json")
    (out / "tokenizer.json").symlink_to(out.parent / "tok.json")


def _listed_foreign_file(out: Path) -> None:
    _edit_manifest(lambda m: m["files"].update({"notes.txt": "0" * 64}))(out)
    (out / "notes.txt").write_text("mine")


def _out_links_to_a_conversion(out: Path) -> None:
    out.rename(out.parent / "real")
    out.symlink_to(out.parent / "real")


FOREIGN = {
    "a file": (lambda out: _replace(out, lambda p: p.write_text("my notes")), "is not a folder"),
    "a fifo": (lambda out: _replace(out, os.mkfifo), "is not a folder"),
    "a user folder": (
        lambda out: _replace(out, lambda p: (p.mkdir(), (p / "notes.txt").write_text("x"))),
        f"has no {MANIFEST}",
    ),
    "a folder holding a folder": (
        lambda out: _replace(out, lambda p: (p / "src").mkdir(parents=True)),
        f"has no {MANIFEST}",
    ),
    "our files without a manifest": (lambda out: (out / MANIFEST).unlink(), f"has no {MANIFEST}"),
    "manifest is a folder": (lambda out: ((out / MANIFEST).unlink(), (out / MANIFEST).mkdir()), f"has no {MANIFEST}"),
    "manifest is a symlink": (_manifest_moved_behind_a_link, f"has no {MANIFEST}"),
    "manifest over the size bound": (_huge_manifest, "is larger than"),
    "manifest lists a foreign file": (_listed_foreign_file, "'notes.txt'"),
    "an extra file": (lambda out: (out / "notes.txt").write_text("x"), "'notes.txt'"),
    "an extra folder": (lambda out: (out / "sub").mkdir(), "'sub'"),
    "an extra hidden file": (lambda out: (out / ".git").write_text("x"), "'.git'"),
    "one of our names as a symlink": (_tokenizer_as_link, "'tokenizer.json'"),
    # macOS metadata is allowed only as plain files, and AppleDouble files only for our own names
    "a .DS_Store folder": (lambda out: (out / ".DS_Store").mkdir(), "'.DS_Store'"),
    "a .DS_Store symlink": (lambda out: (out / ".DS_Store").symlink_to(out.parent / "x"), "'.DS_Store'"),
    "an AppleDouble file of a foreign name": (lambda out: (out / "._notes.txt").write_bytes(b"\0\5"), "'._notes.txt'"),
    "an AppleDouble file alone": (lambda out: (out / "._").write_bytes(b"\0\5"), "'._'"),
    "a user folder with a .DS_Store": (
        lambda out: _replace(out, lambda p: (p.mkdir(), (p / ".DS_Store").touch(), (p / "notes.txt").touch())),
        f"has no {MANIFEST}",
    ),
    "OUT a symlink to an earlier conversion": (_out_links_to_a_conversion, "symbolic link"),
    "OUT a dangling symlink": (lambda out: _replace(out, lambda p: p.symlink_to(p.parent / "nowhere")), "symbolic"),
}
BAD_JSON = {
    "empty": b"",
    "truncated": b'{"files": {',
    "deep nesting": b"[" * 200_000 + b"]" * 200_000,
    "not UTF-8": b"\xff\xfe{\x00",
    "a 5000-digit number": b"1" * 5000,
    "NUL bytes": b"\x00" * 64,
}
NOT_A_DICT = {"a list": b"[]", "null": b"null", "a number": b"1", "a string": b'"files"', "NaN, no keys": b'{"a": NaN}'}
for _name, _data in BAD_JSON.items():
    FOREIGN[f"manifest {_name}"] = (_manifest_bytes(_data), "not valid JSON")
for _name, _data in NOT_A_DICT.items():
    FOREIGN[f"manifest {_name}"] = (_manifest_bytes(_data), "not one mlxinfer wrote")
for _key in sorted(output_folder.MANIFEST_KEYS):
    FOREIGN[f"manifest without {_key!r}"] = (_edit_manifest(lambda m, k=_key: m.pop(k)), "not one mlxinfer wrote")
for _label, _files in {"a list": [], "a string": "x", "null": None, "a number": 1}.items():
    FOREIGN[f"manifest files {_label}"] = (
        _edit_manifest(lambda m, f=_files: m.update(files=f)),
        "not one mlxinfer wrote",
    )


@pytest.mark.slow
@pytest.mark.parametrize("force", [False, True], ids=["plain", "force"])
@pytest.mark.parametrize("case", FOREIGN)
def test_force_replaces_nothing_mlxinfer_did_not_write(tmp_path, src, earlier, case, force):
    make, words = FOREIGN[case]
    make(earlier)
    before = snapshot(tmp_path)
    line = assert_one_line(run(src, "-o", earlier, *(["--force"] if force else [])), words)
    assert str(earlier) in line and "pass --force" not in line  # --force would not help: say so
    assert snapshot(tmp_path) == before


def _mac_metadata(folder: Path) -> None:
    """What Finder (.DS_Store) and a copy to exFAT/SMB (._NAME AppleDouble files) add to a folder."""
    (folder / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    for name in [MANIFEST, *(n for n in os.listdir(folder) if not n.startswith("."))]:
        (folder / f"._{name}").write_bytes(b"\0\5\26\7")


REPLACEABLE = {
    "an empty folder": lambda out: _replace(out, Path.mkdir),
    "an empty folder Finder has shown": lambda out: _replace(out, lambda p: (p.mkdir(), (p / ".DS_Store").touch())),
    "an earlier conversion Finder has shown": lambda out: (out / ".DS_Store").write_bytes(b"\0\0\0\1Bud1"),
    "an earlier conversion copied to exFAT": _mac_metadata,
    "an earlier conversion": lambda out: None,
    "an earlier conversion missing a file": lambda out: (out / "tokenizer_config.json").unlink(),
    "an earlier conversion, manifest listing more": _edit_manifest(
        lambda m: m["files"].update({"model-00002-of-00002.safetensors": "0" * 64})
    ),
}


@pytest.mark.parametrize("case", REPLACEABLE)
def test_force_replaces_an_earlier_conversion_or_an_empty_folder(tmp_path, src, earlier, case):
    REPLACEABLE[case](earlier)
    source = snapshot(src)
    assert_one_line(run(src, "-o", earlier), "already exists; pass --force")
    result = run(src, "-o", earlier, "--force")
    assert result.exit_code == 0, result.output
    assert_complete(earlier, bits=4)
    assert leftovers(tmp_path) == [] and snapshot(src) == source


def test_a_missing_parent_is_created_and_a_file_parent_refused(tmp_path, src):
    assert run(src, "-o", tmp_path / "a" / "b" / "out").exit_code == 0
    assert_complete(tmp_path / "a" / "b" / "out")
    (tmp_path / "file").write_text("x")
    before = snapshot(tmp_path)
    assert_one_line(run(src, "-o", tmp_path / "file" / "out"), "is not a folder", str(tmp_path / "file"))
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("force", [False, True], ids=["plain", "force"])
@pytest.mark.parametrize("target", ["/", "/..", "/./", "~", "~/", "HOME/../home"])
def test_root_and_home_are_refused(tmp_path, src, monkeypatch, target, force):
    home = tmp_path / "home"
    home.mkdir()  # empty: only the explicit rule can refuse it
    monkeypatch.setenv("HOME", str(home))
    before = snapshot(tmp_path)
    result = run(src, "-o", target.replace("HOME", str(home)), *(["--force"] if force else []))
    assert_one_line(result, "root or home folder")
    assert snapshot(tmp_path) == before


HOSTILE_NAMES = ["new\nline", "carriage\rreturn", "tab\tname", "\x1b[31mred", "bell\x07", "del\x7f"]


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_a_hostile_output_name_stays_one_line(tmp_path, src, name):
    (tmp_path / name).mkdir()
    (tmp_path / name / "notes.txt").write_text("x")
    before = snapshot(tmp_path)
    assert_one_line(run(src, "-o", tmp_path / name, "--force"), repr(str(tmp_path / name)))
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("name", ["z" * 256, "z" * 300, "\u00e9" * 128])
def test_a_name_too_long_is_one_line(tmp_path, src, name):
    before = snapshot(tmp_path)
    assert_one_line(run(src, "-o", tmp_path / name), "name too long")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("name", ["x" * 241, "y" * 250, "w" * 255, "\u00e9" * 127])
def test_a_long_name_up_to_the_limit_converts_and_replaces(tmp_path, src, name):
    # `.NAME.partial-PID` would exceed 255 bytes: the temporary folders use a shortened, hashed NAME.
    out = tmp_path / name
    assert run(src, "-o", out).exit_code == 0
    assert_complete(out)
    assert run(src, "-o", out, "--force").exit_code == 0  # sets the previous OUT aside as `.NAME.old-PID`
    assert_complete(out)
    assert sorted(os.listdir(tmp_path)) == sorted([src.name, name])


@pytest.mark.parametrize("kind", ["partial", "old"])
def test_leftovers_of_a_long_name_are_removed_in_both_forms(tmp_path, src, earlier, kind):
    # A long name's leftover is `.NAME.KIND-PID` or the shortened form, depending on the PID's digits.
    pid = dead_pid()
    name = "n" * (255 - len(f"..{kind}-{pid}"))  # the plain form just fits for this pid
    earlier.rename(tmp_path / name)
    dead = [f".{name}.{kind}-{pid}", f".{output_folder._short_stem(name)}.{kind}-{pid}"]
    for leftover in dead:
        _ours(tmp_path / leftover)
    assert run(src, "-o", tmp_path / name, "--force").exit_code == 0
    assert_complete(tmp_path / name)
    assert sorted(os.listdir(tmp_path)) == sorted([src.name, name])


def test_a_nul_byte_in_the_output_is_one_line(tmp_path, src):
    with pytest.raises(ConversionError, match="NUL byte"):
        convert(src, f"{tmp_path}/a\0b", evaluate=False, progress=False)
    assert os.listdir(tmp_path) == [src.name]


# --- OUT changing while we convert ---------------------------------------------------------------


def _user_folder(out: Path) -> None:
    out.mkdir()
    (out / "notes.txt").write_text("mine")


@pytest.mark.parametrize("force", [False, True], ids=["plain", "force"])
@pytest.mark.parametrize("when", ["after planning", "before the rename"])
def test_a_foreign_out_appearing_mid_conversion_is_kept(tmp_path, src, monkeypatch, when, force):
    out = tmp_path / "out"
    plan = plan_conversion(src, out, ConvertSettings(method="rtn", evaluate=False), force=force)
    if when == "after planning":
        _user_folder(out)
    else:
        real = pipeline.write_manifest
        monkeypatch.setattr(pipeline, "write_manifest", lambda *a: (_user_folder(out), real(*a))[1])
    with pytest.raises(ConversionError, match="already exists") as caught:
        run_conversion(plan, progress=False)
    assert str(out) in str(caught.value)
    assert (out / "notes.txt").read_text() == "mine" and os.listdir(out) == ["notes.txt"]
    assert leftovers(tmp_path) == []


# --- leftovers of dead conversions ---------------------------------------------------------------


def _ours(folder: Path) -> None:
    folder.mkdir()
    for name in ("shard-0.partial.safetensors", "config.json", "tokenizer.json", MANIFEST):
        (folder / name).write_text("{}")


def _ours_outside(tmp_path: Path) -> Path:
    target = tmp_path / "target"
    _ours(target)
    return target


STALE = {
    # name pattern, how to fill it, whether a run must remove it
    "dead partial of ours": (".out.partial-{dead}", _ours, True),
    "dead old of ours": (".out.old-{dead}", _ours, True),
    "our own pid's partial": (".out.partial-{own}", _ours, True),
    "dead empty partial": (".out.partial-{dead}", Path.mkdir, True),
    "live partial": (".out.partial-{live}", _ours, False),
    "dead partial with macOS metadata": (".out.partial-{dead}", lambda p: (_ours(p), _mac_metadata(p)), True),
    "dead old with macOS metadata": (".out.old-{dead}", lambda p: (_ours(p), _mac_metadata(p)), True),
    "dead partial with a foreign file": (".out.partial-{dead}", lambda p: (_ours(p), (p / "a.txt").touch()), False),
    "dead partial with a subfolder": (".out.partial-{dead}", lambda p: (_ours(p), (p / "sub").mkdir()), False),
    "dead partial that is a file": (".out.partial-{dead}", lambda p: p.write_text("x"), False),
    "dead partial that is a symlink to ours": (
        ".out.partial-{dead}",
        lambda p: p.symlink_to(_ours_outside(p.parent)),
        False,
    ),
    "dead partial holding a symlinked config.json": (
        ".out.partial-{dead}",
        lambda p: (p.mkdir(), (p / "config.json").symlink_to(_ours_outside(p.parent) / "config.json")),
        False,
    ),
    "not a pid": (".out.partial-x1", _ours, False),
    "no pid": (".out.partial-", _ours, False),
    "two numbers": (".out.partial-1-{dead}", _ours, False),
    "unicode digits": (".out.partial-\u0663\u0663", _ours, False),
    "too many digits": (".out.partial-99999999999", _ours, False),
    "another output's partial": (".other.partial-{dead}", _ours, False),
    "another output whose name extends ours": (".out.x.partial-{dead}", _ours, False),
}


@pytest.mark.slow
@pytest.mark.parametrize("with_earlier", [False, True], ids=["new", "over-earlier"])
@pytest.mark.parametrize("case", STALE)
def test_only_our_leftovers_are_removed(tmp_path, src, request, case, with_earlier):
    pattern, fill, removed = STALE[case]
    removed = removed and (with_earlier or ".old-" not in pattern)  # with no OUT, an old one is the previous OUT
    if with_earlier:
        request.getfixturevalue("earlier")
    name = pattern.format(dead=dead_pid(), own=os.getpid(), live=os.getppid())
    fill(tmp_path / name)
    outside = snapshot(tmp_path / "target")
    result = run(src, "-o", tmp_path / "out", *(["--force"] if with_earlier else []))
    assert result.exit_code == 0, result.output
    assert_complete(tmp_path / "out")
    assert os.path.lexists(tmp_path / name) != removed
    assert snapshot(tmp_path / "target") == outside  # nothing followed through a link


def test_the_previous_out_left_by_a_kill_mid_replace_is_kept(tmp_path, src, earlier):
    # Killed between the two renames: OUT is gone and .out.old-PID is the user's previous model.
    old = tmp_path / f".out.old-{dead_pid()}"
    earlier.rename(old)
    before = snapshot(old)
    assert run(src, "-o", tmp_path / "out").exit_code == 0
    assert snapshot(old) == before
    assert run(src, "-o", tmp_path / "out", "--force").exit_code == 0  # OUT is back: now it is a leftover
    assert not old.exists()


# --- write failures: real ones ---------------------------------------------------------------------


def _assert_clean_failure_or_complete(result, point: Path, before: dict) -> bool:
    """Either a complete OUT, or one line about space and the mount exactly as it was."""
    if result.exit_code == 0:
        assert_complete(point / "out")
        assert leftovers(point) == []
        return True
    line = assert_one_line(result)
    assert "no space left" in line or "are free" in line, line
    assert snapshot(point) == before
    return False


@pytest.mark.parametrize("kib", range(16, 100, 4))
def test_disk_full_at_every_stage_leaves_nothing(src, mount_tmpfs, kib):
    point = mount_tmpfs(f"{kib}k")
    done = _assert_clean_failure_or_complete(run(src, "-o", point / "out"), point, snapshot(point))
    if kib <= 20 or kib >= 96:  # far too small must fail, ample room must succeed
        assert done == (kib >= 96)


@pytest.mark.parametrize("extra_kib", range(0, 100, 8))
def test_disk_full_while_replacing_keeps_the_previous_out(src, earlier, mount_tmpfs, extra_kib):
    point = mount_tmpfs("1m")
    shutil.copytree(earlier, point / "out")
    used = os.statvfs(point)
    remount(point, f"size={(used.f_blocks - used.f_bfree) * used.f_frsize // 1024 + extra_kib}k")
    _assert_clean_failure_or_complete(run(src, "-o", point / "out", "--force"), point, snapshot(point))


READ_ONLY = {
    "new OUT": lambda p: p / "new",
    "new nested OUT": lambda p: p / "a" / "b" / "new",
    "earlier conversion with --force": lambda p: p / "out",
}


@pytest.mark.parametrize("case", READ_ONLY)
def test_a_read_only_file_system_is_one_line(src, earlier, mount_tmpfs, case):
    point = mount_tmpfs("1m")
    shutil.copytree(earlier, point / "out")
    remount(point, "ro")
    before = snapshot(point)
    assert_one_line(run(src, "-o", READ_ONLY[case](point), "--force"), "read-only file system", str(point))
    assert snapshot(point) == before


LIMITED = textwrap.dedent(
    """
    import gc, resource, signal, sys
    limit = int(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    if sys.argv[2] == "default":
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # as a host program that restored it would
    from mlxinfer.cli import main
    try:
        main(sys.argv[3:], prog_name="mlxinfer")
    finally:
        # A file the failed conversion left open would flush its buffer whenever it is collected, with
        # SIGXFSZ deadly again: collect now, so that happens every run rather than now and then.
        gc.collect()
    """
)


def _limited(tmp_path: Path, src: Path, command: list[str], force: bool) -> None:
    out = tmp_path / "out"
    before = snapshot(tmp_path)
    args = ["convert", str(src), "-o", str(out), "--no-eval", "--method", "rtn", *(["--force"] if force else [])]
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run([*command, *args], capture_output=True, text=True, env=env, timeout=300)
    assert "Traceback" not in done.stderr and done.returncode == 1, (done.returncode, done.stderr[-2000:])
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "ulimit -f" in errors[0] and "shard-0.partial.safetensors" in errors[0], errors
    assert snapshot(tmp_path) == before


@pytest.mark.slow
@pytest.mark.parametrize("force", [False, True], ids=["new", "over-earlier"])
@pytest.mark.parametrize("signal_mode", ["python", "default"])
@pytest.mark.parametrize("limit", [0, 4096, 40_000])
def test_a_file_size_limit_is_one_line(tmp_path, src, request, limit, signal_mode, force):
    if force:
        request.getfixturevalue("earlier")
    _limited(tmp_path, src, [sys.executable, "-c", LIMITED, str(limit), signal_mode], force)


def test_ulimit_f_in_a_shell_is_one_line(tmp_path, src):
    shell = shutil.which("bash") or pytest.skip("no bash")
    _limited(tmp_path, src, [shell, "-c", 'ulimit -f 8 && exec "$0" -m mlxinfer.cli "$@"', sys.executable], False)


# --- write failures: injected at each stage --------------------------------------------------------

ERRNOS = {
    errno.ENOSPC: "no space left",
    errno.EDQUOT: "quota exceeded",
    errno.EFBIG: "ulimit -f",
    errno.EACCES: "permission denied",
    errno.EROFS: "read-only file system",
}
STAGES = {
    # stage: (what fails, the name it fails on)
    "partial folder": ("mkdir", ".out.partial-"),
    "shard": ("write", "shard-0.partial.safetensors"),
    "shard rename": ("replace", "model-00001-of-00001.safetensors"),
    "index": ("write", "model.safetensors.index.json"),
    "tokenizer copy": ("write", "tokenizer.json"),
    "generation config copy": ("write", "generation_config.json"),
    "config": ("write", "config.json"),
    "manifest": ("write", MANIFEST),
    "setting the previous OUT aside": ("replace", ".out.old-"),
    "final rename": ("replace", "out"),
}


class _FailingFile:
    """A real, created file whose writes fail as the disk would."""

    def __init__(self, file, code: int):
        self._file, self._code = file, code

    def write(self, data) -> int:
        raise OSError(self._code, os.strerror(self._code))

    def __getattr__(self, name: str):
        return getattr(self._file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._file.close()


def _inject(monkeypatch, how: str, target: str, code: int) -> None:
    hits = []

    def hit(path) -> bool:  # the first matching call only: putting a previous OUT back must work
        name = Path(path).name
        if hits or not (name.startswith(target) if target.startswith(".") else name == target):
            return False
        hits.append(path)
        return True

    def fail(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    if how == "write":

        def fake_open(file, mode="r", *args, **kwargs):
            real = builtins.open(file, mode, *args, **kwargs)
            return _FailingFile(real, code) if ("w" in mode or "x" in mode) and hit(file) else real

        monkeypatch.setattr(writer, "open", fake_open, raising=False)
    elif how == "mkdir":
        real_mkdir = Path.mkdir
        monkeypatch.setattr(Path, "mkdir", lambda p, *a, **k: fail() if hit(p) else real_mkdir(p, *a, **k))
    else:
        real_replace = os.replace
        monkeypatch.setattr(os, "replace", lambda a, b, **k: fail() if hit(b) else real_replace(a, b, **k))


# Every stage, writing a new OUT and replacing an earlier one (only a replace sets a previous OUT aside).
STAGE_CASES = [
    pytest.param(stage, earlier, id=f"{stage}-{'over-earlier' if earlier else 'new'}")
    for stage in STAGES
    for earlier in (False, True)
    if earlier or stage != "setting the previous OUT aside"
]


# The errno changes only the words (disk.reason, checked for every errno below): each stage case gets one errno,
# in turn, so that each of ERRNOS fails three or more stages.
STAGE_ERRNO_CASES = [
    pytest.param(*case.values, code, id=f"{case.id}-{errno.errorcode[code]}")
    for case, code in zip(STAGE_CASES, [*ERRNOS] * len(STAGE_CASES), strict=False)
]


def test_every_errno_fails_three_stages_or_more():
    counts = Counter(param.values[2] for param in STAGE_ERRNO_CASES)
    assert set(counts) == set(ERRNOS) and min(counts.values()) >= 3 and len(STAGE_ERRNO_CASES) == len(STAGE_CASES)


@pytest.mark.parametrize(("stage", "with_earlier", "code"), STAGE_ERRNO_CASES)
def test_a_failed_write_at_any_stage_is_one_line_and_changes_nothing(
    tmp_path, src, request, monkeypatch, stage, code, with_earlier
):
    how, target = STAGES[stage]
    if with_earlier:
        request.getfixturevalue("earlier")
    before = snapshot(tmp_path)
    _inject(monkeypatch, how, target, code)
    result = run(src, "-o", tmp_path / "out", *(["--force"] if with_earlier else []))
    monkeypatch.undo()
    line = assert_one_line(result, ERRNOS[code])
    assert (target if how != "replace" or stage == "shard rename" else str(tmp_path / "out")) in line
    assert snapshot(tmp_path) == before


# Names a user may give -o, or a folder may have: each must come out whole, on one line.
ODD_NAMES = ["plain", "new\nline", "esc\x1b[2J", "rtl\u202eevil", "tab\there", "bell\a", "x" * 200]
FIXED_WORDS = {**ERRNOS, errno.EPERM: "operation not permitted", errno.ENAMETOOLONG: "name too long"}


def test_the_common_errnos_have_the_same_words_on_every_system():
    for code, words in FIXED_WORDS.items():
        assert words in disk.reason(OSError(code, "the OS's own text")), code


@pytest.mark.parametrize(
    "error",
    [OSError("two\nlines"), OSError(), OSError(None, None), OSError(errno.EIO, "a\n\x1b[2Jb " * 100)],
    ids=["no errno", "nothing", "None", "odd strerror"],
)
def test_an_odd_os_error_is_still_one_short_line(error):
    why = disk.reason(error)
    assert why and why.isprintable() and len(why) <= 200


def test_any_failed_write_is_one_line_naming_the_file_and_what_to_do(tmp_path, monkeypatch):
    """Every errno this system has, each under every odd name; one test, failures named by errno."""
    failures = []
    for code in sorted(errno.errorcode):

        def failing_open(*args, code=code, **kwargs):
            raise OSError(code, os.strerror(code))

        monkeypatch.setattr(writer, "open", failing_open, raising=False)
        for name in ODD_NAMES:
            path = str(tmp_path / name)
            try:
                writer.write_text(Path(path), "{}")
            except ConversionError as e:
                message = str(e)
            else:
                failures.append(f"{errno.errorcode[code]} {name!r}: no ConversionError")
                continue
            why = disk.reason(OSError(code, os.strerror(code)))
            if not (message.isprintable() and message.startswith(path if path.isprintable() else repr(path))):
                failures.append(f"{errno.errorcode[code]} {name!r}: {message!r}")
            elif not (why and f": {why}; " in message and "pick another -o" in message):
                failures.append(f"{errno.errorcode[code]} {name!r}: no reason or remedy in {message!r}")
    assert len(errno.errorcode) > 100 and not failures, "\n".join(failures)


def test_an_unwritable_parent_is_refused_before_any_work(tmp_path, src, monkeypatch):
    # Root writes anywhere, so a non-root user's "no permission" is simulated at os.access.
    parent = tmp_path / "locked"
    parent.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, m, **k: Path(p) != parent and real_access(p, m, **k))
    before = snapshot(tmp_path)
    assert_one_line(run(src, "-o", parent / "out"), "permission denied", str(parent))
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize(
    ("name", "limit"),
    [
        ("tokenizer.json", MAX_TOKENIZER_BYTES),
        ("chat_template.jinja", MAX_SIDE_FILE_BYTES),
        ("tokenizer_config.json", MAX_SIDE_FILE_BYTES),
        ("tokenizer.model", MAX_SIDE_FILE_BYTES),
    ],
)
def test_a_tokenizer_file_the_loader_would_refuse_is_refused_before_writing(tmp_path, src, name, limit):
    with open(src / name, "ab") as f:
        f.truncate(limit + 1)  # sparse
    before = snapshot(tmp_path)
    assert_one_line(run(src, "-o", tmp_path / "out"), name, "larger than")
    assert snapshot(tmp_path) == before


def test_copying_stops_at_the_loaders_limit(tmp_path):
    (tmp_path / "chat_template.jinja").write_bytes(b"x" * 11)
    with pytest.raises(ConversionError, match="larger than"):
        writer.copy_file(tmp_path / "chat_template.jinja", tmp_path / "out.jinja", limit=10)
    assert writer.copy_limit("tokenizer.json") == MAX_TOKENIZER_BYTES
    assert writer.copy_limit("chat_template.jinja") == writer.copy_limit("tokenizer.model") == MAX_SIDE_FILE_BYTES


# --- evaluation ------------------------------------------------------------------------------------

TINY_MACHINE = MachineMemory(1 << 30, 1 << 30, 0, "cpu", None, None)  # all of it headroom: nothing fits


def test_an_evaluation_that_cannot_fit_is_skipped_at_plan_time(tmp_path, src, monkeypatch, caplog):
    monkeypatch.setattr("mlxinfer.models.sizing.machine_memory", lambda: TINY_MACHINE)
    result = CliRunner().invoke(main, ["convert", str(src), "-o", str(tmp_path / "out")])
    monkeypatch.undo()
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    warnings = [r.getMessage() for r in caplog.records if "without the quality report" in r.getMessage()]
    assert len(warnings) == 1 and "at most" in warnings[0] and "--no-eval" in warnings[0], caplog.text
    assert "\n" not in warnings[0] and "use a smaller" not in warnings[0], warnings
    manifest = json.loads((tmp_path / "out" / MANIFEST).read_text())
    assert manifest["quality"] is None and manifest["settings"]["evaluate"] is False
    assert_complete(tmp_path / "out")


def test_a_failed_evaluation_keeps_the_finished_output(tmp_path, src, monkeypatch, caplog):
    plan = plan_conversion(src, tmp_path / "out", ConvertSettings(method="rtn"), force=False)
    assert plan.settings.evaluate  # it fits when planned; then memory runs short before evaluating
    monkeypatch.setattr("mlxinfer.models.sizing.machine_memory", lambda: TINY_MACHINE)
    result = run_conversion(plan, progress=False)
    monkeypatch.undo()
    assert result.quality is None and result.manifest["quality"] is None
    assert any("skipping the quality report" in r.getMessage() for r in caplog.records), caplog.text
    assert_complete(tmp_path / "out")
    assert leftovers(tmp_path) == []
