"""Issue 17's figures: the memory of three front ends on one model when each loads it ("before") and when they
attach to one resident `mlxinfer serve` ("after"), and the time to the first token attached vs loading in-process.

Every process runs with a private runtime dir (where the server publishes itself) and a private cache dir (no
warmed prefixes on disk from earlier runs). Usage: `python -m bench.resident_bench [--quick] [--out DIR]`;
`--quick` runs the tiny llama fixture with one repeat (a smoke test of the bench, not a figure).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

CLI = [sys.executable, "-m", "mlxinfer.cli"]
FRONT_ENDS = ("menubar helper", "notebook kernel", "terminal chat")
QUESTION = "What is the capital of {}?"
COUNTRIES = (
    "France", "Italy", "Spain", "Germany", "Japan", "Canada", "Egypt", "Peru", "Kenya", "Norway", "Chile", "India",
    "Greece", "Mexico", "Sweden", "Brazil", "Poland", "Turkey", "Ghana", "Nepal",
)  # fmt: skip
MAX_TOKENS = 8
START_TIMEOUT_S = 600.0
TINY = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "tiny" / "llama_classic"
MIB = 1 << 20

# A front end that holds the model: loads it (or attaches), answers once, then waits until stdin closes.
HOLDER = r"""
import json, sys
import mlx.core as mx
import mlxinfer
path, how, prompt, max_tokens = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
model = mlxinfer.load(path) if how == "load" else mlxinfer.connect(path)
answer = model.chat(prompt, max_tokens=max_tokens)
facts = {"kind": type(model).__name__, "text": answer.text}
if how == "load":
    ids = model.encode_prompt([{"role": "user", "content": prompt}], chat=True)
    facts |= {"model": repr(model), "weights_bytes": model.footprint.weights_bytes, "prompt_tokens": len(ids)}
    facts |= {"mlx_active_bytes": mx.get_active_memory(), "mlx_cache_bytes": mx.get_cache_memory()}
print(json.dumps(facts), flush=True)
sys.stdin.read()
"""

# One fresh process: import, connect() or load(), first non-empty chunk of .stream(); monotonic timestamps
# (CLOCK_MONOTONIC is system-wide on Linux and macOS, so the parent's clock reads the same).
FIRST_CHUNK = r"""
import time
started = time.monotonic()
import json, sys
import mlxinfer
imported = time.monotonic()
path, how, prompt, max_tokens = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
model = mlxinfer.load(path) if how == "load" else mlxinfer.connect(path)
ready = time.monotonic()
chunks = iter(model.stream([{"role": "user", "content": prompt}], chat=True, max_tokens=max_tokens))
first = next((c for c in chunks if c), "")
first_at = time.monotonic()
text = first + "".join(chunks)
print(json.dumps({"kind": type(model).__name__, "started": started, "imported": imported, "ready": ready,
                  "first": first_at, "text": text}), flush=True)
"""


class Processes:
    """Every process the bench starts; all are ended on the way out, errors included."""

    def __init__(self, logs: Path):
        self.logs, self.running, self.started = logs, [], 0

    def start(
        self, name: str, command: list[str], env: dict[str, str], stdin: bool = False, stdout: bool = True
    ) -> subprocess.Popen:
        self.started += 1
        log = open(self.logs / f"{self.started:03d}-{name.replace(' ', '-')}.log", "w+b")  # noqa: SIM115
        process = subprocess.Popen(
            command, env=env, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE if stdout else subprocess.DEVNULL, stderr=log, bufsize=0,
        )  # fmt: skip
        process.log = log  # type: ignore[attr-defined]
        self.running.append(process)
        return process

    def stop(self, process: subprocess.Popen) -> None:
        if process.stdin:
            try:
                process.stdin.close()  # a holder's cue to exit
            except OSError:
                pass
        if process.poll() is None:
            process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(30)
        if process.stdout:
            process.stdout.close()
        process.log.close()  # type: ignore[attr-defined]
        if process in self.running:
            self.running.remove(process)

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc: object) -> None:
        for process in list(reversed(self.running)):
            self.stop(process)


def stderr_of(process: subprocess.Popen) -> str:
    log = process.log  # type: ignore[attr-defined]
    log.flush()
    log.seek(0)
    return log.read().decode(errors="replace")


def read_byte(process: subprocess.Popen, timeout_s: float = START_TIMEOUT_S) -> bytes:
    """The next byte of a child's stdout, as soon as it comes; RuntimeError with its stderr if it dies or stays
    silent."""
    ready, _, _ = select.select([process.stdout], [], [], timeout_s)
    byte = process.stdout.read(1) if ready else b""
    if not byte:
        why = "exited" if ready else f"said nothing for {timeout_s:.0f} s"
        raise RuntimeError(f"{process.args[-4:]} {why}:\n{stderr_of(process)[-2000:]}")
    return byte


def read_line(process: subprocess.Popen, timeout_s: float = START_TIMEOUT_S) -> str:
    """The next line of a child's stdout (read a byte at a time: the pipe is unbuffered)."""
    line, deadline = b"", time.monotonic() + timeout_s
    while not line.endswith(b"\n"):
        line += read_byte(process, max(0.0, deadline - time.monotonic()))
    return line.decode()


def memory_of(pid: int) -> dict[str, int]:
    """RSS, PSS and USS in bytes of a process and its children (PSS/USS where the OS gives them)."""
    figures = {"rss": 0, "pss": 0, "uss": 0}
    root = psutil.Process(pid)
    for process in [root, *root.children(recursive=True)]:
        try:
            info = process.memory_full_info()
        except psutil.AccessDenied:
            info = process.memory_info()
        for key in figures:
            figures[key] += getattr(info, key, 0)
    return figures


def total(members: list[dict[str, Any]]) -> dict[str, int]:
    return {key: sum(m["memory"][key] for m in members) for key in ("rss", "pss", "uss")}


def private_env(root: Path, name: str) -> dict[str, str]:
    """The environment of one model's processes: its own runtime dir (mode 700) and cache dir."""
    runtime, cache = root / f"runtime-{name}", root / f"cache-{name}"
    runtime.mkdir(mode=0o700)
    cache.mkdir()
    return {**os.environ, "MLXINFER_RUNTIME_DIR": str(runtime), "MLXINFER_CACHE_DIR": str(cache)}


def holders(procs: Processes, path: Path, how: str, env: dict[str, str]) -> list[dict[str, Any]]:
    """The three front ends, started together; each once it has answered and holds its model (or connection)."""
    started = []
    for i, name in enumerate(FRONT_ENDS):
        prompt = QUESTION.format(COUNTRIES[i])
        command = [sys.executable, "-c", HOLDER, str(path), how, prompt, str(MAX_TOKENS)]
        started.append((name, procs.start(f"{how}-{name}", command, env, stdin=True)))
    members = []
    for name, process in started:
        facts = json.loads(read_line(process))
        expected = "Model" if how == "load" else "RemoteModel"
        if facts["kind"] != expected:
            raise RuntimeError(f"{name}: got a {facts['kind']}, expected a {expected}:\n{stderr_of(process)}")
        members.append({"name": name, "pid": process.pid, "process": process, **facts})
    return members


def start_server(procs: Processes, path: Path, env: dict[str, str]) -> subprocess.Popen:
    """`mlxinfer serve PATH --port 0`, once it has published itself in the private runtime dir."""
    command = [*CLI, "serve", str(path), "--port", "0", "--keep-alive=-1"]
    server = procs.start("server", command, env, stdout=False)
    state = Path(env["MLXINFER_RUNTIME_DIR"]) / "server.json"
    deadline = time.monotonic() + START_TIMEOUT_S
    while not (state.exists() and json.loads(state.read_text()).get("pid") == server.pid):
        if server.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the server never published itself:\n{stderr_of(server)[-2000:]}")
        time.sleep(0.1)
    return server


def memory_phase(procs: Processes, path: Path, env: dict[str, str]) -> tuple[dict[str, Any], subprocess.Popen]:
    """Before: three front ends each holding the model. After: one server and three attached. The server is
    left running (warm) for the TTFT phase."""
    before = holders(procs, path, "load", env)
    for m in before:
        m["memory"] = memory_of(m["pid"])
    for m in before:
        procs.stop(m.pop("process"))
        m["mlx_bytes"] = {"active": m.pop("mlx_active_bytes"), "cache": m.pop("mlx_cache_bytes")}
    server = start_server(procs, path, env)
    after = holders(procs, path, "connect", env)
    members = [{"name": "server", "pid": server.pid}, *after]
    for m in members:
        m["memory"] = memory_of(m["pid"])
    for m in after:
        procs.stop(m.pop("process"))
    facts = {k: before[0][k] for k in ("model", "weights_bytes", "prompt_tokens")}
    same = all(b["text"] == a["text"] for b, a in zip(before, after))
    result = {"before": before, "after": members, "before_total": total(before), "after_total": total(members)}
    return result | facts | {"same_answers": same}, server


SUMMARY = re.compile(r"(\d+) prompt tokens(?: \((\d+) cached\))?, (\d+) generated")


def cli_first_byte(procs: Processes, path: Path, prompt: str, local: bool, env: dict[str, str]) -> dict[str, Any]:
    """`mlxinfer generate` in a fresh process: seconds from its start to the first byte of its stdout."""
    command = [*CLI, "generate", str(path), "-p", prompt, "--max-tokens", str(MAX_TOKENS)] + ["--local"] * local
    started = time.monotonic()
    process = procs.start("generate-local" if local else "generate-attached", command, env)
    first = read_byte(process)
    first_at = time.monotonic()
    rest = process.stdout.read()
    process.wait(START_TIMEOUT_S)
    done_at = time.monotonic()
    err = stderr_of(process)
    procs.stop(process)
    attached = "Using the mlxinfer server" in err
    if process.returncode != 0 or not first or attached == local:
        raise RuntimeError(f"{command[3:]} failed (rc {process.returncode}, attached {attached}):\n{err[-2000:]}")
    counts = SUMMARY.search(err)
    run = {"ttft_s": first_at - started, "total_s": done_at - started, "text": (first + rest).decode().strip()}
    if counts:
        run |= {"prompt_tokens": int(counts[1]), "cached_tokens": int(counts[2] or 0), "tokens": int(counts[3])}
    return run


def python_first_chunk(procs: Processes, path: Path, prompt: str, how: str, env: dict[str, str]) -> dict[str, Any]:
    """`mlxinfer.connect()` or `mlxinfer.load()` and the first chunk of `.stream()`, in a fresh process."""
    command = [sys.executable, "-c", FIRST_CHUNK, str(path), how, prompt, str(MAX_TOKENS)]
    started = time.monotonic()
    process = procs.start(f"python-{how}", command, env)
    t = json.loads(read_line(process))
    process.wait(START_TIMEOUT_S)
    done_at = time.monotonic()
    procs.stop(process)
    expected = "Model" if how == "load" else "RemoteModel"
    if t["kind"] != expected:
        raise RuntimeError(f"python {how}: got a {t['kind']}, expected a {expected}:\n{stderr_of(process)}")
    return {
        "ttft_s": t["first"] - started,  # from the parent's start of the process
        "in_process_s": t["first"] - t["imported"],  # connect()/load() + first chunk, after the import
        "interpreter_s": t["started"] - started,
        "import_s": t["imported"] - t["started"],
        "attach_or_load_s": t["ready"] - t["imported"],
        "total_s": done_at - started,
        "text": t["text"],
    }


WAYS = (
    ("cli_attached", "`mlxinfer generate` attached to the warm server"),
    ("cli_local", "`mlxinfer generate --local` (loads in-process)"),
    ("python_connect", "`mlxinfer.connect()` + first chunk of `.stream()`"),
    ("python_load", "`mlxinfer.load()` + first chunk of `.stream()`"),
)


def ttft_phase(procs: Processes, path: Path, env: dict[str, str], repeats: int) -> dict[str, list[dict[str, Any]]]:
    """Each way once per round, interleaved (the order reversed every other round); a new question every run, so
    no run finds its whole prompt in the server's prefix cache (the server keeps the template's shared head)."""
    runs: dict[str, list[dict[str, Any]]] = {key: [] for key, _ in WAYS}
    questions = iter(QUESTION.format(c) for c in COUNTRIES[len(FRONT_ENDS) :] * repeats)
    for r in range(repeats):
        order = [key for key, _ in WAYS]
        for key in order if r % 2 == 0 else reversed(order):
            prompt = next(questions)
            if key.startswith("cli"):
                runs[key].append(cli_first_byte(procs, path, prompt, key == "cli_local", env))
            else:
                runs[key].append(python_first_chunk(procs, path, prompt, key.split("_")[1], env))
    return runs


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def models_to_run(quick: bool) -> list[dict[str, Any]]:
    """The default model (its Q4_1 GGUF), and the bf16 checkpoint of bench/models.py when it is already made."""
    if quick:
        return [{"label": "tiny llama fixture (random weights)", "path": TINY}]
    from mlxinfer.default_model import default_model_path
    from mlxinfer.paths import cache_dir

    found = [{"label": "SmolLM2-135M-Instruct Q4_1 GGUF (default model)", "path": default_model_path()}]
    bf16 = cache_dir() / "bench-models" / "SmolLM2-135M-Instruct-bf16"
    if (bf16 / "config.json").exists():
        found.append({"label": "SmolLM2-135M-Instruct bf16 safetensors (bench/models.py)", "path": bf16})
    return found


def file_bytes(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def run_bench(quick: bool) -> dict[str, Any]:
    from mlxinfer.speed.conditions import conditions

    repeats = 1 if quick else 3
    figures: dict[str, Any] = {"conditions": conditions(), "load_average_at_start": os.getloadavg()}
    figures |= {"max_tokens": MAX_TOKENS, "repeats": repeats, "models": []}
    with tempfile.TemporaryDirectory(prefix="mlxinfer-resident-") as tmp, Processes(Path(tmp)) as procs:
        Path(tmp).chmod(0o700)
        for entry in models_to_run(quick):
            path, started = Path(entry["path"]), time.monotonic()
            env = private_env(Path(tmp), str(len(figures["models"])))
            memory, server = memory_phase(procs, path, env)
            runs = ttft_phase(procs, path, env, repeats)
            procs.stop(server)
            ttft = {key: {"ttft_s": spread([r["ttft_s"] for r in got]), "runs": got} for key, got in runs.items()}
            model = {"label": entry["label"], "path": str(path), "file_bytes": file_bytes(path)}
            figures["models"].append(model | memory | {"ttft": ttft, "wall_s": time.monotonic() - started})
    figures["load_average_at_end"] = os.getloadavg()
    return figures


def mib(n: float) -> str:
    return f"{n / MIB:,.0f}"


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


def markdown(f: dict[str, Any]) -> str:
    c, v = f["conditions"], f["conditions"]["versions"]
    lines = [
        f"{c['date']} · {c['chip']} ({c['cores']} cores, {c['memory_bytes'] / (1 << 30):.0f} GiB) · {c['os']} · "
        f"Python {c['python']} · backend {c['backend']} · mlx {v['mlx']} · mlx-lm {v['mlx-lm']} · mlxinfer "
        f"{v['mlxinfer']}; load average {f['load_average_at_start'][0]:.1f} at the start, "
        f"{f['load_average_at_end'][0]:.1f} at the end.",
        f"Front ends: {', '.join(FRONT_ENDS)} (stand-ins: a Python process each). Greedy chat answers of at most "
        f"{f['max_tokens']} tokens to 'What is the capital of X?'; memory measured once all of a setup's processes "
        f"had answered once and held their model or connection. TTFT: {f['repeats']} interleaved round(s), a fresh "
        "process per run, the server warm (it had answered the three attached front ends); median (min-max).",
    ]
    for m in f["models"]:
        lines += ["", *model_tables(m)]
    return "\n".join(lines)


def model_tables(m: dict[str, Any]) -> list[str]:
    b, a = m["before_total"], m["after_total"]
    lines = [
        f"**{m['label']}**: {m['path']}, {mib(m['file_bytes'])} MiB on disk; loaded: {m['model']} "
        f"({mib(m['weights_bytes'])} MiB of weights); chat prompt {m['prompt_tokens']} tokens.",
        "",
        "| setup | processes | RSS MiB | PSS MiB | USS MiB | per process, RSS MiB |",
        "|---|---|---|---|---|---|",
    ]
    for label, members, t in (("before: each loads it", m["before"], b), ("after: server + attached", m["after"], a)):
        each = ", ".join(f"{x['name']} {mib(x['memory']['rss'])}" for x in members)
        lines.append(f"| {label} | {len(members)} | {mib(t['rss'])} | {mib(t['pss'])} | {mib(t['uss'])} | {each} |")
    lines += [
        "",
        f"- before / after: RSS {ratio(b['rss'], a['rss'])}, PSS {ratio(b['pss'], a['pss'])}, USS "
        f"{ratio(b['uss'], a['uss'])}; same answers before and after: {'yes' if m['same_answers'] else 'NO'}.",
        f"- in each loading front end, MLX held {mib(_mean(m['before'], 'active'))} MiB of arrays and "
        f"{mib(_mean(m['before'], 'cache'))} MiB of freed buffers in its cache; an attached process's RSS is the "
        "interpreter and its imports (mlx, numpy, tokenizers among them).",
        "",
        "| front end, fresh process | time to first token s | import s | attach/load s | whole run s | prompt "
        "tokens (cached) |",
        "|---|---|---|---|---|---|",
    ]
    for key, label in WAYS:
        runs, s = m["ttft"][key]["runs"], m["ttft"][key]["ttft_s"]
        extra = [_median(runs, "import_s"), _median(runs, "attach_or_load_s"), _median(runs, "total_s")]
        cached = [f"{r['prompt_tokens']} ({r['cached_tokens']})" for r in runs if "prompt_tokens" in r]
        extra.append(", ".join(cached) or "-")
        lines.append(f"| {label} | {s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f}) | {' | '.join(extra)} |")
    t = {key: m["ttft"][key]["ttft_s"]["median"] for key, _ in WAYS}
    lines += [
        "",
        f"- local / attached time to first token: CLI {ratio(t['cli_local'], t['cli_attached'])}, Python "
        f"{ratio(t['python_load'], t['python_connect'])}.",
    ]
    return lines


def _mean(members: list[dict[str, Any]], key: str) -> float:
    return statistics.mean(m["mlx_bytes"][key] for m in members)


def _median(runs: list[dict[str, Any]], key: str) -> str:
    values = [r[key] for r in runs if key in r]
    return f"{statistics.median(values):.2f}" if values else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tiny fixture, one repeat (a smoke test)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    from .__main__ import write_figures

    # A SIGTERM (a CI timeout, `kill`) unwinds like Ctrl-C, so the `finally`s end every process this started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    figures = run_bench(args.quick)
    write_figures(figures, markdown(figures), args.out, args.quick, "-resident")


if __name__ == "__main__":
    main()
