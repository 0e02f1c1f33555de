"""A stopped answer (Ctrl-C in `chat`, Stop on the chat page) keeps the conversation's computed prefix."""

from __future__ import annotations

import threading

import pytest
from click.testing import CliRunner

from mlxinfer.api import Model
from mlxinfer.cli import main
from mlxinfer.engine import Finished, Job, SchedulerConfig, ServingThread
from mlxinfer.models.decoder import DecoderLM
from tests.conftest import TINY
from tests.test_interrupt import interrupt_on_call, no_pins

QUESTIONS = ["What is the capital of France?", "And of Italy?"]


def chat_stopped_once(monkeypatch, model: str, method: str, at: int, prefill_chunk_tokens: int = 512):
    """Two chat turns through the CLI, the first one stopped by Ctrl-C; returns the result and the runs."""
    runs = []
    stream = Model.stream

    def recorded(self, *args, **options):
        if not runs:  # counted from the first turn: loading runs the model on probes too
            interrupt_on_call(monkeypatch, method, at)
        run = stream(self, *args, **{**options, "prefill_chunk_tokens": prefill_chunk_tokens})
        runs.append((self, run))
        return run

    monkeypatch.setattr(Model, "stream", recorded)
    result = CliRunner().invoke(main, ["chat", model, "--max-tokens", "4"], input="\n".join(QUESTIONS) + "\n")
    assert result.exit_code == 0, result.output
    assert result.stdout.count("[stopped]") == 1
    return result, runs


def check_second_turn_reuses_the_cut(result, runs, kept: int, tolerance: int) -> None:
    """The second turn reuses the `kept` positions the first computed, as far as the tokenizer's ids of it agree."""
    (llm, first), (_, second) = runs
    shown_answer = result.stdout.split(">>> ")[1].removeprefix(QUESTIONS[0] + "\n").split(" [stopped]")[0]
    turns = [{"role": "user", "content": QUESTIONS[0]}, {"role": "assistant", "content": shown_answer}]
    prompt = llm.tokenizer.encode_chat([*turns, {"role": "user", "content": QUESTIONS[1]}])
    assert list(second.request.prompt_ids) == prompt  # the history holds the cut answer as it was shown
    computed = list(first.request.prompt_ids) + first.ids
    same = next((i for i, (a, b) in enumerate(zip(computed, prompt)) if a != b), len(computed))
    reused = min(same, kept)
    assert reused >= kept - tolerance
    assert second.stats.cached_tokens == reused
    stats = [line for line in result.stderr.splitlines() if "prompt tokens" in line]
    assert f"({reused} cached)" in stats[-1]  # the second turn's stats line
    # The kept keys and values are right, not just present: the same answer as without any cache.
    assert second.ids == llm.generate(prompt, max_tokens=4, use_cache=False).token_ids
    assert no_pins(llm)


@pytest.mark.parametrize("method,at,chunk", [("__call__", 3, 512), ("hidden", 2, 8)], ids=["decode", "prefill"])
def test_chat_reuses_the_stopped_turn(monkeypatch, tmp_path, method, at, chunk):
    monkeypatch.setenv("MLXINFER_CACHE_DIR", str(tmp_path))
    result, runs = chat_stopped_once(monkeypatch, str(TINY / "llama_classic"), method, at, chunk)
    first = runs[0][1]
    if method == "__call__":
        # The prompt and two answer tokens; the last one may be lost: the tiny model draws random bytes,
        # and an incomplete character is held back, not shown, so not in the history.
        assert len(first.ids) == 2
        check_second_turn_reuses_the_cut(result, runs, len(first.request.prompt_ids) + 2, tolerance=1)
    else:
        assert first.ids == []
        check_second_turn_reuses_the_cut(result, runs, chunk, tolerance=0)  # the one chunk that ran


def test_real_model_chat_reuses_the_stopped_turn(monkeypatch, tmp_path, smol_path):
    monkeypatch.setenv("MLXINFER_CACHE_DIR", str(tmp_path))
    result, runs = chat_stopped_once(monkeypatch, str(smol_path), "__call__", 3)
    assert "The capital [stopped]" in result.stdout
    first = runs[0][1]
    # Real text re-encodes to the ids it was decoded from: the whole prompt and both answer tokens are reused.
    check_second_turn_reuses_the_cut(result, runs, len(first.request.prompt_ids) + len(first.ids), tolerance=0)


def test_request_cancelled_during_its_prefill_keeps_the_chunks_run(tiny_llama, monkeypatch):
    tiny_llama.prefix_cache.clear()
    prompt = [(i * 11) % 250 + 3 for i in range(60)]
    ended = threading.Event()
    job = Job(prompt, lambda event: isinstance(event, Finished) and ended.set(), max_tokens=4)
    hidden = DecoderLM.hidden
    calls = {"n": 0}

    def cancel_in_third_chunk(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            job.cancel()  # the Stop button: seen at the scheduler's next turn, after this chunk
        return hidden(self, *args, **kwargs)

    monkeypatch.setattr(DecoderLM, "hidden", cancel_in_third_chunk)
    scheduler = ServingThread(tiny_llama.runtime, SchedulerConfig(prefill_chunk=8))
    try:
        scheduler.submit(job)
        assert ended.wait(60)
    finally:
        scheduler.stop()
    assert job.stats.finish_reason == "cancelled"
    again = tiny_llama.generate(prompt, max_tokens=4)
    assert again.stats.cached_tokens == 3 * 8  # the three chunks of 8 that ran
    assert again.token_ids == tiny_llama.generate(prompt, max_tokens=4, use_cache=False).token_ids
