"""Speculative decoding where users meet it: the CLI flags, load(draft_model=), the server's jobs and /metrics."""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

import mlxinfer
from mlxinfer.cli import main
from mlxinfer.engine import Delta, Job, SchedulerConfig
from mlxinfer.errors import DraftModelError
from mlxinfer.server import ModelSet, ServerSettings
from mlxinfer.server.uvicorn_host import BackgroundServer
from tests.conftest import TINY

TARGET = TINY / "llama_classic"
OTHER = TINY / "mistral"  # same tokenizer, other weights: its drafts are mostly rejected
PROMPT = ["-p", "the cat the cat the cat", "--raw", "--max-tokens", "30", "--json"]


def run(*args: str | Path):
    return CliRunner().invoke(main, [str(a) for a in args])


def generated(*flags: str | Path) -> dict:
    result = run("generate", TARGET, *PROMPT, *flags)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.fixture
def other_tokenizer(tiny_copy) -> Path:
    """The target's files, but a tokenizer with one more added token (a model of another family, in miniature)."""
    folder = tiny_copy("llama_classic")
    spec = json.loads((folder / "tokenizer.json").read_text())
    extra = max(token["id"] for token in spec["added_tokens"]) + 1
    spec["added_tokens"].append({**spec["added_tokens"][-1], "id": extra, "content": "<|draft_only|>"})
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    return folder


def test_generate_speculating_prints_what_plain_decoding_prints():
    plain = generated("--speculate", "off")
    assert plain["stats"]["generated_tokens"] == 30 and not plain["stats"]["speculation"]
    for flags, drafter in [
        (("--speculate", "lookup"), "lookup"),
        (("--speculate", "draft", "--draft-model", OTHER), "draft"),  # rejections: the target's token wins
        (("--draft-model", TARGET), "draft"),  # auto with a draft model drafts with it
    ]:
        speculated = generated(*flags)
        assert speculated["text"] == plain["text"], flags
        assert speculated["stats"]["speculation"] == drafter, flags
    drafted = generated("--speculate", "draft", "--draft-model", OTHER)["stats"]
    assert drafted["drafted_tokens"] > drafted["accepted_tokens"]  # the case above did reject drafts
    itself = generated("--speculate", "draft", "--draft-model", TARGET)["stats"]
    assert itself["acceptance_rate"] == 1.0 and itself["tokens_per_step"] > 1  # a model agrees with itself


def test_generate_prints_the_speculation_numbers_with_its_stats():
    result = run("generate", TARGET, *PROMPT[:-1], "--speculate", "draft", "--draft-model", TARGET)
    assert result.exit_code == 0, result.output
    assert re.search(r"speculation: draft \(100% of \d+ drafts kept, \d+\.\d\d tokens per step\)", result.stderr)


def test_speculation_flag_errors_are_one_line(other_tokenizer):
    cases = [
        (["generate", TARGET, "-p", "x", "--speculate", "sometimes"], "'sometimes' is not one of", 2),
        (["generate", TARGET, "-p", "x", "--speculate", "draft"], "needs a draft model", 2),
        (["chat", TARGET, "--speculate", "draft"], "needs a draft model", 2),
        (["serve", TARGET, "--port", "0", "--speculate", "draft"], "needs a draft model", 1),
        (["generate", TARGET, "-p", "x", "--draft-model", other_tokenizer], "its tokenizer differs", 1),
        (["serve", TARGET, "--port", "0", "--draft-model", other_tokenizer], "its tokenizer differs", 1),
        # a draft model that would never draft: refused before anything loads
        (["generate", TARGET, "-p", "x", "--speculate", "off", "--draft-model", OTHER], "never drafts with", 2),
        (["chat", TARGET, "--speculate", "lookup", "--draft-model", OTHER], "never drafts with", 2),
        (["serve", TARGET, "--port", "0", "--speculate", "off", "--draft-model", OTHER], "never drafts with", 1),
    ]
    for args, words, code in cases:
        result = run(*args)
        assert result.exit_code == code, (args, result.output)
        errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
        assert len(errors) == 1 and words in errors[0], (args, result.stderr)


def test_load_with_a_draft_model_of_another_tokenizer_names_both(other_tokenizer):
    with pytest.raises(DraftModelError) as caught:
        mlxinfer.load(TARGET, draft_model=other_tokenizer)
    message = str(caught.value)
    assert str(other_tokenizer) in message and str(TARGET) in message and "\n" not in message


def test_a_reloaded_model_keeps_its_draft_model_and_mode():
    models = ModelSet()
    try:
        served = models.add(mlxinfer.load(TARGET, draft_model=OTHER, speculate="draft"), SchedulerConfig())
        models.unload(served.id)
        reloaded = models.get(served.id).model
        assert reloaded.speculate == "draft" and reloaded.draft is not None and reloaded.draft.path == OTHER
    finally:
        models.close()


# Token-id prompts for the tiny model, greedy: A repeats itself (prompt lookup drafts at every step and the
# target keeps the drafts); B's prompt and answer never repeat a pair of tokens (lookup never drafts).
ROW_A, TOKENS_A = [81] * 8, 64
ROW_B, TOKENS_B = [225, 19, 51, 237, 148, 59], 40
DRAFTED = "mlxinfer_speculative_drafted_tokens_total"
ACCEPTED = "mlxinfer_speculative_accepted_tokens_total"
WITHOUT_DRAFT = 'mlxinfer_speculation_plain_batch_steps{reason="row_without_draft"}'
SEEDED = 'mlxinfer_speculation_off_total{reason="seeded"}'
COUNTERS = (DRAFTED, ACCEPTED, WITHOUT_DRAFT, SEEDED)


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def streamed(url: str, model: str, ids: list[int], max_tokens: int, **extra) -> str:
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True, **extra}
    text = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                text += [choice["text"] for choice in json.loads(line[6:])["choices"]]
    return "".join(text)


def pairs_repeat(ids: list[int]) -> bool:
    pairs = list(zip(ids, ids[1:]))
    return len(set(pairs)) < len(pairs)


@pytest.mark.slow
def test_server_speculates_in_the_batch_answers_the_same_and_counts_it():
    plain = mlxinfer.load(TARGET, speculate="off")  # the reference answers: no speculation
    answer_a, answer_b = (plain.generate(ids, max_tokens=n) for ids, n in ((ROW_A, TOKENS_A), (ROW_B, TOKENS_B)))
    assert len(answer_b.token_ids) == TOKENS_B and not pairs_repeat(ROW_B + answer_b.token_ids)  # B cannot draft
    models = ModelSet()
    served = models.add(mlxinfer.load(TARGET, speculate="lookup"), SchedulerConfig(max_batch=4))
    models.add(mlxinfer.load(TARGET), SchedulerConfig(), name="auto")
    holding, release = threading.Event(), threading.Event()

    def hold(event) -> None:  # on the scheduler's thread: A and B queue meanwhile, so they decode together
        if isinstance(event, Delta):
            holding.set()
            release.wait(60)

    try:
        with BackgroundServer(models, ServerSettings(port=0)) as running:
            url, scheduler = running.url, served.scheduler
            before = {name: metric(url, name) for name in COUNTERS}
            scheduler.submit(Job(plain.encode_prompt("hi"), hold, max_tokens=2))
            assert holding.wait(60)  # out of the inbox: the queue count below is A and B alone
            with ThreadPoolExecutor(2) as pool:
                a = pool.submit(streamed, url, served.id, ROW_A, TOKENS_A)
                b = pool.submit(streamed, url, served.id, ROW_B, TOKENS_B)
                deadline = time.monotonic() + 30
                while len(scheduler._inbox) + scheduler.queued < 2 and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert len(scheduler._inbox) + scheduler.queued == 2
                release.set()
                assert (a.result(), b.result()) == (answer_a.text, answer_b.text)
            streamed(url, "auto", ROW_B, 4, temperature=0.8, seed=1)  # auto keeps a seeded sampled answer plain
            after = {name: metric(url, name) for name in COUNTERS}
    finally:
        models.close()
    assert after[DRAFTED] > before[DRAFTED] and after[ACCEPTED] > before[ACCEPTED]
    assert after[WITHOUT_DRAFT] > before[WITHOUT_DRAFT]  # A had drafts while B, beside it, had none
    assert after[SEEDED] == before[SEEDED] + 1


def test_server_counts_auto_leaving_its_draft_model_out_and_the_draft_models_prefix_bytes():
    from tests.test_speculative_draft_prompt import CPU_SAME_SIZE, learned

    slower = 'mlxinfer_draft_model_not_used_total{reason="slower"}'
    known_slow = mlxinfer.load(TARGET, draft_model=TARGET)
    known_slow._step_costs = learned(*CPU_SAME_SIZE)  # as if timed on a CPU: a same-size draft model cannot pay
    models = ModelSet()
    models.add(known_slow, SchedulerConfig(), name="slow")
    fresh = models.add(mlxinfer.load(TARGET, draft_model=TARGET), SchedulerConfig(), name="fresh")
    try:
        with BackgroundServer(models, ServerSettings(port=0)) as running:
            url = running.url
            before = metric(url, slower)
            streamed(url, "slow", ROW_A, 4)
            assert metric(url, slower) == before + 1
            assert known_slow.runtime.draft.prefix_cache.stats.bytes_held == 0  # it never read the prompt
            streamed(url, "fresh", ROW_A, 4)  # its draft model reads the prompt and keeps it
            draft_held = fresh.model.runtime.draft.prefix_cache.stats.bytes_held
            targets_held = sum(m.prefix_cache.stats.bytes_held for m in (known_slow, fresh.model))
            assert draft_held > 0 and metric(url, "mlxinfer_prefix_cache_bytes") == targets_held + draft_held
    finally:
        models.close()
