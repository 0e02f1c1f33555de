"""The package's shape: one-way imports between rooms, and what the wheel installs."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# room -> rooms it must never import
FORBIDDEN = {
    "models": {"ui", "server", "engine", "cache", "api", "bench", "cli", "convert", "quantize"},
    "tokenizer": {"ui", "server", "models", "engine", "cache", "api", "bench", "cli", "convert", "quantize"},
    "cache": {"ui", "server", "engine", "models", "api", "bench", "cli", "convert", "quantize"},
    "engine": {"ui", "server", "api", "bench", "cli", "convert", "quantize"},
    "api": {"ui", "server", "bench", "cli", "convert", "quantize"},
    "server": {"ui", "bench", "cli", "convert", "quantize"},
    "ui": {"bench", "cli", "convert", "quantize"},
    "bench": {"cli", "convert", "quantize"},
    "memory": {"ui", "server", "models", "cache", "engine", "api", "bench", "cli", "convert", "quantize"},
    "display": {"models", "tokenizer", "cache", "memory", "engine", "api", "server", "ui", "bench", "cli", "data"},
    "data": {"ui", "server", "models", "cache", "engine", "api", "bench", "cli", "convert", "quantize"},
    "grammar": {
        "ui",
        "server",
        "models",
        "cache",
        "engine",
        "memory",
        "api",
        "bench",
        "cli",
        "convert",
        "quantize",
        "chat",
    },
    "chat": {"ui", "server", "engine", "cache", "models", "memory", "api", "bench", "cli", "convert", "quantize"},
    "hub": {"ui", "server", "engine", "cache", "api", "bench", "cli", "convert", "quantize"},
}
# File formats are read without knowing a family; the user's model library sits above the models it describes.
FORBIDDEN["formats"] = {"ui", "server", "models", "engine", "cache", "memory", "api", "bench", "cli", "convert"}
FORBIDDEN["formats"] |= {"quantize", "library", "hub", "tokenizer", "distributed", "chat", "grammar"}
FORBIDDEN["library"] = {"ui", "server", "engine", "cache", "api", "bench", "cli", "convert", "quantize", "distributed"}
FORBIDDEN["models"] |= {"library"}
# The client side of the resident server: it talks HTTP to the server, never imports it.
FORBIDDEN["remote"] = {"ui", "server", "bench", "cli", "convert", "quantize"}
# `mlxinfer doctor` reads the machine through the lower rooms; only the CLI uses it.
FORBIDDEN["doctor"] = {"ui", "server", "engine", "cache", "api", "bench", "cli", "convert", "quantize"}
FORBIDDEN["distributed"] = {
    "ui",
    "server",
    "bench",
    "cli",
    "convert",
    "quantize",
}  # serve's ranks (a Model each), plan's split
# Leaf modules that every room may use: they import nothing of ours but errors.
LEAVES = ("untrusted", "disk", "local_server", "blas")
ROOMS = (
    {p.parent.name for p in (ROOT / "mlxinfer").glob("*/__init__.py")}
    | {p.stem for p in (ROOT / "mlxinfer").glob("*.py") if p.stem != "__init__"}
    | {"convert", "quantize"}  # installed under mlxinfer/ from the repository's top level
)
FORBIDDEN.update({leaf: ROOMS - {leaf, "errors"} for leaf in LEAVES})
# A family file builds on the shared decoder and readers only; models/registry.py finds it by its model_type
# (importlib, by name), so no room imports families statically and no circle forms.
FORBIDDEN["families"] = ROOMS - {"families", "models", "formats", "errors", "untrusted"}


def imported_rooms(path: Path) -> set[str]:
    """The top-level parts of mlxinfer (rooms) that a module imports."""
    in_subpackage = path.parent != ROOT / "mlxinfer"
    rooms = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            # `from .x` in a subpackage is a sibling in the same room; `from ..x` leaves it.
            if node.level == 1 and in_subpackage:
                continue
            module = node.module or node.names[0].name
            rooms.add(module.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mlxinfer."):
            rooms.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            rooms |= {a.name.split(".")[1] for a in node.names if a.name.startswith("mlxinfer.")}
    return rooms


def room_of(path: Path) -> str:
    relative = path.relative_to(ROOT / "mlxinfer")
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def test_imports_flow_one_way():
    violations = []
    for path in (ROOT / "mlxinfer").rglob("*.py"):
        room = room_of(path)
        bad = imported_rooms(path) & FORBIDDEN.get(room, set())
        violations += [f"{path.relative_to(ROOT)} imports {b}" for b in sorted(bad)]
    assert not violations


def test_leaf_modules_exist_and_forbid_every_other_room():
    for leaf in LEAVES:
        assert (ROOT / "mlxinfer" / f"{leaf}.py").is_file()
        assert {"models", "cache", "display", "convert"} <= FORBIDDEN[leaf] and "errors" not in FORBIDDEN[leaf]


def test_converter_and_quantizer_stay_out_of_the_runtime_and_ui():
    for folder, banned in (("convert", {"cli", "bench"}), ("quantize", {"cli", "bench", "convert"})):
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text()
            for room in banned:
                assert f"mlxinfer.{room}" not in text and f"from ..{room}" not in text, f"{path} imports {room}"


def test_nothing_imports_a_family_statically():
    folders = [ROOT / "mlxinfer", ROOT / "convert", ROOT / "quantize"]
    modules = [p for folder in folders for p in folder.rglob("*.py") if "families" not in p.parts]
    users = [p for p in modules if "families" in imported_rooms(p)]
    assert not users


def test_every_family_file_is_found_by_its_model_types():
    from mlxinfer.models.gguf_arch import ARCHITECTURES as GGUF
    from mlxinfer.models.gguf_arch import GGUF_FAMILIES
    from mlxinfer.models.registry import ARCHITECTURES, family_module

    for path in sorted((ROOT / "mlxinfer" / "families").glob("[!_]*.py")):
        module = importlib.import_module(f"mlxinfer.families.{path.stem}")
        assert module.SPECS, f"{path.name} holds no registry row"
        for model_type, spec in module.SPECS.items():
            where = f"{model_type} is in {path.name}: add it to models/registry.py's SHARED_FILES"
            assert family_module(model_type) == module.__name__, where
            assert ARCHITECTURES[model_type] is spec
        for name, conventions in getattr(module, "GGUF", {}).items():  # llama.cpp's architecture names
            assert family_module(GGUF_FAMILIES[name]) == module.__name__ and GGUF[name] is conventions


def test_nothing_imports_the_cli():
    users = [p for p in (ROOT / "mlxinfer").rglob("*.py") if room_of(p) != "cli" and "cli" in imported_rooms(p)]
    assert not users


@pytest.mark.slow
def test_wheel_installs_convert_and_quantize_under_mlxinfer(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
    )
    names = zipfile.ZipFile(next(tmp_path.glob("mlxinfer-*.whl"))).namelist()
    top_level = {n.split("/")[0] for n in names if not n.startswith("mlxinfer-")}
    assert top_level == {"mlxinfer"}
    assert "mlxinfer/convert/__init__.py" in names and "mlxinfer/quantize/__init__.py" in names
    subpackages = {f"mlxinfer/{p.parent.name}/__init__.py" for p in (ROOT / "mlxinfer").glob("*/__init__.py")}
    assert subpackages <= set(names), f"missing from the wheel: {sorted(subpackages - set(names))}"
    page = {f"mlxinfer/server/page/{p.name}" for p in (ROOT / "mlxinfer" / "server" / "page").iterdir()}
    assert page <= set(names), "the chat page's files must ship in the wheel"
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "mlxinfer = mlxinfer.cli:main" in zipfile.ZipFile(next(tmp_path.glob("*.whl"))).read(entry_points).decode()
