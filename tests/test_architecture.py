"""The package's shape: one-way imports between rooms, and what the wheel installs."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# room -> rooms it must never import
FORBIDDEN = {
    "models": {"ui", "server", "engine", "cache", "api", "speed", "cli", "convert", "quantize"},
    "tokenizer": {"ui", "server", "models", "engine", "cache", "api", "speed", "cli", "convert", "quantize"},
    "cache": {"ui", "server", "engine", "models", "api", "speed", "cli", "convert", "quantize"},
    "engine": {"ui", "server", "api", "speed", "cli", "convert", "quantize"},
    "api": {"ui", "server", "speed", "cli", "convert", "quantize"},
    "server": {"ui", "speed", "cli", "convert", "quantize"},
    "ui": {"speed", "cli", "convert", "quantize"},
    "speed": {"cli", "convert", "quantize"},
    "memory": {"ui", "server", "models", "cache", "engine", "api", "speed", "cli", "convert", "quantize"},
    "display": {"models", "tokenizer", "cache", "memory", "engine", "api", "server", "ui", "speed", "cli", "data"},
    "data": {"ui", "server", "models", "cache", "engine", "api", "speed", "cli", "convert", "quantize"},
    "grammar": {
        "ui",
        "server",
        "models",
        "cache",
        "engine",
        "memory",
        "api",
        "speed",
        "cli",
        "convert",
        "quantize",
        "chat",
    },
    "chat": {"ui", "server", "engine", "cache", "models", "memory", "api", "speed", "cli", "convert", "quantize"},
    "hub": {"ui", "server", "engine", "cache", "api", "speed", "cli", "convert", "quantize"},
}
# File formats are read without knowing a family; the user's model library sits above the models it describes.
FORBIDDEN["formats"] = {"ui", "server", "models", "engine", "cache", "memory", "api", "speed", "cli", "convert"}
FORBIDDEN["formats"] |= {"quantize", "library", "hub", "tokenizer", "distributed", "chat", "grammar"}
FORBIDDEN["library"] = {"ui", "server", "engine", "cache", "api", "speed", "cli", "convert", "quantize", "distributed"}
FORBIDDEN["models"] |= {"library"}
# Images are read and preprocessed without knowing a model; the towers live in models/, the placing in engine/.
FORBIDDEN["vision"] = {"ui", "server", "models", "engine", "cache", "memory", "api", "speed", "cli", "convert"}
FORBIDDEN["vision"] |= {"quantize", "library", "hub", "tokenizer", "distributed", "chat", "grammar", "formats"}
# The client side of the resident server: it talks HTTP to the server, never imports it.
FORBIDDEN["resident_client"] = {"ui", "server", "speed", "cli", "convert", "quantize"}
# `mlxinfer doctor` reads the machine through the lower rooms; only the CLI uses it.
FORBIDDEN["doctor"] = {"ui", "server", "engine", "cache", "api", "speed", "cli", "convert", "quantize"}
FORBIDDEN["distributed"] = {
    "ui",
    "server",
    "speed",
    "cli",
    "convert",
    "quantize",
}  # serve's ranks (a Model each), plan's split
# Adapters sit on the loaded model (models/), below the engine that picks one per row; they know no request.
FORBIDDEN["adapters"] = {"ui", "server", "engine", "cache", "api", "speed", "cli", "convert", "quantize", "library"}
FORBIDDEN["adapters"] |= {"distributed", "chat", "grammar", "hub", "tokenizer"}
for _room in ("models", "cache", "tokenizer", "formats", "memory", "library", "vision"):
    FORBIDDEN[_room] |= {"adapters"}
# Leaf modules that every room may use: they import nothing of ours but errors.
LEAVES = ("untrusted", "disk", "local_server", "blas", "defaults", "paths")
ROOMS = (
    {p.parent.name for p in (ROOT / "mlxinfer").glob("*/__init__.py")}
    | {p.stem for p in (ROOT / "mlxinfer").glob("*.py") if p.stem != "__init__"}
    | {"convert", "quantize"}  # installed under mlxinfer/ from the repository's top level
)
FORBIDDEN.update({leaf: ROOMS - {leaf, "errors"} for leaf in LEAVES})
# A family file builds on the shared decoder and readers only; models/registry.py finds it by its model_type
# (importlib, by name), so no room imports families statically and no circle forms. A vision-language family also
# reads its image processor (vision/, which knows no model).
FORBIDDEN["families"] = ROOMS - {"families", "models", "formats", "errors", "untrusted", "vision"}


PACKAGES = {"mlxinfer": ROOT / "mlxinfer", "mlxinfer.convert": ROOT / "convert", "mlxinfer.quantize": ROOT / "quantize"}


def modules() -> dict[str, Path]:
    """Every module we ship, by its dotted name (convert/ and quantize/ install under mlxinfer/)."""
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            found[".".join((package, *parts))] = path
    return found


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Import statements anywhere in a module (in functions too: they run), except under `if TYPE_CHECKING:`."""
    imports, stack = [], [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            imports.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return imports


def imported_modules(path: Path, known: dict[str, Path] | None = None) -> set[str]:
    """The modules of ours that the module at `path` imports, by dotted name: `from pkg import sub` counts as the
    submodule where there is one, else as the package (its __init__)."""
    known = known or modules()
    name = next(n for n, p in known.items() if p == path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in _imports(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
            continue
        base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
        target = ".".join([*base, *([node.module] if node.module else [])])
        found |= {_submodule_or_package(target, a.name, known) for a in node.names}
    return found & known.keys()


def _submodule_or_package(package: str, name: str, known: dict[str, Path]) -> str:
    """`from package import name`: the submodule, unless the package's __init__ binds that name itself (the engine's
    `embed` function shadows its `embed` module)."""
    if f"{package}.{name}" not in known:
        return package
    init = ast.parse(known[package].read_text()) if package in known else ast.Module(body=[], type_ignores=[])
    bound = {a.asname or a.name for node in ast.walk(init) if isinstance(node, ast.ImportFrom) for a in node.names}
    return package if name in bound and not any(a == name for a in _submodules_imported(init)) else f"{package}.{name}"


def _submodules_imported(init: ast.Module) -> list[str]:
    """Names an __init__ binds to its own submodules (`from . import x`)."""
    return [
        a.name
        for node in ast.walk(init)
        if isinstance(node, ast.ImportFrom) and node.module is None
        for a in node.names
    ]


def imported_rooms(path: Path) -> set[str]:
    """The top-level parts of mlxinfer (rooms) that a module imports, its own room included."""
    return {name.split(".")[1] for name in imported_modules(path) if name.count(".") >= 1}


def room_of(path: Path) -> str:
    relative = path.relative_to(ROOT / "mlxinfer")
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def test_imports_flow_one_way():
    violations = []
    for path in (ROOT / "mlxinfer").rglob("*.py"):
        room = room_of(path)
        bad = (imported_rooms(path) - {room}) & FORBIDDEN.get(room, set())
        violations += [f"{path.relative_to(ROOT)} imports {b}" for b in sorted(bad)]
    assert not violations


def test_leaf_modules_import_nothing_of_ours_but_errors():
    for leaf in LEAVES:
        path = ROOT / "mlxinfer" / f"{leaf}.py"
        assert imported_rooms(path) - {leaf} <= {"errors"}, f"{leaf}.py imports {imported_rooms(path) - {leaf}}"


def test_converter_and_quantizer_stay_out_of_the_runtime_and_ui():
    for folder, banned in (("convert", {"cli", "speed"}), ("quantize", {"cli", "speed", "convert"})):
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


# -- the house: sizes, circles, side doors ----------------------------------------------------------------------

MAX_MODULE_LINES = 600
MAX_FOLDER_SHARE = 0.16  # of the package's lines, in one folder and the folders under it
MAX_FOLDER_MODULES = 30


def test_no_import_circles():
    """Tarjan's strongly connected components over the module graph: any with two or more modules is a circle."""
    known = modules()
    edges = {name: imported_modules(path, known) - {name} for name, path in known.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in edges[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while (member := stack.pop()) != node:
                component.append(member)
            if component:
                circles.append(sorted([node, *component]))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    assert not circles, "\n".join(" <-> ".join(c) for c in circles)


def test_no_module_is_over_600_lines():
    long = {
        str(p.relative_to(ROOT)): n
        for p in modules().values()
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"split these by job: {long}"


def test_no_folder_holds_too_much():
    lines = {p: len(p.read_text().splitlines()) for p in (ROOT / "mlxinfer").rglob("*.py")}
    total = sum(lines.values())
    rooms = [p for p in (ROOT / "mlxinfer").rglob("*") if p.is_dir() and (p / "__init__.py").exists()]
    for room in rooms:
        share = sum(n for p, n in lines.items() if room in p.parents) / total
        assert share <= MAX_FOLDER_SHARE, f"{room.relative_to(ROOT)} holds {share:.0%} of the lines"
        count = len(list(room.glob("*.py")))
        assert count <= MAX_FOLDER_MODULES, f"{room.relative_to(ROOT)} holds {count} modules"


# Rooms whose __init__ is their whole face: other rooms import its names from the package, never a module inside,
# so a room can move its modules around without touching anyone else. (The issue asked it of the engine; the
# others already keep it.)
SEALED_ROOMS = ("engine", "chat", "grammar", "hub", "library")


def test_nothing_imports_past_a_sealed_rooms_init():
    known = modules()
    side_doors = [
        f"{name} imports {target}"
        for name, path in known.items()
        for target in imported_modules(path, known)
        for room in SEALED_ROOMS
        if target.startswith(f"mlxinfer.{room}.") and not name.startswith(f"mlxinfer.{room}")
    ]
    assert not side_doors, "import these from the room's package:\n" + "\n".join(sorted(side_doors))


def test_the_hub_code_makes_no_http_calls_of_its_own():
    """huggingface_hub makes every Hub request (listing, headers, downloads); hub/transport.py only sets the rules
    below it (its client factory: a stall limit, size limits, no https downgrade) and sends nothing itself."""
    imports = ("import urllib.request", "import http.client", "import socket", "import requests", "import httpx")
    calls = re.compile(r"\.(stream|send|request|post|head)\(|get_session\(|urlopen\(|create_connection\(")
    for path in (ROOT / "mlxinfer" / "hub").rglob("*.py"):
        text = path.read_text()
        found = [name for name in imports if name in text and path.name != "transport.py"]
        found += [call.group() for call in calls.finditer(text)]
        assert not found, f"{path.relative_to(ROOT)} makes HTTP calls of its own: {found}"
    assert "set_client_factory(client)" in (ROOT / "mlxinfer" / "hub" / "transport.py").read_text()


def test_one_module_parses_gguf_headers():
    """formats/gguf_file.py is the one reader: nothing else checks the magic or uses the gguf package's reader."""
    files = [*modules().values(), *(ROOT / "bench").rglob("*.py"), *(ROOT / "bench").rglob("*.sh")]
    signs = (b'b"GGUF"', b"b'GGUF'", b"GGUFReader", b"0x46554747")
    readers = [p.relative_to(ROOT) for p in files if any(sign in p.read_bytes() for sign in signs)]
    assert readers == [Path("mlxinfer/formats/gguf_file.py")]


@pytest.mark.slow
def test_importing_the_runtime_or_the_converter_never_imports_mlx_lm_or_transformers():
    # mlx-lm's package imports transformers (about 200 MB of a process): the converter's memory forecasts and a
    # server's footprint assume neither is there until a model that needs mlx-lm's code is built.
    code = "import sys, mlxinfer.api, mlxinfer.server, mlxinfer.convert, mlxinfer.cli; "
    code += "print(sorted(m for m in ('mlx_lm', 'transformers', 'torch') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
