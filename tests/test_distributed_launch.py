"""Launching ranks: each picks its ring port where it runs, ssh gets a host and never an option, and a rank that
fails before the ring is joined ends `serve` in one line at once (Ctrl-C too), never a hang."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mlxinfer.distributed import Host, Launch
from mlxinfer.distributed.launch import rank_argv, remote_argv, ring_ips
from mlxinfer.distributed.ring import checked_ring, parse_port, reserve
from mlxinfer.errors import ClusterError

from .conftest import TINY
from .test_distributed import CLI, PROMPTS, _one_process, served

MODEL = TINY / "llama_classic"


def test_a_remote_rank_starts_over_ssh_with_the_host_after_double_dash():
    host = Host("mbp.local", "alice@mbp.local", ("10.0.0.2",), python="/opt/my python/bin/python3")
    argv, env = rank_argv(1, host, "10.0.0.2", Launch("/models/m"))
    assert argv[:3] == ["ssh", "--", "alice@mbp.local"] and len(argv) == 4 and env is None
    # The remote shell splits the one command line back into the same words, the interpreter's space included.
    launch = json.dumps(Launch("/models/m").to_json())
    assert shlex.split(argv[3]) == [
        "env", "MLX_RANK=1", "MLXINFER_RING_IP=10.0.0.2",
        "/opt/my python/bin/python3", "-m", "mlxinfer.distributed.rank", launch,
    ]  # fmt: skip
    assert remote_argv(Host("-x", "-oProxyCommand=x"), "c")[:3] == ["ssh", "--", "-oProxyCommand=x"]


def test_a_local_rank_is_a_child_process_told_its_rank_and_address():
    argv, env = rank_argv(2, Host("localhost", "localhost"), "127.0.0.1", Launch("/models/m"))
    assert argv[:3] == [sys.executable, "-m", "mlxinfer.distributed.rank"]
    assert env["MLX_RANK"] == "2" and env["MLXINFER_RING_IP"] == "127.0.0.1"


def test_ring_addresses_come_from_each_hosts_ips():
    local = [Host("localhost", "localhost"), Host("localhost", "localhost", ("127.0.0.2",))]
    assert ring_ips(local) == ["127.0.0.1", "127.0.0.2"]
    remote = [Host("studio", "studio", ("10.0.0.1",)), Host("mbp", "mbp")]
    with pytest.raises(ClusterError, match=r'host 1 \(mbp\) has no "ips"'):
        ring_ips(remote)
    with pytest.raises(ClusterError, match=r"cannot listen on 192\.0\.2\.7 here .*its own address"):
        reserve("192.0.2.7")  # TEST-NET-1: no address of this machine


def test_a_rank_reports_its_port_and_takes_only_a_ring():
    assert parse_port(b"mlxinfer-ring-port 50123") == 50123
    assert [parse_port(x) for x in (b"Welcome to mbp", b"mlxinfer-ring-port 70000", b"mlxinfer-ring-port x")] == [
        None,
        None,
        None,
    ]
    assert checked_ring(b'[["10.0.0.1:5000"], ["10.0.0.2:5001"]]', 1) == [["10.0.0.1:5000"], ["10.0.0.2:5001"]]
    for bad in (b'[["10.0.0.1:5000"]]', b'[["host:5000"], ["10.0.0.2:1"]]', b'[["10.0.0.1:0"], ["10.0.0.2:1"]]'):
        with pytest.raises(ClusterError, match="no valid ring addresses"):
            checked_ring(bad, 1)


# ---- a rank that never joins: serve ends in one line, at once ----

# A stand-in for rank 1's interpreter (the hostfile's "python"): it speaks the launch protocol, then fails.
FAKE_RANK = """#!/bin/sh
{before}
echo "mlxinfer-ring-port 9"
read ring
touch "{folder}/got-ring"
{after}
"""


def _fake_hostfile(tmp_path: Path, before: str = "", after: str = "") -> Path:
    fake = tmp_path / "fake-python"
    fake.write_text(FAKE_RANK.format(before=before, after=after, folder=tmp_path))
    fake.chmod(0o755)
    hosts = [
        {"ssh": "localhost", "ips": ["127.0.0.1"]},
        {"ssh": "localhost", "ips": ["127.0.0.1"], "python": str(fake)},
    ]
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps(hosts))
    return path


@contextlib.contextmanager
def _serving(hostfile: Path):
    command = [*CLI, "serve", str(MODEL), "--hostfile", str(hostfile), "--port", "0"]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        yield process
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(30)


def _ended(process: subprocess.Popen, within: float) -> tuple[str, float]:
    """stderr of `process` and the time.time() it ended; fails the test if it runs on past `within` s."""
    try:
        _, stderr = process.communicate(timeout=within)
    except subprocess.TimeoutExpired:
        pytest.fail(f"serve still runs after {within:g} s")
    return stderr, time.time()


@pytest.mark.slow
@pytest.mark.parametrize(
    "before,after",
    [
        ("exit 3", ""),  # dies at once: serve is still gathering the ranks' ports
        ("", 'sleep 1; date +%s.%N > "$(dirname "$0")/died"; exit 3'),  # dies while rank 0 waits in MLX's join
    ],
    ids=["before-reporting", "while-joining"],
)
def test_a_rank_that_dies_before_joining_ends_serve_in_one_line_at_once(before, after, tmp_path):
    with _serving(_fake_hostfile(tmp_path, before, after)) as process:
        stderr, ended_at = _ended(process, 60)
    assert process.returncode != 0
    errors = [line for line in stderr.splitlines() if line.startswith("Error:")]
    assert errors == ["Error: rank 1 (localhost) exited with code 3 before joining the ring; see its output above"], (
        stderr[-2000:]
    )
    assert "Traceback" not in stderr
    if after:
        assert ended_at - float((tmp_path / "died").read_text()) < 5


@pytest.mark.slow
def test_ctrl_c_stops_serve_while_it_waits_for_the_ring(tmp_path):
    with _serving(_fake_hostfile(tmp_path, after="exec sleep 120")) as process:
        deadline = time.monotonic() + 60
        while not (tmp_path / "got-ring").exists():
            assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()
            time.sleep(0.1)
        time.sleep(1)  # rank 0 is inside MLX's join now
        os.kill(process.pid, signal.SIGINT)
        stderr, _ = _ended(process, 10)
    assert process.returncode != 0
    assert "Traceback" not in stderr and "Aborted" in stderr.splitlines()[-1], stderr[-2000:]


@pytest.mark.slow
def test_the_join_gives_up_at_its_deadline_in_one_line(tmp_path):
    code = (
        "import sys, time\n"
        "from mlxinfer.distributed.ring import join\n"
        "from mlxinfer.errors import ClusterError\n"
        "started = time.monotonic()\n"
        "try:\n"
        "    join(0, [['127.0.0.1:' + sys.argv[1]], ['127.0.0.1:9']], 1.0)\n"
        "except ClusterError as e:\n"
        "    print(f'{time.monotonic() - started:.1f}', e)\n"
    )
    with contextlib.closing(reserve("127.0.0.1")) as sock:
        port = str(sock.getsockname()[1])
    result = subprocess.run([sys.executable, "-c", code, port], capture_output=True, text=True, timeout=60)
    took, _, message = result.stdout.strip().partition(" ")
    assert message == "the ranks did not all join the ring within 1 s; check each host's ips and firewall", result
    assert float(took) < 10


# ---- two hosts for real: network namespaces joined by a veth pair ----


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def two_hosts():
    """Two network namespaces, 10.231.0.1 and 10.231.0.2 over a veth pair, each with its loopback; removed after."""
    if not sys.platform.startswith("linux") or shutil.which("ip") is None or os.geteuid() != 0:
        pytest.skip("two hosts in network namespaces need Linux, root and iproute2's `ip`")
    names = [f"mlxinfer-{os.getpid()}-{side}" for side in "ab"]
    made = []
    try:
        for name in names:
            try:
                _ip("netns", "add", name)
            except subprocess.CalledProcessError as e:
                pytest.skip(f"`ip netns add` failed here: {e.stderr.decode().strip()}")
            made.append(name)
        _ip("link", "add", "ring0", "netns", names[0], "type", "veth", "peer", "name", "ring0", "netns", names[1])
        for i, name in enumerate(names):
            _ip("-n", name, "addr", "add", f"10.231.0.{i + 1}/24", "dev", "ring0")
            _ip("-n", name, "link", "set", "ring0", "up")
            _ip("-n", name, "link", "set", "lo", "up")
        yield names
    finally:
        for name in made:  # the veth pair goes with them
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


# rank 0 is `mlxinfer serve` inside the first namespace; ranks on other "hosts" start in theirs, not over ssh.
IN_NAMESPACES = """
import json, sys
from mlxinfer.distributed import launch
namespaces = json.loads(sys.argv.pop(1))
launch.remote_argv = lambda host, command: ["ip", "netns", "exec", namespaces[host.ssh], "sh", "-c", command]
from mlxinfer.cli import main
main()
"""
CLIENT = """
import json, sys, urllib.request
def complete(prompt):
    body = json.dumps({"prompt": prompt, "max_tokens": 12, "temperature": 0}).encode()
    request = urllib.request.Request(sys.argv[1] + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)["choices"][0]["text"]
print(json.dumps([complete(p) for p in json.loads(sys.argv[2])]))
"""


@pytest.mark.slow
def test_two_hosts_in_network_namespaces_serve_the_one_process_answers(two_hosts, tmp_path):
    hosts = [{"ssh": "rank0.test", "ips": ["10.231.0.1"]}, {"ssh": "rank1.test", "ips": ["10.231.0.2"]}]
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps(hosts))
    cli = ["ip", "netns", "exec", two_hosts[0], sys.executable, "-c", IN_NAMESPACES]
    cli.append(json.dumps({"rank1.test": two_hosts[1]}))
    expected = _one_process(MODEL, PROMPTS)
    with served(MODEL, hostfile, cli=cli) as (url, _):  # its URL is the first namespace's loopback
        client = ["ip", "netns", "exec", two_hosts[0], sys.executable, "-c", CLIENT, url, json.dumps(PROMPTS)]
        answers = subprocess.run(client, capture_output=True, text=True, timeout=180)
    assert answers.returncode == 0, answers.stderr[-2000:]
    assert json.loads(answers.stdout) == expected
