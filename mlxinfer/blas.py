"""A fast BLAS for MLX's CPU backend on Linux, with nothing for the user to do.

Linux wheels of `mlx[cpu]` link the reference BLAS (netlib): float32 matmul runs at about 2.3 GFLOP/s on
a 2-core test machine, where OpenBLAS does about 190 on the same cores. PyPI's small OpenBLAS wheel
(`scipy-openblas32`, 8 MB) exports its functions with a `scipy_` prefix, so neither loading it first nor
LD_PRELOAD can stand in for `cblas_sgemm` (the unprefixed alternative, MKL, is 700 MB installed). What works
without a compiler: once libmlx.so is loaded, point its own import slots for cblas_sgemm / dgemm / cgemm
(their GOT entries, found from the file's relocations) at OpenBLAS's functions, which take the same arguments.

The swap is process-wide (any other MLX user in the process gets it too), so importing mlxinfer does not do it:
activate() runs at the first model load on the CPU (models/loader.py), or when `mlxinfer doctor` or a benchmark
asks. Every step is checked: each GEMM must be reached through exactly one relocation, of this machine's
jump-slot type; the float32, float64 and complex64 products must match numpy's, and the float32 probe must run
faster than the reference did; otherwise every swapped slot is put back and one line says why. A `cblas_*`
import that is not routed (a newer MLX calling more of the BLAS) is logged once. An MLX whose BLAS is already
fast is left alone. macOS (Accelerate) and other systems are left alone. MLXINFER_BLAS=reference opts out.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

import mlx.core as mx
import numpy as np

GEMMS = ("cblas_sgemm", "cblas_dgemm", "cblas_cgemm")  # everything libmlx.so calls in a BLAS (MLX 0.32)
# The relocation a call through the PLT reads its target from, per machine MLX has Linux wheels for.
JUMP_SLOTS = {"EM_X86_64": "R_X86_64_JUMP_SLOT", "EM_AARCH64": "R_AARCH64_JUMP_SLOT"}
PROBE_N = 256  # 34 MFLOP: ~15 ms on the reference BLAS, well under 1 ms on OpenBLAS
PROBE_RUNS = 5
SLOW_GFLOPS = 10.0  # below this, float32 prefill is BLAS-bound at reference speed: worth a fix
FAST_GFLOPS = 50.0  # no reference BLAS gets here (2-6 on the test machine); one thread of OpenBLAS does ~90
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BlasReport:
    """Which BLAS MLX's CPU matmul reaches, and how fast the probe ran through it."""

    name: str
    gflops: float | None  # float32 GEMM measured by the probe; None where it was not run
    note: str | None = None  # why it is not faster, and what to do; None when all is well
    threads: int | None = None  # OpenBLAS's threads (None: not OpenBLAS)

    def as_dict(self) -> dict:
        return asdict(self)


_activating = threading.Lock()  # two models loading at once must not both swap (or put back) the slots


def activate() -> BlasReport:
    """Route MLX's CPU GEMMs to OpenBLAS where that helps (Linux); idempotent. Warns once on failure.

    Called at the first model load on the CPU, not at import: the swap reaches every MLX user in the process.

    Example:
        >>> activate().name  # on Linux with scipy-openblas32: 'OpenBLAS 0.3.29.0 (scipy-openblas32)'
    """
    with _activating:
        return _activate()


@cache
def _activate() -> BlasReport:
    if sys.platform == "darwin":
        return BlasReport("Accelerate", None)
    if not sys.platform.startswith("linux"):
        return BlasReport("the BLAS MLX was built with", None)
    try:
        if os.environ.get("MLXINFER_BLAS", "").lower() == "reference":
            return BlasReport("reference BLAS (MLXINFER_BLAS=reference)", probe_gflops())
        report = _route_to_openblas()
    except Exception as e:  # noqa: BLE001 - this runs inside a model load: no failure here may stop it
        report = BlasReport("reference BLAS (netlib)", None, f"OpenBLAS could not be used: {e}")
    if report.note:
        log.warning("%s", report.note)  # one line on stderr, also without logging configured
    return report


def probe_gflops(n: int = PROBE_N) -> float:
    """float32 GEMM GFLOP/s on MLX's CPU stream; ValueError if the product is wrong."""
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((n, n), dtype=np.float32) for _ in range(2))
    x, y = mx.array(a), mx.array(b)
    best = float("inf")
    for _ in range(PROBE_RUNS):  # the best run: a busy machine slows some runs, never speeds one up
        start = time.perf_counter()
        out = mx.matmul(x, y, stream=mx.cpu)
        mx.eval(out)
        best = min(best, time.perf_counter() - start)
    want = a @ b
    error = float(np.linalg.norm(np.array(out) - want) / np.linalg.norm(want))
    if not error < 1e-4:
        raise ValueError(f"the probe matmul is wrong (relative error {error:.1e})")
    return 2 * n**3 / best / 1e9


def _route_to_openblas() -> BlasReport:
    before = probe_gflops()
    if before >= FAST_GFLOPS:  # this MLX already has an optimised BLAS: nothing to gain, nothing to risk
        return BlasReport("the BLAS MLX was built with", before)
    try:
        import scipy_openblas32
    except ImportError:
        return BlasReport("reference BLAS (netlib)", before, _note("scipy-openblas32 is not installed", before))
    openblas = _openblas(scipy_openblas32)
    if "OPENBLAS_NUM_THREADS" not in os.environ:  # the user's choice stands (OpenBLAS read it when loaded)
        openblas.scipy_openblas_set_num_threads(blas_threads())
    slots, targets = _gemm_slots(), _openblas_gemms(openblas)
    saved: dict[str, int] = {}
    try:
        for name in GEMMS:
            saved[name] = _swap(slots[name], targets[name])
        _check_products()
        after = probe_gflops()
        if after <= before:
            raise ValueError(f"it ran at {after:.1f} GFLOP/s, no faster than {before:.1f}")
    except Exception as e:  # noqa: BLE001 - whatever went wrong, every slot swapped so far goes back
        for name, value in saved.items():
            _swap(slots[name], value)
        return BlasReport("reference BLAS (netlib)", before, _note(f"OpenBLAS was not used: {e}", before))
    version = getattr(scipy_openblas32, "__version__", "")
    threads = openblas.scipy_openblas_get_num_threads()
    return BlasReport(f"OpenBLAS {version} (scipy-openblas32)".replace("  ", " "), after, threads=threads)


def _check_products() -> None:
    """The double and complex GEMMs (swapped too, but not timed) against numpy; ValueError if one is wrong."""
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((2, 24, 24))
    for x, y in ((a, b), ((a + 1j * b).astype(np.complex64), (b - 1j * a).astype(np.complex64))):
        got = np.array(mx.matmul(mx.array(x), mx.array(y), stream=mx.cpu))
        want = x @ y
        error = float(np.linalg.norm(got - want) / np.linalg.norm(want))
        if not error < 1e-4:
            raise ValueError(f"the {x.dtype} probe matmul is wrong (relative error {error:.1e})")


def blas_threads() -> int:
    """OpenBLAS threads: every core this process may use but one.

    OpenBLAS's threads wait for each other at every GEMM, so one that is descheduled stalls the product. With
    one of 2 cores busy (another process, or our own server's event loop), 2 threads ran a 256x256 GEMM at
    2-3 GFLOP/s and 1 thread at ~90; with both cores idle, 2 threads reach ~150. The free core is the cheaper
    bet. OPENBLAS_NUM_THREADS overrides."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores - 1)


def routed() -> bool:
    """Whether libmlx.so's GEMM slots all point at OpenBLAS now (read back from memory, not remembered)."""
    return all(routed_slots().values())


def routed_slots() -> dict[str, bool]:
    """{GEMM: whether its slot in libmlx.so points at OpenBLAS's function now}."""
    import scipy_openblas32

    slots, targets = _gemm_slots(), _openblas_gemms(_openblas(scipy_openblas32))
    return {name: ctypes.c_void_p.from_address(slots[name]).value == targets[name] for name in GEMMS}


def _gemm_slots() -> dict[str, int]:
    """{GEMM: the address of its GOT slot in the libmlx.so this process mapped}."""
    libmlx = _loaded_libmlx()
    base = _load_base(libmlx)
    return {name: base + offset for name, offset in _jump_slots(libmlx, GEMMS).items()}


def _openblas_gemms(openblas: ctypes.CDLL) -> dict[str, int]:
    """{GEMM: the address of OpenBLAS's function for it (same arguments, `scipy_`-prefixed name)}."""
    return {name: ctypes.cast(getattr(openblas, "scipy_" + name), ctypes.c_void_p).value for name in GEMMS}


def _note(why: str, gflops: float) -> str:
    """The one line logged when MLX keeps the reference BLAS."""
    return (
        f"{why}; MLX's float32 matmul stays on the reference BLAS at {gflops:.1f} GFLOP/s "
        "(`pip install scipy-openblas32 pyelftools` brings OpenBLAS; `mlxinfer doctor` says more)"
    )


def _openblas(package) -> ctypes.CDLL:
    return ctypes.CDLL(str(Path(package.get_lib_dir()) / package.get_library(fullname=True)))


def _loaded_libmlx() -> Path:
    """The libmlx.so this process mapped (not a guess at where pip put one)."""
    with open("/proc/self/maps", encoding="utf-8") as f:
        for line in f:
            path = line.split(maxsplit=5)[-1].strip()
            if Path(path).name == "libmlx.so":
                return Path(path)
    raise OSError("libmlx.so is not mapped in this process (MLX built without it?)")


def _jump_slots(library: Path, names: tuple[str, ...]) -> dict[str, int]:
    """{name: offset of its GOT jump slot}; ValueError unless each name is reached through one jump slot only.

    A jump slot is what every call through the PLT reads, so swapping it moves every call. Any other relocation
    for the name (its address stored in data, a second slot) would leave some calls on the reference BLAS.
    """
    machine, relocations = _cblas_relocations(library)
    jump_slot = JUMP_SLOTS.get(machine)
    if jump_slot is None:
        raise ValueError(f"{library.name} is built for {machine}, whose jump-slot relocation mlxinfer does not know")
    missing = sorted(set(names) - set(relocations))
    if missing:
        raise ValueError(f"{library.name} does not call {', '.join(missing)} through its PLT")
    slots = {}
    for name in names:
        kinds = [kind for kind, _ in relocations[name]]
        if kinds != [jump_slot]:
            raise ValueError(f"{library.name} reaches {name} through {', '.join(kinds)}, not one {jump_slot}")
        slots[name] = relocations[name][0][1]
    unknown = sorted(set(relocations) - set(names))
    if unknown:
        _warn_once(
            f"{library.name} also calls {', '.join(unknown)}, which mlxinfer does not route to OpenBLAS: those "
            "products stay on the reference BLAS (a newer MLX than this mlxinfer knows; upgrade mlxinfer)"
        )
    return slots


@cache
def _cblas_relocations(library: Path) -> tuple[str, dict[str, tuple[tuple[str, int], ...]]]:
    """(the file's machine, {cblas_* symbol: ((relocation type, GOT offset), ...)}) from all its relocations."""
    from elftools.elf.descriptions import describe_reloc_type
    from elftools.elf.elffile import ELFFile
    from elftools.elf.relocation import RelocationSection

    found: dict[str, list[tuple[str, int]]] = {}
    with open(library, "rb") as f:
        elf = ELFFile(f)
        for section in elf.iter_sections():
            if not isinstance(section, RelocationSection) or not section["sh_link"]:
                continue
            symbols = elf.get_section(section["sh_link"])
            for relocation in section.iter_relocations():
                if not relocation["r_info_sym"]:  # most of .rela.dyn: relative fix-ups that name no symbol
                    continue
                name = symbols.get_symbol(relocation["r_info_sym"]).name
                if name.startswith("cblas_"):
                    kind = describe_reloc_type(relocation["r_info_type"], elf)
                    found.setdefault(name, []).append((kind, relocation["r_offset"]))
        return elf["e_machine"], {name: tuple(found[name]) for name in found}


@cache
def _warn_once(message: str) -> None:
    log.warning("%s", message)


def _load_base(library: Path) -> int:
    """Where the dynamic linker put `library` (its link_map's l_addr), from dlinfo."""
    handle = ctypes.CDLL(str(library), mode=os.RTLD_NOLOAD | os.RTLD_LAZY)._handle
    libc = ctypes.CDLL(None)
    libc.dlinfo.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p)
    link_map = ctypes.c_void_p()
    if libc.dlinfo(handle, 2, ctypes.byref(link_map)) != 0:  # 2: RTLD_DI_LINKMAP
        raise OSError(f"dlinfo found no link map for {library.name}")
    return ctypes.c_size_t.from_address(link_map.value).value


def _swap(address: int, value: int) -> int:
    """Store pointer `value` at `address` (a GOT slot); returns what it held. Unprotects a read-only page."""
    slot = ctypes.c_void_p.from_address(address)
    if _writable(address):
        old, slot.value = slot.value, value
        return old
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    page = address - address % mmap.PAGESIZE
    if libc.mprotect(page, mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_WRITE) != 0:
        raise OSError(ctypes.get_errno(), "mprotect refused to unprotect libmlx's GOT")
    try:
        old, slot.value = slot.value, value
    finally:
        libc.mprotect(page, mmap.PAGESIZE, mmap.PROT_READ)  # RELRO: read-only again
    return old


def _writable(address: int) -> bool:
    with open("/proc/self/maps", encoding="utf-8") as f:
        for line in f:
            span, perms = line.split(maxsplit=2)[:2]
            low, high = (int(x, 16) for x in span.split("-"))
            if low <= address < high:
                return perms[1] == "w"
    raise OSError(f"address {address:#x} is not mapped")
