"""When and how OpenBLAS is routed in: not at import, at the first CPU load, and only through jump slots.

The relocation rules are tested on copies of the real libmlx.so with one relocation entry or one symbol name
changed in place, so the parser reads the same file layout the router meets in the process.
"""

from __future__ import annotations

import json
import logging
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mlxinfer import blas

from .conftest import TINY

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="OpenBLAS is routed in on Linux only")

FIRST_LOAD = """
import json
import mlx.core as mx
import mlxinfer
from mlxinfer import blas
from mlxinfer.models import load_model

imported = any(blas.routed_slots().values())  # read back from libmlx's GOT
mx.set_default_device(mx.cpu)
load_model({path!r})
print(json.dumps([imported, blas.routed()]))
"""


def test_importing_mlxinfer_leaves_libmlx_alone_and_the_first_cpu_load_routes():
    code = textwrap.dedent(FIRST_LOAD.format(path=str(TINY / "llama_classic")))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == [False, True]


def _libmlx_copy(tmp_path: Path) -> Path:
    copy = tmp_path / "libmlx.so"  # the same name: messages name the file
    shutil.copyfile(blas._loaded_libmlx(), copy)
    return copy


def _elf(path: Path):
    from elftools.elf.elffile import ELFFile

    f = open(path, "rb")  # noqa: SIM115 - pyelftools reads lazily: closed by the caller
    elf = ELFFile(f)
    assert elf.elfclass == 64 and elf.little_endian  # the layouts patched below (x86_64 and aarch64 wheels)
    return f, elf


def _relocation_of(path: Path, name: str) -> tuple[int, int]:
    """(file offset of `name`'s first relocation entry, its symbol's st_name)."""
    from elftools.elf.relocation import RelocationSection

    f, elf = _elf(path)
    with f:
        for section in elf.iter_sections():
            if not isinstance(section, RelocationSection) or not section["sh_link"]:
                continue
            symbols = elf.get_section(section["sh_link"])
            for i, relocation in enumerate(section.iter_relocations()):
                symbol = symbols.get_symbol(relocation["r_info_sym"])
                if symbol.name == name:
                    return section["sh_offset"] + i * section["sh_entsize"], symbol["st_name"]
    raise AssertionError(f"{name} has no relocation in {path}")


def _patch(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_a_gemm_reached_through_another_relocation_type_is_refused(tmp_path):
    copy = _libmlx_copy(tmp_path)
    entry, _ = _relocation_of(copy, "cblas_sgemm")
    _patch(copy, entry + 8, struct.pack("<I", 0))  # Elf64_Rela.r_info's low half: the type, now R_*_NONE
    with pytest.raises(ValueError, match=r"libmlx.so reaches cblas_sgemm through R_\w+_NONE, not one R_\w+_JUMP_SLOT"):
        blas._jump_slots(copy, blas.GEMMS)


def _rename_an_import(copy: Path, new_name: str) -> None:
    """Give some non-BLAS function libmlx.so calls through its PLT the name `new_name`, in its string table."""
    f, elf = _elf(copy)
    with f:
        plt = next(s for s in elf.iter_sections() if s.name == ".rela.plt")
        symbols, strings = elf.get_section(plt["sh_link"]), elf.get_section_by_name(".dynstr")
        names = (symbols.get_symbol(r["r_info_sym"]).name for r in plt.iter_relocations())
        victim = next(n for n in names if len(n) >= len(new_name) and not n.startswith("cblas_"))
    _, st_name = _relocation_of(copy, victim)
    _patch(copy, strings["sh_offset"] + st_name, new_name.encode() + b"\0")


def test_an_unknown_cblas_import_is_logged_once_and_the_gemms_still_route(tmp_path, caplog):
    copy = _libmlx_copy(tmp_path)
    _rename_an_import(copy, "cblas_sgemv")
    blas._warn_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger=blas.__name__):
        for _ in range(2):
            assert set(blas._jump_slots(copy, blas.GEMMS)) == set(blas.GEMMS)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "libmlx.so also calls cblas_sgemv, which mlxinfer does not route" in warnings[0]
    assert "\n" not in warnings[0]


def test_the_real_libmlx_calls_each_gemm_through_one_jump_slot():
    slots = blas._jump_slots(blas._loaded_libmlx(), blas.GEMMS)
    assert set(slots) == set(blas.GEMMS) and len(set(slots.values())) == len(blas.GEMMS)
