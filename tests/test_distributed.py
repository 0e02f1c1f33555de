"""One model over several ranks (mx.distributed, ring backend over loopback): the server's answers must be the
single process's, token for token, and a lost rank must end requests with an error rather than hang."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

import mlxinfer
from mlxinfer.engine import Job, SamplingParams
from mlxinfer.grammar import constraint_for, regex
from mlxinfer.models.shard import Stage, select_weights

from .conftest import TINY

PROMPTS = ["hello world, the", "Once upon a time", "1, 2, 3, 4,"]
CLI = [sys.executable, "-c", "from mlxinfer.cli import main; main()"]


def _hostfile(tmp_path: Path, ranks: int) -> Path:
    path = tmp_path / f"hosts{ranks}.json"
    path.write_text(json.dumps([{"ssh": "localhost", "ips": ["127.0.0.1"]}] * ranks))
    return path


@contextlib.contextmanager
def served(
    model: Path, hostfile: Path, parallel: str = "pipeline", *options: str, timeout: float = 240.0, cli: list = CLI
):
    """`mlxinfer serve MODEL --hostfile` (run by `cli`) in its own process group; yields (base URL, process)."""
    command = [*cli, "serve", str(model), "--hostfile", str(hostfile)]
    command += ["--parallel", parallel, "--port", "0", "--stall-timeout", "30", *options]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, start_new_session=True)
    lines: list[str] = []
    found = threading.Event()

    def read() -> None:
        for line in process.stderr:
            lines.append(line)
            if "Serving " in line:
                found.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        deadline = time.monotonic() + timeout
        while not found.wait(0.2):
            assert process.poll() is None, "serve exited:\n" + "".join(lines)
            assert time.monotonic() < deadline, "serve did not start:\n" + "".join(lines)
        url = re.search(r"on (http://\S+)/v1", next(line for line in lines if "Serving " in line)).group(1)
        yield url, process
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(30)


def _post(url: str, body: dict, timeout: float = 120.0) -> dict:
    request = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.load(response)


def _complete(url: str, prompt: str, max_tokens: int = 12) -> dict:
    return _post(url, {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})


def _one_process(model: Path, prompts: list[str], max_tokens: int = 12) -> list[str]:
    llm = mlxinfer.load(model)
    return [llm.generate(p, max_tokens=max_tokens, chat=False).text for p in prompts]


CASES = [
    ("pipeline", "llama_classic", 2),
    ("pipeline", "qwen3", 2),
    ("pipeline", "mistral", 2),
    ("pipeline", "qwen3_moe", 3),
    # Layers of different kinds: sliding + full attention, convolution, Gated DeltaNet, Mamba-2, MoE + sinks.
    ("pipeline", "gemma3", 3),
    ("pipeline", "lfm2", 2),
    ("pipeline", "qwen3_next", 2),
    ("pipeline", "granitemoehybrid", 2),
    ("pipeline", "gpt_oss", 2),
    ("tensor", "llama_classic", 2),
    ("tensor", "qwen3", 2),
    ("tensor", "gemma3", 2),
]


@pytest.mark.slow
@pytest.mark.parametrize("parallel,family,ranks", CASES, ids=[f"{p}-{f}-{n}" for p, f, n in CASES])
def test_greedy_answers_equal_one_process(parallel, family, ranks, tmp_path):
    expected = _one_process(TINY / family, PROMPTS)
    # 3-token prefill steps: every prompt takes several passes (and state snapshots where layers need them).
    with served(TINY / family, _hostfile(tmp_path, ranks), parallel, "--prefill-chunk", "3") as (url, _):
        alone = _complete(url, PROMPTS[0])
        with ThreadPoolExecutor(len(PROMPTS)) as pool:  # decoding together, in one batch on every rank
            together = list(pool.map(lambda p: _complete(url, p), PROMPTS))
        health = json.load(urllib.request.urlopen(url + "/health", timeout=30))
    assert alone["choices"][0]["text"] == expected[0]
    assert [r["choices"][0]["text"] for r in together] == expected
    assert health["status"] == "ok"
    if family in ("llama_classic", "qwen3", "mistral", "qwen3_moe"):  # one kind of layer: the prefix cache is on
        assert together[0]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


@pytest.mark.slow
def test_ranks_holding_one_kind_of_layer_snapshot_where_the_whole_model_does(tmp_path):
    # gpt-oss alternates sliding and full layers: over 4 ranks, ranks 1 and 3 hold only full (cuttable) ones. The
    # end-of-turn tokens in the prompt are snapshot points for the whole model: every rank must stop there too.
    ids = [*range(10, 20), 258, *range(30, 40), 258, *range(50, 56)]
    expected = mlxinfer.load(TINY / "gpt_oss").generate(ids, max_tokens=12).text
    with served(TINY / "gpt_oss", _hostfile(tmp_path, 4)) as (url, _):
        answers = [_post(url, {"prompt": ids, "max_tokens": 12, "temperature": 0}) for _ in range(2)]
    assert [a["choices"][0]["text"] for a in answers] == [expected, expected]
    # Rank 0 holds one kind of layer, the model two: the prefix cache must be off on every rank.
    assert answers[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_real_model_from_two_ranks_answers_through_the_openai_client(smol_path, tmp_path):
    openai = pytest.importorskip("openai")
    question = [{"role": "user", "content": "What is the capital of France?"}]
    expected = mlxinfer.load(smol_path).chat(question, max_tokens=12).text
    with served(smol_path, _hostfile(tmp_path, 2)) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        answer = client.chat.completions.create(
            model=smol_path.name.removesuffix(".gguf"), messages=question, max_tokens=12, temperature=0
        )
    assert "Paris" in answer.choices[0].message.content
    assert answer.choices[0].message.content == expected


def _stream_with_a_stopped_rank(url: str, follower: psutil.Process, then=None) -> tuple[list[str], float]:
    """Stream a completion while `follower` is suspended, so its first turn is in flight and cannot end (acting
    after some tokens raced: on a busy machine the whole answer could be sent before the client read a token).
    `then(follower)` runs once the stream has started. Returns the events' data and the seconds the stream took."""
    body = {"prompt": "hello", "max_tokens": 32, "temperature": 0, "stream": True}
    request = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    follower.suspend()
    try:
        events, started = [], time.monotonic()
        with urllib.request.urlopen(request, timeout=60) as stream:  # headers come once the job is submitted
            if then is not None:
                then(follower)
            for raw in stream:
                line = raw.decode().strip()
                if line.startswith("data: "):
                    events.append(line[6:])
        return events, time.monotonic() - started
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            follower.resume()


@pytest.mark.slow
def test_killing_a_rank_mid_stream_ends_the_stream_with_an_error_and_health_says_unhealthy(tmp_path):
    with served(TINY / "llama_classic", _hostfile(tmp_path, 2)) as (url, process):
        follower = psutil.Process(process.pid).children()[0]
        events, took = _stream_with_a_stopped_rank(url, follower, then=psutil.Process.kill)
        assert took < 60
        assert process.poll() is None  # rank 0 keeps serving: it answers that it cannot
        assert '"error"' in events[-2] and "rank" in events[-2] and events[-1] == "[DONE]", events[-3:]
        with pytest.raises(urllib.error.HTTPError) as health:
            urllib.request.urlopen(url + "/health", timeout=30)
        assert health.value.code == 503
        assert json.load(health.value)["status"] == "unhealthy"
        with pytest.raises(urllib.error.HTTPError) as refused:
            _complete(url, "hello")
        assert refused.value.code == 503


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["pipeline", "tensor"])
def test_embeddings_are_refused_and_the_server_goes_on(parallel, tmp_path):
    expected = _one_process(TINY / "llama_classic", PROMPTS[:1])
    with served(TINY / "llama_classic", _hostfile(tmp_path, 2), parallel) as (url, _):
        request = urllib.request.Request(
            url + "/v1/embeddings", json.dumps({"input": "hello"}).encode(), {"Content-Type": "application/json"}
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=60)
        after = _complete(url, PROMPTS[0])
    assert refused.value.code == 400 and "ranks" in json.load(refused.value)["error"]["message"]
    assert after["choices"][0]["text"] == expected[0]


@pytest.mark.slow
def test_a_rank_that_stops_answering_ends_the_stream_after_the_stall_timeout(tmp_path):
    hosts = _hostfile(tmp_path, 2)
    with served(TINY / "llama_classic", hosts, "pipeline", "--stall-timeout", "5") as (url, process):
        follower = psutil.Process(process.pid).children()[0]
        events, took = _stream_with_a_stopped_rank(url, follower)  # alive, holding its sockets, answering nothing
        with pytest.raises(urllib.error.HTTPError) as health:
            urllib.request.urlopen(url + "/health", timeout=30)
        assert took < 40
        assert "not answered" in events[-2] and '"error"' in events[-2] and events[-1] == "[DONE]", events[-3:]
        assert health.value.code == 503 and "not answered" in json.load(health.value)["reason"]


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["pipeline", "tensor"])
def test_a_model_whose_layers_share_a_pass_is_refused_in_one_line(parallel, tmp_path):
    command = [*CLI, "serve", str(TINY / "gemma4"), "--hostfile", str(_hostfile(tmp_path, 2))]
    result = subprocess.run(
        [*command, "--parallel", parallel, "--port", "0"], capture_output=True, text=True, timeout=240
    )
    assert result.returncode != 0
    errors = re.findall(r"Error: [^\n]*", result.stderr)  # rank 1 says it too, on the same terminal
    assert len(errors) == 1 and "one machine" in errors[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def test_a_stage_keeps_its_own_layers_renamed_and_the_shared_tensors():
    weights = {f"model.layers.{i}.mlp.up_proj.weight": i for i in range(6)}
    weights |= {"model.embed_tokens.weight": "e", "model.norm.weight": "n", "lm_head.weight": "h"}
    kept = select_weights(weights, Stage(rank=1, size=3, start=2, end=4, total=6))
    layers = {k: v for k, v in kept.items() if k.startswith("model.layers.")}
    assert layers == {"model.layers.0.mlp.up_proj.weight": 2, "model.layers.1.mlp.up_proj.weight": 3}
    assert {k: kept[k] for k in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")} == {
        "model.embed_tokens.weight": "e",
        "model.norm.weight": "n",
        "lm_head.weight": "h",
    }
    assert len(kept) == 5


def test_a_job_travels_to_another_rank_with_every_input():
    from mlxinfer.distributed.replay import job_from_spec, job_spec

    llm = mlxinfer.load(TINY / "llama_classic")
    runtime = llm.runtime
    grammar = regex("[a-z]{3}")

    constraint = constraint_for(grammar, llm.tokenizer, llm.config.vocab_size, llm.eos_token_ids)
    job = Job(
        [1, 2, 3], lambda e: None, max_tokens=7, sampling=SamplingParams(temperature=0.5, top_k=3, seed=9),
        stop=["x"], time_limit_s=12.5, prefill_chunk=16, eos_token_ids=frozenset({5}), use_cache=False,
        constraint=constraint, keep_special_tokens=True, submitted_at=3.25,
    )  # fmt: skip
    spec = json.loads(json.dumps(job_spec(job, 4)))  # it crosses as JSON
    twin = job_from_spec(spec, runtime, llm.config.vocab_size)
    for name in ("prompt_ids", "max_tokens", "sampling", "time_limit_s", "prefill_chunk", "eos_token_ids"):
        assert getattr(twin, name) == getattr(job, name), name
    assert list(twin.stop) == ["x"] and twin.use_cache is False and twin.keep_special_tokens is True
    assert twin.submitted_at == 3.25 and twin.constraint.grammar == grammar


def test_a_request_runs_only_where_every_rank_has_room():
    from mlxinfer.engine import BatchLoop, Failed, Finished, SchedulerConfig
    from mlxinfer.errors import MemoryBudgetError

    llm = mlxinfer.load(TINY / "llama_classic")
    verdicts = []

    def run(others_have_room: bool) -> object:
        loop = BatchLoop(llm.runtime, SchedulerConfig(max_batch=2))
        loop.admission.agree = lambda mine: verdicts.append(mine) or (mine and others_have_room)
        events = []
        loop.add(Job(llm.encode_prompt("hello", chat=False), events.append, max_tokens=4))
        while loop.has_work():
            loop.turn()
        return events[-1]

    assert isinstance(run(True), Finished)
    assert verdicts and all(verdicts)  # this rank had room each time it was asked
    ended = run(False)  # another rank has none: the request never starts here either
    assert isinstance(ended, Failed) and isinstance(ended.error, MemoryBudgetError)
