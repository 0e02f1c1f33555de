"""Model management (issue 17): the local model list, `ls` / `rm` / `show`, and `pull` from a stand-in Hub."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
import struct
import threading
from collections import namedtuple
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import gguf
import pytest
from click.testing import CliRunner

import mlxinfer
from mlxinfer import library
from mlxinfer.cli import main
from mlxinfer.library import hf_cache, listing, local_model, show, state
from mlxinfer.server import ServerSettings
from mlxinfer.ui import MenubarController
from tests.conftest import TINY

SOURCE = TINY / "llama_classic"
REPO = "tiny-org/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
Dirs = namedtuple("Dirs", "models cache config hf")


@pytest.fixture(autouse=True)
def dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Dirs:
    """Every folder mlxinfer and huggingface_hub would use, in tmp_path: the real ones are never touched."""
    made = Dirs(*(tmp_path / name for name in ("models", "cache", "config", "hf")))
    made.models.mkdir()
    for key, path in zip(("MLXINFER_MODELS_DIR", "MLXINFER_CACHE_DIR", "MLXINFER_CONFIG_DIR", "HF_HUB_CACHE"), made):
        monkeypatch.setenv(key, str(path))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    return made


def run(*args: str, input: str | None = None):
    return CliRunner().invoke(main, list(args), input=input)


def source_files() -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in SOURCE.iterdir() if p.name != "golden.safetensors"}


# -- a stand-in for the Hub ----------------------------------------------------------------------


class FakeHub:
    """Serves one repository's listing and files, with Range, and records what was asked."""

    def __init__(self, files: dict[str, bytes], extra_names: tuple[str, ...] = ()):
        self.files, self.extra_names = files, extra_names
        self.requests: list[tuple[str, str | None]] = []  # (path, Range header)
        self.cut_after: dict[str, int] = {}  # file -> bytes sent before the connection drops (once)
        self.ignore_range = False
        self.repo, self.commit = REPO, COMMIT  # the repository served, and the commit its listing names
        self.blob_ids = True  # list the git blob id of each file not in LFS, as the Hub's ?blobs=true does
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                hub.requests.append((self.path, self.headers.get("Range")))
                if self.path.startswith(f"/api/models/{hub.repo}/revision/"):
                    return self._send(200, json.dumps(hub.listing()).encode())
                prefix = f"/{hub.repo}/resolve/{hub.commit}/"
                name = self.path[len(prefix) :] if self.path.startswith(prefix) else None
                if name not in hub.files:
                    return self._send(404, b"not found")
                self._file(name, hub.files[name])

            def _file(self, name: str, body: bytes) -> None:
                start, end = 0, len(body) - 1
                ranged = self.headers.get("Range") and not hub.ignore_range
                if ranged:
                    first, _, last = self.headers["Range"].removeprefix("bytes=").partition("-")
                    start, end = int(first), min(int(last) if last else end, end)
                self.send_response(206 if ranged else 200)
                if ranged:
                    self.send_header("Content-Range", f"bytes {start}-{end}/{len(body)}")
                self.send_header("Content-Length", str(end - start + 1))
                self.end_headers()
                cut = None if self.headers.get("Range") else hub.cut_after.pop(name, None)  # a first, whole GET
                self.wfile.write(body[start : end + 1] if cut is None else body[start : start + cut])

            def _send(self, code: int, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def listing(self) -> dict:
        siblings = [{"rfilename": name, "size": len(body)} for name, body in self.files.items()]
        for entry in siblings:
            body = self.files[entry["rfilename"]]
            if entry["rfilename"].endswith(".safetensors"):
                entry["lfs"] = {"sha256": hashlib.sha256(body).hexdigest(), "size": len(body), "pointerSize": 134}
                entry["blobId"] = hashlib.sha1(b"pointer file").hexdigest()  # an LFS file's: its pointer's
            elif self.blob_ids:
                entry["blobId"] = git_blob_id(body)
        siblings += [{"rfilename": name, "size": 1} for name in self.extra_names]
        return {"id": self.repo, "sha": self.commit, "siblings": siblings}

    def weight_requests(self) -> list[str | None]:
        """The Range header of every request for the weights (None: the whole file)."""
        return [rng for path, rng in self.requests if path.endswith("/model.safetensors")]


def git_blob_id(body: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(body) + body).hexdigest()


def downloads(dirs: Dirs, commit: str = COMMIT) -> Path:
    return dirs.cache / "downloads" / "tiny-org--tiny-llama" / commit


@pytest.fixture
def hub_for(monkeypatch: pytest.MonkeyPatch):
    made: list[FakeHub] = []

    def make(files: dict[str, bytes] | None = None, extra_names: tuple[str, ...] = ()) -> FakeHub:
        made.append(FakeHub(source_files() if files is None else files, extra_names))
        monkeypatch.setenv("HF_ENDPOINT", made[-1].url)
        return made[-1]

    yield make
    for hub in made:
        hub.server.shutdown()
        hub.server.server_close()


def assert_same_as_source(folder: Path) -> None:
    assert sorted(p.name for p in folder.iterdir()) == sorted(source_files())
    for name, body in source_files().items():
        assert (folder / name).read_bytes() == body, name


# -- pull ----------------------------------------------------------------------------------------


def test_pull_checks_then_downloads_into_the_models_dir(hub_for, dirs):
    hub = hub_for({**source_files(), "pytorch_model.bin": b"pickle", "README.md": b"# hi"})
    result = run("pull", REPO, "--yes")
    assert result.exit_code == 0, result.output
    assert "llama (verified)" in result.output and "parameters" in result.output and "memory" in result.output
    assert_same_as_source(dirs.models / "tiny-llama")
    assert not any(path.endswith((".bin", "README.md")) for path, _ in hub.requests)  # never fetched
    assert not (dirs.cache / "downloads" / "tiny-org--tiny-llama").exists()  # moved, not copied
    assert run("pull", REPO, "--yes").exit_code == 1  # the folder exists: refused without --force
    assert run("pull", REPO, "--yes", "--force").exit_code == 0


def test_an_interrupted_pull_resumes_from_the_part_file(hub_for, dirs):
    hub = hub_for()
    hub.cut_after["model.safetensors"] = 100_000
    first = run("pull", REPO, "--yes")
    assert first.exit_code == 1 and "run the same `mlxinfer pull` again to resume" in first.output
    part = downloads(dirs) / "model.safetensors.part"
    assert part.stat().st_size == 100_000
    second = run("pull", REPO, "--yes")
    assert second.exit_code == 0, second.output
    assert hub.weight_requests()[-1] == "bytes=100000-"
    assert_same_as_source(dirs.models / "tiny-llama")


def test_a_server_that_ignores_range_restarts_the_file(hub_for, dirs):
    hub = hub_for()
    hub.ignore_range = True
    folder = downloads(dirs)
    folder.mkdir(parents=True)
    (folder / "model.safetensors.part").write_bytes(b"\xff" * 5000)  # not the file's start: appending would break it
    result = run("pull", REPO, "--yes")
    assert result.exit_code == 0, result.output
    assert hub.weight_requests()[-1] == "bytes=5000-"
    assert_same_as_source(dirs.models / "tiny-llama")


def test_a_pickle_only_repository_is_refused(hub_for, dirs):
    hub = hub_for({"config.json": source_files()["config.json"], "pytorch_model.bin": b"x" * 100})
    result = run("pull", REPO, "--yes")
    assert result.exit_code == 1 and "pickle checkpoints are never loaded" in result.output
    assert not any("/resolve/" in path for path, _ in hub.requests)
    assert not (dirs.cache / "downloads").exists()


def corrupt_length(weights: bytes) -> bytes:
    return struct.pack("<Q", 1 << 40) + weights[8:]


def corrupt_span(weights: bytes) -> bytes:
    (length,) = struct.unpack("<Q", weights[:8])
    header = weights[8 : 8 + length]
    assert b'"dtype":"F32"' in header
    # Same header length, but one tensor now claims half the bytes its span holds.
    return weights[:8] + header.replace(b'"dtype":"F32"', b'"dtype":"F16"', 1) + weights[8 + length :]


@pytest.mark.slow
@pytest.mark.parametrize("damage", [corrupt_length, corrupt_span])
def test_a_damaged_safetensors_header_is_refused_before_any_weights_download(hub_for, dirs, damage):
    files = source_files()
    files["model.safetensors"] = damage(files["model.safetensors"])
    hub = hub_for(files)
    result = run("pull", REPO, "--yes")
    assert result.exit_code == 1 and "model.safetensors" in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1 and "refused" in result.output  # one line, before the plan
    # Only the header was asked for (huggingface_hub's parse_safetensors_file_metadata: its first 100,001 bytes, then
    # the rest of a longer header), never the weights.
    assert all(rng and re.fullmatch(r"bytes=(0|8)-[0-9]+", rng) for rng in hub.weight_requests()), hub.requests
    assert not (dirs.cache / "downloads").exists() and not list(dirs.models.iterdir())


def test_not_enough_disk_space_is_refused_with_nothing_written(hub_for, dirs, monkeypatch):
    hub_for()
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr("mlxinfer.hub.pull.shutil.disk_usage", lambda path: usage(10**9, 10**9 - 1000, 1000))
    result = run("pull", REPO, "--yes")
    assert result.exit_code == 1 and "is free" in result.output and "needs" in result.output
    assert not (dirs.cache / "downloads").exists() and not list(dirs.models.iterdir())


@pytest.mark.slow
@pytest.mark.parametrize("name", ["../x", "/etc/passwd", "a/../../x"])
def test_a_hostile_file_name_in_the_listing_is_refused(hub_for, dirs, name):
    hub_for(extra_names=(name,))
    result = run("pull", REPO, "--yes")
    assert result.exit_code == 1 and "not a safe file name" in result.output
    assert not (dirs.cache / "downloads").exists() and not (dirs.cache.parent / "x").exists()


def test_pull_bits_4_converts_into_a_model_that_loads_and_generates(hub_for, dirs):
    hub_for()
    result = run("pull", REPO, "--bits", "4", "--yes")
    assert result.exit_code == 0, result.output
    out = dirs.models / "tiny-llama-4bit"
    assert json.loads((out / "config.json").read_text())["quantization"]["bits"] == 4
    assert not downloads(dirs).exists()  # the download was deleted
    model = mlxinfer.load(out)
    assert model.generate("Hello", max_tokens=4, chat=False).stats.generated_tokens > 0


@pytest.mark.parametrize(
    "repo", ["tiny-org/.", "tiny-org/..", "./x", "../x", "a/.x", "a/x.", "a/-x", "a/x-", "a/x--y", "a/x..y",
             "a/x y", "a/", "/a", "a/b/c", "a", "a/" + "x" * 97, "a/x\u00e9"],
)  # fmt: skip
def test_a_repo_id_that_is_not_a_plain_folder_name_is_refused(repo):
    from mlxinfer.errors import HubError
    from mlxinfer.hub.repo import check_repo_id

    with pytest.raises(HubError, match="not a Hub model id"):
        check_repo_id(repo)


def test_hub_style_repo_ids_are_accepted():
    from mlxinfer.hub.repo import check_repo_id

    for repo in ("HuggingFaceTB/SmolLM2-135M-Instruct", "Qwen/Qwen3-0.6B", "a/b_c", "_x/y_", "o/" + "x" * 96):
        assert check_repo_id(repo) == repo


@pytest.mark.slow
@pytest.mark.parametrize("name", [".", ".."])
def test_pull_of_a_dot_name_with_force_never_touches_the_models_dir(hub_for, dirs, name):
    hub = hub_for()
    hub.repo = f"tiny-org/{name}"  # the stand-in answers for it, as a hostile endpoint could
    shutil.copytree(SOURCE, dirs.models / "keep")
    for args in (("--force",), ("--force", "--bits", "4")):
        result = run("pull", hub.repo, "--yes", *args)
        assert result.exit_code == 1 and "not a Hub model id" in result.output, result.output
    assert (dirs.models / "keep" / "config.json").is_file() and dirs.models.is_dir()
    assert not any("/resolve/" in path for path, _ in hub.requests)


def test_pull_targets_only_a_folder_named_after_the_repo_in_the_models_dir(hub_for, dirs, tmp_path):
    import dataclasses

    from mlxinfer.errors import HubError
    from mlxinfer.hub import download, finish, plan_pull

    hub_for()
    (dirs.models / "keep").mkdir()
    for target in (dirs.models, dirs.models / ".", dirs.models / "..", dirs.models / "keep", tmp_path / "tiny-llama"):
        with pytest.raises(HubError, match="refused"):
            plan_pull(REPO, target=target, force=True)
    assert plan_pull(REPO, target=dirs.models / "tiny-llama-4bit").target.name == "tiny-llama-4bit"
    plan = plan_pull(REPO, force=True)
    download(plan, progress=False)
    for target in (dirs.models, tmp_path, dirs.models / "keep"):  # changed after the plan: checked before deleting
        with pytest.raises(HubError, match="refused"):
            finish(dataclasses.replace(plan, target=target))
    assert (dirs.models / "keep").is_dir() and tmp_path.is_dir()
    assert finish(plan) == dirs.models / "tiny-llama"
    assert_same_as_source(dirs.models / "tiny-llama")
    assert not (dirs.cache / "downloads" / "tiny-org--tiny-llama").exists()


OTHER_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"


def weights_last(files: dict[str, bytes]) -> dict[str, bytes]:
    """The files in the order the listing gives them: the side files first, so a cut weights download leaves them."""
    return dict(sorted(files.items(), key=lambda kv: kv[0].endswith(".safetensors")))


def other_commit_files() -> dict[str, bytes]:
    """The same repository at a later commit: config.json and the weights changed, each keeping its size."""
    files = weights_last(source_files())
    files["config.json"] = files["config.json"].replace(b'"initializer_range": 0.2', b'"initializer_range": 0.3')
    files["model.safetensors"] = files["model.safetensors"][:-4] + bytes(4)
    assert files["model.safetensors"] != source_files()["model.safetensors"]
    return files


@pytest.mark.slow
@pytest.mark.parametrize("blob_ids", [True, False])
def test_a_resume_after_a_new_commit_never_mixes_the_two(hub_for, dirs, blob_ids):
    hub = hub_for(weights_last(source_files()))
    hub.blob_ids = blob_ids
    hub.cut_after["model.safetensors"] = 100_000
    assert run("pull", REPO, "--yes").exit_code == 1  # config.json and the others finished, the weights not
    assert (downloads(dirs) / "config.json").read_bytes() == source_files()["config.json"]
    hub.files, hub.commit = other_commit_files(), OTHER_COMMIT  # pushed meanwhile
    result = run("pull", REPO, "--yes")
    assert result.exit_code == 0, result.output
    assert hub.weight_requests()[-1] is None  # the first commit's .part was not continued
    for name, body in other_commit_files().items():
        assert (dirs.models / "tiny-llama" / name).read_bytes() == body, name
    assert not (dirs.cache / "downloads" / "tiny-org--tiny-llama").exists()  # the old commit's folder too


@pytest.mark.slow
@pytest.mark.parametrize("blob_ids", [True, False])
def test_a_damaged_leftover_side_file_is_downloaded_again(hub_for, dirs, blob_ids):
    hub = hub_for(weights_last(source_files()))
    hub.blob_ids = blob_ids
    hub.cut_after["model.safetensors"] = 100_000
    assert run("pull", REPO, "--yes").exit_code == 1
    leftover = downloads(dirs) / "config.json"
    leftover.write_bytes(other_commit_files()["config.json"])  # same size, other bytes
    result = run("pull", REPO, "--yes")
    assert result.exit_code == 0, result.output
    assert_same_as_source(dirs.models / "tiny-llama")


def test_a_side_file_that_differs_from_its_git_blob_id_is_refused(hub_for, dirs):
    hub = hub_for()
    listing = hub.listing
    hub.listing = lambda: {
        **listing(),
        "siblings": [
            {**e, "blobId": "0" * 40} if e["rfilename"] == "tokenizer.json" else e for e in listing()["siblings"]
        ],
    }
    result = run("pull", REPO, "--yes")
    assert result.exit_code == 1 and "tokenizer.json: its git blob id differs" in result.output, result.output
    assert not (downloads(dirs) / "tokenizer.json").exists() and not list(dirs.models.iterdir())


NOT_LISTED = shutil.ignore_patterns("golden.safetensors")  # in the fixture, not in the repository


def test_convert_of_a_hub_id_downloads_into_the_cache_a_later_pull_uses(hub_for, dirs, monkeypatch):
    from mlxinfer.convert import convert

    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    hub = hub_for()
    convert(REPO, dirs.config / "tiny-8bit", bits=8, group_size=32, evaluate=False, progress=False)
    assert_same_as_source(downloads(dirs))  # checked and kept in the one download cache
    assert not dirs.hf.exists()  # the Hugging Face cache is read, never written
    asked = len(hub.weight_requests())
    assert run("pull", REPO, "--yes").exit_code == 0
    assert None not in hub.weight_requests()[asked:]  # the pull read the headers only: the weights were there
    assert_same_as_source(dirs.models / "tiny-llama")


def test_convert_of_a_hub_id_uses_a_complete_copy_in_the_hf_cache(hub_for, dirs, monkeypatch):
    from mlxinfer.convert import convert

    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    hub = hub_for()
    shutil.copytree(SOURCE, dirs.hf / "models--tiny-org--tiny-llama" / "snapshots" / COMMIT, ignore=NOT_LISTED)
    convert(REPO, dirs.config / "tiny-8bit", bits=8, group_size=32, evaluate=False, progress=False)
    assert None not in hub.weight_requests() and not (dirs.cache / "downloads").exists()


def test_pull_copies_checked_files_from_the_hf_cache_and_downloads_a_damaged_one(hub_for, dirs):
    hub = hub_for()
    snapshot = dirs.hf / "models--tiny-org--tiny-llama" / "snapshots" / COMMIT
    shutil.copytree(SOURCE, snapshot, ignore=NOT_LISTED)
    config = snapshot / "config.json"
    config.write_bytes(config.read_bytes().replace(b'"initializer_range": 0.2', b'"initializer_range": 0.3'))
    result = run("pull", REPO, "--yes")
    assert result.exit_code == 0, result.output
    assert_same_as_source(dirs.models / "tiny-llama")
    assert None not in hub.weight_requests()  # the weights came from the Hugging Face cache, checked
    fetched = [path for path, rng in hub.requests if "/resolve/" in path and rng is None]
    assert fetched == [f"/{REPO}/resolve/{COMMIT}/config.json"] * 2  # plan_pull's read, then the damaged copy's


# -- ls / rm / show -------------------------------------------------------------------------------


def tiny_gguf(path: Path, arch: str = "llama", file_type: int = 7) -> Path:
    """A GGUF header with general.architecture and general.file_type (Q8_0) and no tensors."""

    def string(text: str) -> bytes:
        return struct.pack("<Q", len(text)) + text.encode()

    keys = string("general.architecture") + struct.pack("<I", 8) + string(arch)
    keys += string("general.languages") + struct.pack("<IIQ", 9, 8, 1) + string("en")
    keys += string("general.file_type") + struct.pack("<II", 4, file_type)
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 3) + keys)
    return path


def hf_cache_entry(hf: Path, repo: str = "org/tiny") -> Path:
    """A Hugging Face cache entry laid out as huggingface_hub writes it: blobs, a snapshot of links, refs/main."""
    root = hf / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (root / "blobs").mkdir()
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(COMMIT)
    for name, body in source_files().items():
        blob = root / "blobs" / hashlib.sha256(body).hexdigest()
        blob.write_bytes(body)
        (snapshot / name).symlink_to(blob)
    return snapshot


def test_ls_lists_family_support_bits_and_size(dirs):
    shutil.copytree(SOURCE, dirs.models / "llama_classic", ignore=shutil.ignore_patterns("golden.safetensors"))
    tiny_gguf(dirs.models / "small.Q8_0.gguf")
    result = run("ls")
    assert result.exit_code == 0, result.output
    row = next(line for line in result.output.splitlines() if line.startswith("llama_classic"))
    assert row.split()[1:4] == ["llama", "verified", "32"] and "MiB" in row
    gguf_row = next(line for line in result.output.splitlines() if line.startswith("small.Q8_0"))
    assert gguf_row.split()[1:4] == ["llama", "verified", "8"]
    listed = {m["name"]: m for m in json.loads(run("ls", "--json").output)}
    assert listed["llama_classic"]["size_bytes"] == sum(len(b) for b in source_files().values())
    assert listed["llama_classic"]["source"] == "models dir" and listed["small.Q8_0"]["bits"] == 8


def test_rm_asks_first_and_no_keeps_the_model(dirs):
    shutil.copytree(SOURCE, dirs.models / "llama_classic")
    no = run("rm", "llama_classic", input="n\n")
    assert no.exit_code == 0 and "Delete llama_classic (" in no.output and "[y/N]" in no.output
    assert (dirs.models / "llama_classic" / "config.json").is_file()
    yes = run("rm", "llama_classic", input="y\n")
    assert yes.exit_code == 0 and not (dirs.models / "llama_classic").exists()
    unknown = run("rm", "llama_classic", "--yes")
    assert unknown.exit_code == 1 and "`mlxinfer ls` lists the names" in unknown.output


def test_rm_of_an_added_gguf_unregisters_it_and_keeps_the_file(dirs, tmp_path):
    gguf = tiny_gguf(tmp_path / "mine.gguf")
    added = run("ls", "--add", str(gguf))
    assert added.exit_code == 0 and "mine" in added.output
    assert library.find_model("mine").source == "added"
    result = run("rm", "mine", "--yes")
    assert result.exit_code == 0 and "unregistered mine" in result.output
    assert gguf.read_bytes()[:4] == b"GGUF" and library.find_model("mine") is None
    assert run("ls", "--add", str(tmp_path)).exit_code == 1  # a folder without a model is refused


def test_show_prints_the_config_summary_and_the_memory_plan(dirs):
    shutil.copytree(SOURCE, dirs.models / "llama_classic")
    result = run("show", "llama_classic")
    assert result.exit_code == 0, result.output
    for expected in ("layers        2", "hidden size   64", "context       256", "vocab size    272", "verdict:"):
        assert expected in result.output
    assert "chat template yes" in result.output and "<|im_start|>" in result.output
    info = json.loads(run("show", "llama_classic", "--json").output)
    assert info["layers"] == 2 and info["memory_plan"]["verdict"] in ("fits", "fits but risks swap", "does not fit")
    assert info["memory_plan"]["weights_bytes"] > 0


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q3_K"])
def test_show_gives_a_k_quant_file_the_group_size_it_is_held_at(dirs, kind):
    from tests.test_gguf import write_tiny_gguf

    qtype, file_type = (
        gguf.GGMLQuantizationType[kind],
        gguf.LlamaFileType[f"MOSTLY_{kind}_M" if kind != "Q6_K" else "MOSTLY_Q6_K"],
    )
    name = "model.layers.0.mlp.down_proj.weight"
    path = write_tiny_gguf(dirs.models / "kq.gguf", k_quant=name, hidden=256, k_type=qtype, file_type=file_type)
    layer = mlxinfer.load(path, dtype="float32")._loaded.model.model.layers[0].mlp.down_proj  # the reference
    info = json.loads(run("show", "kq", "--json").output)
    assert (
        info["quantization"]["group_size"] == layer.group_size
        and info["quantization"]["mode"] == f"gguf {file_type.name}"
    )


def test_a_corrupt_registry_warns_and_the_listing_goes_on(dirs, caplog):
    shutil.copytree(SOURCE, dirs.models / "llama_classic")
    dirs.config.mkdir()
    (dirs.config / "models.json").write_text("{not json")
    with caplog.at_level(logging.WARNING):
        result = run("ls")
    assert result.exit_code == 0 and "llama_classic" in result.output
    assert any("models.json" in r.getMessage() and "not valid JSON" in r.getMessage() for r in caplog.records)


def test_hf_cache_models_are_listed_and_removed_through_huggingface_hub(dirs):
    snapshot = hf_cache_entry(dirs.hf)
    model = library.find_model("org/tiny")
    assert model is not None and model.source == "hf cache" and model.path == snapshot and model.family == "llama"
    assert model.size_bytes == sum(len(b) for b in source_files().values())  # the links' targets count
    result = run("rm", "org/tiny", "--yes")
    assert result.exit_code == 0 and not (dirs.hf / "models--org--tiny").exists()


def test_record_use_is_shown_and_bounded(dirs, monkeypatch):
    shutil.copytree(SOURCE, dirs.models / "llama_classic")
    monkeypatch.setattr(state, "MAX_USES", 3)
    for i in range(5):
        library.record_use(dirs.models / f"other{i}")
    library.record_use(dirs.models / "llama_classic")
    assert len(json.loads((dirs.cache / state.USES_FILE).read_text())) == 3
    assert library.find_model("llama_classic").last_used is not None
    assert "never" not in next(line for line in run("ls").output.splitlines() if line.startswith("llama_classic"))


# -- the menubar's Switch Model list ----------------------------------------------------------------


def test_switch_model_offers_hf_cache_and_added_models(dirs, tmp_path):
    snapshot = hf_cache_entry(dirs.hf)
    added = library.add_model(tiny_gguf(tmp_path / "mine.gguf")).path
    own = tmp_path / "own"
    shutil.copytree(SOURCE, own / "llama_classic")
    controller = MenubarController(ServerSettings(port=0), models_dir=own)
    assert controller.available_models() == [own / "llama_classic", snapshot, added]


# -- find_model: what the server asks for each name it has not loaded ----------------------------


def test_find_model_describes_only_the_model_it_finds(dirs, tmp_path, monkeypatch):
    shutil.copytree(SOURCE, dirs.models / "llama_classic")
    tiny_gguf(dirs.models / "small.Q8_0.gguf")
    hf_cache_entry(dirs.hf)
    library.add_model(tiny_gguf(tmp_path / "mine.gguf"))
    everything = library.list_models()
    assert {m.name for m in everything} == {"llama_classic", "small.Q8_0", "org/tiny", "mine"}

    import huggingface_hub

    calls: list[str] = []
    patched = ((listing, "describe"), (local_model, "read_config"), (local_model, "gguf_facts"))
    for module, name in (*patched, (local_model, "disk_bytes"), (hf_cache, "_scan_hf_cache")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    monkeypatch.setattr(huggingface_hub, "scan_cache_dir", lambda *a: calls.append("scan_cache_dir"))
    for unknown in ("nope", "org/nope", "../x", "nope/../../x", "a--b/c", ""):
        assert library.find_model(unknown) is None
    assert calls == []  # no config, GGUF header or size read, no hub cache scan
    for model in everything:
        calls.clear()
        assert library.find_model(model.name) == model
        assert calls.count("describe") == 1 and "_scan_hf_cache" not in calls and "scan_cache_dir" not in calls
        assert len([c for c in calls if c in ("read_config", "gguf_facts")]) == 1


def test_find_model_follows_list_models_for_a_path_listed_twice(dirs, tmp_path):
    snapshot = hf_cache_entry(dirs.hf)
    library.add_model(snapshot)  # listed once: as the hub cache repository, not as an added model
    assert [m.name for m in library.list_models()] == ["org/tiny"]
    assert library.find_model(COMMIT) is None and library.find_model("org/tiny").source == "hf cache"
    shutil.copytree(SOURCE, dirs.models / "b")
    (dirs.models / "a").symlink_to(dirs.models / "b")  # "b" is the path "a" already listed
    assert [m.name for m in library.list_models() if m.source == "models dir"] == ["a"]
    assert library.find_model("b") is None and library.find_model("a").path == dirs.models / "a"


# -- chat_template: the template of a model not loaded ---------------------------------------------


def gguf_with_template(path: Path, template: str | None, tokens: int = 1000) -> Path:
    """A GGUF header whose tokenizer arrays come before tokenizer.chat_template, as llama.cpp writes them."""

    def string(text: str) -> bytes:
        return struct.pack("<Q", len(text.encode())) + text.encode()

    keys = string("general.architecture") + struct.pack("<I", 8) + string("llama")
    keys += string("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, tokens)
    keys += b"".join(string(f"tok{i}") for i in range(tokens))
    keys += string("tokenizer.ggml.scores") + struct.pack("<IIQ", 9, 6, tokens) + bytes(4 * tokens)
    count = 3
    if template is not None:
        keys += string("tokenizer.chat_template") + struct.pack("<I", 8) + string(template)
        count += 1
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, count) + keys)
    return path


def test_chat_template_of_a_folder_and_a_gguf_file(dirs, tmp_path, monkeypatch):
    folder = shutil.copytree(SOURCE, tmp_path / "m")
    expected = json.loads((SOURCE / "tokenizer_config.json").read_text())["chat_template"]
    assert library.chat_template(folder) == expected and "<|im_start|>" in expected
    (folder / "chat_template.jinja").write_text("{{ jinja }}")
    assert library.chat_template(folder) == "{{ jinja }}"
    assert library.chat_template(tmp_path / "empty") is None
    other = tmp_path / "named"
    other.mkdir()
    (other / "chat_template.json").write_text(
        json.dumps({"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]})
    )
    assert library.chat_template(other) == "D"
    assert library.chat_template(gguf_with_template(tmp_path / "t.gguf", "{{ gguf }} é")) == "{{ gguf }} é"
    assert library.chat_template(gguf_with_template(tmp_path / "none.gguf", None)) is None
    assert library.chat_template(tiny_gguf(tmp_path / "tiny.gguf")) is None
    monkeypatch.setattr(show, "MAX_TEMPLATE_BYTES", 8)  # bounded: a larger template is not read
    assert library.chat_template(gguf_with_template(tmp_path / "t.gguf", "x" * 9)) is None
    assert library.chat_template(folder) is None  # the .jinja file is too large


# -- names in every command, and `run` -----------------------------------------------------------------


def test_a_name_from_ls_works_in_generate_and_chat_without_a_server(dirs):
    shutil.copytree(SOURCE, dirs.models / "tiny-chat", ignore=shutil.ignore_patterns("golden.safetensors"))
    assert "tiny-chat" in run("ls").output
    by_name = run("generate", "tiny-chat", "-p", "hi", "--max-tokens", "3", "--local", "--json")
    by_path = run("generate", str(dirs.models / "tiny-chat"), "-p", "hi", "--max-tokens", "3", "--local", "--json")
    assert by_name.exit_code == 0, by_name.output
    assert json.loads(by_name.stdout)["text"] == json.loads(by_path.stdout)["text"]
    chat = run("chat", "tiny-chat", "--max-tokens", "2", "--local", input="hi\n/bye\n")
    assert chat.exit_code == 0 and "Chatting with tiny-chat" in chat.stderr
    assert mlxinfer.load("tiny-chat").path == dirs.models / "tiny-chat"  # the Python API takes the name too


def test_run_pulls_a_hub_id_that_is_not_here_then_chats(hub_for, dirs):
    hub_for()
    result = run("run", REPO, "--yes", "--max-tokens", "2", "--local", input="hi\n/bye\n")
    assert result.exit_code == 0, result.output
    assert f"pulled {REPO} into {dirs.models / 'tiny-llama'}" in result.output
    assert "Chatting with tiny-llama" in result.stderr and "2 generated" in result.stderr
    again = run("run", "tiny-llama", "--max-tokens", "2", "--local", input="hi\n/bye\n")  # here now: no pull
    assert again.exit_code == 0 and "pulled" not in again.output
    missing = run("run", "no-such-model", "--local")
    assert missing.exit_code == 1 and "no-such-model: no model by that name here" in missing.stderr


def test_ollama_pull_streams_progress_into_the_models_folder(hub_for, dirs):
    import ollama

    from mlxinfer.server import ModelSet
    from mlxinfer.server.uvicorn_host import BackgroundServer

    hub = hub_for()
    with BackgroundServer(ModelSet(), ServerSettings(port=0)) as running:
        client = ollama.Client(host=running.url, timeout=120)
        events = list(client.pull(f"hf.co/{REPO}", stream=True))
        assert events[0].status == "pulling manifest" and events[-1].status == "success"
        progress = [e for e in events if e.total]
        assert progress and progress[-1].completed == progress[-1].total == sum(map(len, source_files().values()))
        assert_same_as_source(dirs.models / "tiny-llama")
        asked = len(hub.requests)
        assert client.pull(REPO).status == "success" and len(hub.requests) == asked  # here already: nothing fetched
        with pytest.raises(ollama.ResponseError, match="must be a Hugging Face repository") as refused:
            client.pull("llama3.2")
        assert refused.value.status_code == 400
        with pytest.raises(ollama.ResponseError, match="other-org/none"):  # the Hub has no such repository
            list(client.pull("other-org/none", stream=True))
        from mlxinfer.server.routes import ollama_pull

        ollama_pull._PULLING.add("busy-org/model")  # as while another request pulls it
        try:
            with pytest.raises(ollama.ResponseError, match="is being pulled already") as busy:
                client.pull("busy-org/model")
            assert busy.value.status_code == 409
        finally:
            ollama_pull._PULLING.discard("busy-org/model")
        assert "tiny-llama" in [m.model for m in client.list().models]  # the server goes on and lists the pull
