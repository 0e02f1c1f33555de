"""The ranks after 0: turn the same loop on rank 0's turn records until rank 0 stops or is gone."""

from __future__ import annotations

from typing import Any

from ..engine import BatchLoop, Delta, Job, ModelRuntime, SchedulerConfig
from .channel import Channel
from .replay import apply_turn, job_from_spec, replayable


def follow(runtime: ModelRuntime, config: SchedulerConfig, channel: Channel, vocab_size: int) -> None:
    """Run rank 0's turns here; returns when rank 0 stops serving, raises when it is gone."""
    loop = BatchLoop(replayable(runtime), config, log_failures=False)
    loop.admission.agree = channel.all_true
    jobs: dict[int, Job] = {}
    ended: list[int] = []
    while True:
        record = channel.receive()
        cancelled = {i: jobs[i] for i in record["cancelled"] if i in jobs}
        new = []
        for spec in record["jobs"]:
            job = jobs[spec["id"]] = job_from_spec(spec, runtime, vocab_size)
            job.on_event = _ending(ended, spec["id"])  # rank 0 answers the client; here only the end matters
            new.append(job)
        if not apply_turn(loop, record, cancelled, new):
            return
        for i in ended:
            jobs.pop(i, None)
        ended.clear()


def _ending(ended: list[int], job_id: int) -> Any:
    def on_event(event: Any) -> None:
        if not isinstance(event, Delta):
            ended.append(job_id)

    return on_event
