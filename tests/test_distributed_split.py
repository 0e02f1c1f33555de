"""Pipeline planning: the layer split by memory, the hosts, the speed estimate and `mlxinfer plan --hosts`."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from click.testing import CliRunner

from mlxinfer.cli import main
from mlxinfer.distributed.estimate import StageLoad, estimate_pipeline
from mlxinfer.distributed.hosts import (
    MAX_HOSTFILE_BYTES,
    Host,
    HostsError,
    local_hostfile,
    parse_hosts,
    parse_size,
    read_hostfile,
)
from mlxinfer.distributed.split import SplitError, even_split, layer_ranges, split_layers
from mlxinfer.errors import ConfigError, MemoryBudgetError
from tests.conftest import TINY

GiB, MiB = 2**30, 2**20


# ---- split_layers ----


@pytest.mark.parametrize(
    ("layer_bytes", "shared", "usable", "expected"),
    [
        ([10] * 12, 5, [205, 105], [8, 4]),  # rooms 200 : 100 -> 12 * 2/3 and 12 * 1/3
        ([10] * 8, 0, [100, 200, 100], [2, 4, 2]),  # rooms 1 : 2 : 1
        ([4, 4, 4, 4, 16], 0, [1000, 1000], [4, 1]),  # by bytes, not by count: 16 of the 32 bytes each
        ([7] * 3, 0, [100, 100], [2, 1]),  # 1.5 layers each: the tie goes to the earlier host
        ([1] * 3, 0, [1000, 1, 1], [1, 1, 1]),  # a small host still gets its one layer
        ([3, 3, 90], 0, [5, 100], [1, 2]),  # nearest cut (2 layers, 6 bytes) overfills rank 0: filled in order
    ],
)
def test_layers_split_in_proportion_to_each_hosts_room(layer_bytes, shared, usable, expected):
    assert split_layers(layer_bytes, shared, usable) == expected


def test_every_host_gets_a_layer_and_the_split_fits_for_many_shapes():
    for hosts in range(1, 9):
        for n in range(hosts, 40, 3):
            layer_bytes = [100 + (i * 37) % 50 for i in range(n)]
            weights = [1 + (r * 7) % 5 for r in range(hosts)]
            # each host's exact share of the bytes and one layer of slack for whole layers: tight, but it fits
            usable = [50 + -(-sum(layer_bytes) * w // sum(weights)) + 150 for w in weights]
            counts = split_layers(layer_bytes, 50, usable)
            assert len(counts) == hosts and sum(counts) == n and min(counts) >= 1
            for (start, end), room in zip(layer_ranges(counts), usable):
                assert 50 + sum(layer_bytes[start:end]) <= room


def test_layers_that_do_not_fit_name_the_host_and_the_shortfall():
    # rooms 30 : 20 of 50 for 60 bytes: studio would take 4 layers, 40 + 10 shared = 50 of its 40.
    with pytest.raises(SplitError) as e:
        split_layers([10] * 6, 10, [40, 30], names=["studio", "mbp"])
    message = str(e.value)
    assert "studio" in message and "10 B short" in message and "together are 10 B short" in message
    assert "--bits 4" in message and "\n" not in message
    assert isinstance(e.value, MemoryBudgetError)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (([10, 10], 0, [100, 100, 100]), "2 layers cannot be split over 3 hosts"),
        (([10] * 4, 50, [100, 50]), "rank 1 can use 50 B but every host holds 50 B"),
        (([10, -1], 0, [100]), "layer_bytes[1] must be a non-negative integer"),
        (([10, 1.5], 0, [100]), "layer_bytes[1] must be a non-negative integer"),
        (([10, True], 0, [100]), "layer_bytes[1] must be a non-negative integer"),
        (([10], -1, [100]), "shared_bytes must be a non-negative integer"),
        (([10], 0, [100.0]), "usable_bytes[0] must be a non-negative integer"),
        (([10], 0, []), "no hosts"),
    ],
)
def test_bad_splits_are_one_line_split_errors(args, words):
    with pytest.raises(SplitError, match=words.replace("[", r"\[").replace("]", r"\]")) as e:
        split_layers(*args)
    assert "\n" not in str(e.value)


def test_names_must_match_the_hosts():
    with pytest.raises(SplitError, match="2 host names for 3 hosts"):
        split_layers([1] * 6, 0, [10, 10, 10], names=["a", "b"])


@pytest.mark.slow
def test_the_split_is_the_same_in_every_process():
    # Each rank computes the split itself: another process (another hash seed) must agree, and so must
    # any integer type the sizes arrive in.
    layer_bytes, usable = [1000 + (i * 7919) % 997 for i in range(80)], [192 * GiB, 64 * GiB, 96 * GiB, 24 * GiB]
    here = split_layers(layer_bytes, 3 * GiB, usable)
    assert split_layers(tuple(layer_bytes), 3 * GiB, tuple(usable)) == here
    code = (
        "import json, sys; from mlxinfer.distributed.split import split_layers; "
        "a = json.loads(sys.argv[1]); print(json.dumps(split_layers(a[0], a[1], a[2])))"
    )
    for seed in ("1", "2"):
        out = subprocess.run(
            [sys.executable, "-c", code, json.dumps([layer_bytes, 3 * GiB, usable])],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout
        assert json.loads(out) == here


def test_even_split_and_ranges():
    assert even_split(10, 4) == [3, 3, 2, 2]
    assert even_split(4, 4) == [1, 1, 1, 1]
    assert layer_ranges([8, 4]) == [(0, 8), (8, 12)]
    with pytest.raises(SplitError, match="3 layers cannot be split over 4 hosts"):
        even_split(3, 4)


# ---- hosts ----


def test_hosts_option_reads_names_and_sizes():
    hosts = parse_hosts("studio=192GB,mbp=64GB")
    assert [(h.name, h.memory_bytes, h.ssh) for h in hosts] == [("studio", 192 * GiB, None), ("mbp", 64 * GiB, None)]
    assert [h.memory_bytes for h in parse_hosts("64, 32")] == [64 * GiB, 32 * GiB]
    assert [h.name for h in parse_hosts("64,32")] == ["rank 0", "rank 1"]
    assert parse_size("48GiB") == 48 * GiB and parse_size("64G") == 64 * GiB and parse_size("512MB") == 512 * MiB
    assert parse_size("1.5") == 1610612736 and parse_size("2tb") == 2 * 2**40


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("studio=lots", "'studio=lots' is not NAME=SIZE or SIZE"),
        ("64,,32", "'' is not NAME=SIZE"),
        ("64GB,-3", "'-3' is not NAME=SIZE"),
        ("9999999TB", "is over 1024 TiB"),
        (",".join(["1GB"] * 65), "65 hosts is more than the 64"),
        ("missing/hosts.json", "no such hostfile"),
    ],
)
def test_bad_hosts_option_is_one_line(value, words):
    with pytest.raises(HostsError, match=words) as e:
        parse_hosts(value)
    assert "\n" not in str(e.value) and isinstance(e.value, ConfigError)


def write(tmp_path: Path, data, name: str = "hosts.json") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_hostfile_in_mlx_form_with_our_fields(tmp_path):
    path = write(
        tmp_path,
        [
            {"ssh": "studio.local", "ips": ["192.168.1.2"], "memory_gb": 180, "link_gbps": 80, "python": "/opt/py"},
            {"ssh": "mbp.local", "ips": ["192.168.1.3"], "rdma": [None, "rdma_en2"]},
        ],
    )
    studio, mbp = read_hostfile(path)
    assert studio == Host("studio.local", "studio.local", ("192.168.1.2",), 180 * GiB, 80.0, "/opt/py")
    assert mbp == Host("mbp.local", "mbp.local", ("192.168.1.3",), None, None, None)
    # MLX's object form, too
    obj = write(tmp_path, {"backend": "ring", "envs": ["A=1"], "hosts": [{"ssh": "a", "memory_gb": 0.5}]}, "o.json")
    assert [h.memory_bytes for h in parse_hosts(str(obj))] == [GiB // 2]


def test_planning_needs_each_hosts_memory(tmp_path):
    path = write(tmp_path, [{"ssh": "a", "memory_gb": 8}, {"ssh": "b"}])
    with pytest.raises(HostsError, match=r"host 1 \(b\) has no memory_gb"):
        parse_hosts(str(path))


@pytest.mark.parametrize(
    ("data", "words"),
    [
        ("{not json", "not valid JSON"),
        ('[{"ssh": "a", "memory_gb": NaN}]', "not valid JSON"),
        ('[{"ssh": "a", "ssh": "b"}]', "appears twice"),
        ([], "expected a non-empty list of hosts"),
        ({"hosts": [{"ssh": "a"}], "extra": 1}, "unknown field 'extra'"),
        ([{"ssh": 5}], "host 0: ssh must be a non-empty printable string"),
        ([{"ssh": "a\nb"}], "ssh must be a non-empty printable string"),
        (["a"], "host 0: expected an object"),
        ([{"ssh": "a", "ips": "10.0.0.1"}], r"host 0 \(a\): ips must be a list of IPv4 addresses"),
        ([{"ssh": "a", "ips": ["mac.local"]}], "ips must be a list of IPv4 addresses"),
        ([{"ssh": "a", "ips": ["fe80::1"]}], r"IPv4 addresses .*MLX's ring backend connects over IPv4"),
        # ssh would read a host name starting with "-" as an option
        ([{"ssh": "-oProxyCommand=touch /tmp/x"}], r"host 0: ssh '-oProxyCommand=touch /tmp/x' is not a host name"),
        ([{"ssh": "a"}, {"ssh": "alice@-p22"}], r"host 1: ssh 'alice@-p22' is not a host name or address"),
        ([{"ssh": "mac 1.local"}], "is not a host name or address"),
        ([{"ssh": "mac1..local"}], "is not a host name or address"),
        ([{"ssh": "mac1;reboot"}], "is not a host name or address"),
        ([{"ssh": "[::1]"}], "is not a host name or address"),
        ([{"ssh": "10.0.0.256"}], "is not a host name or address"),
        ([{"ssh": "a", "memory_gb": "64GB"}], r"host 0 \(a\): memory_gb must be a number"),
        ([{"ssh": "a", "memory_gb": -1}], "memory_gb must be a number"),
        ([{"ssh": "a", "memory_gb": True}], "memory_gb must be a number"),
        ([{"ssh": "a", "link_gbps": 0}], "link_gbps must be"),
        ([{"ssh": "a", "python": ["python3"]}], "python must be"),
        ([{"ssh": "a", "memory": 64}], "unknown field 'memory'"),
        ([{"ssh": "a", "rdma": "rdma_en2"}], "rdma must be a list"),
        ([{"ssh": f"h{i}"} for i in range(65)], "65 hosts is more than the 64"),
    ],
)
def test_bad_hostfiles_are_one_line_naming_the_file(tmp_path, data, words):
    path = write(tmp_path, data)
    with pytest.raises(HostsError, match=words) as e:
        read_hostfile(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_hosts_are_named_as_ssh_spells_them(tmp_path):
    names = [
        "mac1.local",
        "Mac-Studio",
        "gpu_box",
        "localhost",
        "10.0.0.2",
        "fe80::1",
        "fe80::1%en0",
        "alice@mbp.local",
    ]
    hosts = read_hostfile(write(tmp_path, [{"ssh": name} for name in names]))
    assert [h.ssh for h in hosts] == names


# Reads /dev/zero, a named pipe with no writer and a folder as hostfiles, in a process whose memory is capped:
# each must be refused at once, not read without end (it grew to 4 GiB in 3 s) or waited on.
NOT_FILES = """
import json, os, resource, sys
from mlxinfer.distributed.hosts import HostsError, parse_hosts, read_hostfile
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
for read, path in [(read_hostfile, "/dev/zero"), (read_hostfile, sys.argv[1]), (parse_hosts, "/dev/zero"),
                   (parse_hosts, sys.argv[1]), (read_hostfile, os.path.dirname(sys.argv[1]))]:
    try:
        read(path)
    except HostsError as e:
        print(e, flush=True)
"""


def test_only_regular_files_are_read_as_hostfiles(tmp_path):
    fifo = tmp_path / "hosts.json"
    os.mkfifo(fifo)
    result = subprocess.run([sys.executable, "-c", NOT_FILES, str(fifo)], capture_output=True, text=True, timeout=60)
    refusal = ": not a regular file; a hostfile is a JSON file"
    paths = ["/dev/zero", str(fifo), "/dev/zero", str(fifo), str(tmp_path)]
    assert result.stdout.splitlines() == [path + refusal for path in paths], result.stderr[-2000:]


def test_plan_hosts_from_a_device_is_one_line(tmp_path):
    def capped() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    command = [sys.executable, "-c", "from mlxinfer.cli import main; main()", "plan", str(TINY / "llama_classic")]
    result = subprocess.run(
        [*command, "--hosts", "/dev/zero"], capture_output=True, text=True, timeout=60, preexec_fn=capped
    )
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert result.stderr.strip() == "Error: /dev/zero: not a regular file; a hostfile is a JSON file"


def test_oversized_and_binary_hostfiles_are_refused(tmp_path):
    big = write(tmp_path, json.dumps([{"ssh": "a" * 100}] * 1000), "big.json")
    assert big.stat().st_size > MAX_HOSTFILE_BYTES
    with pytest.raises(HostsError, match=f"more than the {MAX_HOSTFILE_BYTES}"):
        read_hostfile(big)
    binary = tmp_path / "bin.json"
    binary.write_bytes(b"\xff\xfe[]")
    with pytest.raises(HostsError, match="not UTF-8"):
        read_hostfile(binary)


def test_local_hostfile_is_loopback_ranks_that_read_back(tmp_path):
    hosts = local_hostfile(3)
    assert hosts == [{"ssh": "localhost", "ips": ["127.0.0.1"]}] * 3
    hosts[0]["ips"].append("x")  # each entry its own
    assert local_hostfile(2)[1]["ips"] == ["127.0.0.1"]
    back = read_hostfile(write(tmp_path, local_hostfile(2)))
    assert [(h.ssh, h.ips) for h in back] == [("localhost", ("127.0.0.1",))] * 2
    with pytest.raises(HostsError):
        local_hostfile(0)


# ---- estimate ----


def test_estimate_by_hand():
    # Two stages reading 1 GB each at 100 GB/s (10 ms each), 1e6 weights (compute negligible), an 8192-byte
    # hidden state over 40 Gb/s (5e9 B/s) links with 50 us latency.
    est = estimate_pipeline([StageLoad(10**9, 10**6)] * 2, StageLoad(0, 0), 8192, [40, 40], memory_gbps=100)
    hop = 50e-6 + 8192 / 5e9
    all_sum = 2 * 50e-6 + 8192 / 5e9  # ring of 2: each link sends 2 * (2 - 1) / 2 of the tensor
    assert est.decode_tps == pytest.approx(1 / (0.02 + hop + all_sum))
    assert [link.bytes_per_token for link in est.links] == [16384, 8192]  # hop + sum share, then sum share
    # TTFT of 512 tokens: compute bound (2 * 1e6 * 512 / 3e12 per stage) vs 10 ms of reading: reading wins
    assert est.ttft_s == pytest.approx(0.02 + 50e-6 + 512 * 8192 / 5e9 + 2 * 50e-6 + 512 * 8192 / 5e9)
    one = estimate_pipeline([StageLoad(10**9, 10**6)], StageLoad(0, 0), 8192, [40])
    assert one.links == () and one.decode_tps == pytest.approx(100)


# ---- mlxinfer plan --hosts ----


def checkpoint_bytes(folder: Path, element_bytes: int = 2) -> dict[str, int]:
    """Every tensor's bytes once loaded in half precision, read with MLX (not the code under test)."""
    return {name: a.size * element_bytes for name, a in mx.load(str(folder / "model.safetensors")).items()}


def plan_json(*args: str) -> dict:
    result = CliRunner().invoke(main, ["plan", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize("family", ["llama_classic", "smollm3"])
def test_plan_hosts_splits_every_layer_and_counts_every_byte(family):
    folder = TINY / family
    config = json.loads((folder / "config.json").read_text())
    tensors = checkpoint_bytes(folder)
    shared = sum(n for name, n in tensors.items() if not name.startswith("model.layers."))
    plan = plan_json(str(folder), "--hosts", "1GB,1GB")
    hosts = plan["hosts"]
    assert sum(h["layers"] for h in hosts) == config["num_hidden_layers"] and min(h["layers"] for h in hosts) >= 1
    assert hosts[0]["start"] == 0 and hosts[0]["end"] == hosts[1]["start"]
    assert sum(h["weights_bytes"] for h in hosts) == sum(tensors.values()) + shared  # shared held twice
    assert plan["shared_weights_bytes"] == shared and plan["estimate"] is True


def test_plan_hosts_kv_cache_per_host_at_the_context():
    # llama_classic: 2 layers, 2 KV heads of 16 dims; at 512 tokens each layer holds 2 * 2 * 16 * 512 * 2 bytes.
    hosts = plan_json(str(TINY / "llama_classic"), "--hosts", "1GB,1GB", "--context", "512")["hosts"]
    assert [h["kv_bytes"] for h in hosts] == [65536, 65536]
    longer = plan_json(str(TINY / "llama_classic"), "--hosts", "1GB,1GB", "--context", "1000")["hosts"]
    assert [h["kv_bytes"] for h in longer] == [2 * 2 * 16 * 1024 * 2] * 2  # the cache grows 256 positions at a time
    # the single-host planner's rule: a quantized KV cache needs head_dim a multiple of 64
    result = CliRunner().invoke(main, ["plan", str(TINY / "llama_classic"), "--hosts", "1GB,1GB", "--kv-bits", "8"])
    assert result.exit_code == 1 and "head_dim 16 is not a multiple of 64" in result.stderr


def test_plan_hosts_reads_a_gguf_from_its_header_alone(tmp_path, monkeypatch):
    from mlxinfer.formats.gguf_file import GGUFFile
    from tests.test_gguf import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "tiny.gguf")  # the llama_classic tensors, as float32
    expected = sum(checkpoint_bytes(TINY / "llama_classic").values())

    def refuse(*args, **kwargs):
        raise AssertionError("plan --hosts read tensor data")

    monkeypatch.setattr(GGUFFile, "read", refuse)
    monkeypatch.setattr(mx, "load", refuse)
    plan = plan_json(str(path), "--hosts", "a=1GB,b=2GB")
    assert plan["checkpoint_weights_bytes"] == expected
    assert [h["name"] for h in plan["hosts"]] == ["a", "b"] and sum(h["layers"] for h in plan["hosts"]) == 2


def test_plan_hosts_prints_the_table_links_and_estimate(tmp_path):
    hostfile = write(tmp_path, [{"ssh": "studio", "memory_gb": 2, "link_gbps": 80}, {"ssh": "mbp", "memory_gb": 1}])
    result = CliRunner().invoke(main, ["plan", str(TINY / "smollm3"), "--hosts", str(hostfile)])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "host" in out and "headroom" in out and "studio" in out and "mbp" in out
    assert "studio -> mbp: 80 Gb/s" in out and "mbp -> studio: 40 Gb/s" in out
    assert "tokens/s" in out and "512-token prompt" in out and "estimates, not measurements" in out


def test_plan_a_host_too_small_fails_in_one_line():
    result = CliRunner().invoke(main, ["plan", str(TINY / "llama_classic"), "--hosts", "big=1GB,small=1MB"])
    assert result.exit_code != 0
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and "small" in errors[0] and "Traceback" not in result.output


def test_plan_link_options_need_hosts():
    result = CliRunner().invoke(main, ["plan", str(TINY / "llama_classic"), "--link-gbps", "80"])
    assert result.exit_code == 2 and "--hosts" in result.stderr


def test_plan_default_ttft_grows_with_a_slower_memory():
    fast = plan_json(str(TINY / "smollm3"), "--hosts", "1GB,1GB", "--memory-gbps", "800")
    slow = plan_json(str(TINY / "smollm3"), "--hosts", "1GB,1GB", "--memory-gbps", "100")
    assert slow["decode_tps"] < fast["decode_tps"] and slow["memory_gbps"] == 100
    assert math.isfinite(slow["ttft_s"]) and slow["ttft_s"] > fast["ttft_s"]
