"""Every rank turns the same generation loop; rank 0 decides what each turn starts from.

Rank 0's ServingThread takes requests as always. Before each turn it sends the other
ranks a turn record: the new requests, the ones cancelled since, and rank 0's clock
(expiry). Each rank then turns its own BatchLoop (engine/loop.py, the one loop every
generation runs through) on the same inputs, so admissions, prefill chunks, batch
rows and prefix-cache hits match and every collective in the forward passes meets
its partners. Nothing else may steer a turn: requests are seeded by rank 0,
speculation is off, and a request is admitted only where it fits on every rank
(the loop's `admission.agree`: one collective per admission).

A lost rank surfaces as an exception from a collective (the ring backend's
"connection to a peer was lost"), or as a turn that never ends (a watchdog): either
way the requests end with a ClusterError event and the scheduler stays broken, so
the server answers 503 and /health says unhealthy.
"""

from __future__ import annotations

import logging
import math
import secrets
import threading
import time
from dataclasses import asdict, replace
from typing import Any

from ..engine import BatchLoop, Delta, Failed, Job, ModelRuntime, SamplingParams, SchedulerConfig, ServingThread
from ..errors import ClusterError, ShutdownError
from ..grammar import Grammar, constraint_for
from .channel import Channel

log = logging.getLogger("mlxinfer.distributed")

HEARTBEAT_S = 1.0  # an idle rank 0 sends an empty turn this often, so a lost rank shows within about this
STALL_S = 120.0  # a turn longer than this means a rank stopped answering


def job_spec(job: Job, job_id: int) -> dict[str, Any]:
    """What another rank needs to run `job` exactly as rank 0 does."""
    constraint = job.constraint
    grammar = constraint.grammar if constraint is not None else None
    return {
        "id": job_id,
        "prompt_ids": list(job.prompt_ids),
        "max_tokens": job.max_tokens,
        "sampling": asdict(job.sampling),
        "stop": list(job.stop),
        "time_limit_s": None if math.isinf(job.time_limit_s) else job.time_limit_s,
        "prefill_chunk": job.prefill_chunk,
        "snapshot_every": job.snapshot_every,
        "eos_token_ids": None if job.eos_token_ids is None else sorted(job.eos_token_ids),
        "use_cache": job.use_cache,
        "warm": job.warm,
        "grammar": None if grammar is None else [grammar.kind, grammar.text, grammar.where],
        "keep_special_tokens": job.keep_special_tokens,
        "submitted_at": job.submitted_at,
    }


def job_from_spec(spec: dict[str, Any], runtime: ModelRuntime, vocab_size: int) -> Job:
    """Rank 0's job on another rank, with the same inputs (its events go nowhere until the caller says)."""
    grammar = spec["grammar"]
    eos = frozenset(spec["eos_token_ids"]) if spec["eos_token_ids"] is not None else None
    constraint = None
    if grammar is not None:
        constraint = constraint_for(Grammar(*grammar), runtime.tokenizer, vocab_size, sorted(runtime.eos_token_ids))
    limit = spec["time_limit_s"]
    return Job(
        prompt_ids=spec["prompt_ids"],
        on_event=_dropped,
        max_tokens=spec["max_tokens"],
        sampling=SamplingParams(**spec["sampling"]),
        stop=spec["stop"],
        time_limit_s=math.inf if limit is None else limit,
        prefill_chunk=spec["prefill_chunk"],
        snapshot_every=spec["snapshot_every"],
        eos_token_ids=eos,
        use_cache=spec["use_cache"],
        warm=spec["warm"],
        constraint=constraint,
        keep_special_tokens=spec["keep_special_tokens"],
        submitted_at=spec["submitted_at"],
    )


def _dropped(event: Any) -> None:
    pass


def replayable(runtime: ModelRuntime) -> ModelRuntime:
    """`runtime` without what could steer ranks apart: drafting (timed)."""
    return replace(runtime, draft=None, step_costs=None)


def apply_turn(loop: BatchLoop, record: dict[str, Any], cancelled: dict[int, Job], new: list[Job]) -> bool:
    """Run one turn record on `loop`, the same way on every rank; False once the loop is over."""
    for job in cancelled.values():
        job.cancel()
    for job in new:
        loop.add(job)
    if record["stop"] is not None:
        loop.end_all(ShutdownError(record["stop"]))
        return False
    if record["abort"] is not None:
        loop.end_all(ShutdownError(record["abort"]))
    now = record["now"]
    loop.admission.clock = lambda: now
    try:
        loop.turn()  # a step failing on a lost rank ends its requests; the next turn's message then fails
    except Exception as error:  # noqa: BLE001 - outside the guarded steps: end what is in flight, go on
        log.exception("turn failed")
        loop.end_all(error)
    return True


class LeaderScheduler(ServingThread):
    """Rank 0's ServingThread: each turn is first sent to the other ranks (distributed/follower.py turns them)."""

    def __init__(self, runtime: ModelRuntime, config: SchedulerConfig | None, channel: Channel, stall_s: float):
        self.channel, self.stall_s = channel, stall_s
        self.broken: str | None = None  # why the group is unusable; set once, never cleared
        self.turn_started: float | None = None  # perf_counter of the turn in progress, for the watchdog
        self._twins: dict[int, tuple[Job, Job]] = {}  # id -> (the caller's job, the loop's copy)
        self._ended: list[int] = []  # twins that sent their last event this turn
        self._next_id = 0
        super().__init__(replayable(runtime), config)
        threading.Thread(target=self._watch, name="mlxinfer-rank-watchdog", daemon=True).start()

    def submit(self, job: Job) -> None:
        if self.broken is not None:
            raise ClusterError(self.broken)
        super().submit(job)

    def _run(self) -> None:
        loop = self._loop
        loop.admission.agree = self.channel.all_true  # set here, on the loop's thread, before its first turn
        while True:
            with self._cond:
                if not (self._inbox or loop.has_work() or self._stopping or self._aborting):
                    self._cond.wait(HEARTBEAT_S)  # then an empty turn: a lost rank shows while idle too
                new, stopping, aborting = list(self._inbox), self._stopping, self._aborting
                self._inbox.clear()
                self._aborting = None
            if self.broken is not None:  # nothing reaches the other ranks any more
                error = ClusterError(self.broken)
                for job in new:
                    job.on_event(Failed(error))
                if stopping is not None:
                    return
                continue
            if not self._turn(loop, new, stopping, aborting):
                return
            self._measure()

    def _turn(self, loop: BatchLoop, new: list[Job], stopping: str | None, aborting: str | None) -> bool:
        """Send this turn to the other ranks and run it here; False once the loop is over."""
        twins = [self._twin(job) for job in new]
        cancelled = [i for i, (job, twin) in self._twins.items() if job.cancelled and not twin.cancelled]
        now = time.perf_counter()
        record = {"now": now, "jobs": [job_spec(t, i) for i, t in twins], "cancelled": cancelled}
        record.update(stop=stopping, abort=aborting)
        self.turn_started = now
        try:
            try:
                self.channel.send(record)
            except Exception as error:  # noqa: BLE001 - a collective failed: the group is gone for good
                self._break(f"a rank of the distributed model was lost ({error}); restart `mlxinfer serve`")
                for _, twin in twins:
                    twin.on_event(Failed(ClusterError(self.broken)))
                loop.end_all(ClusterError(self.broken))
                return True
            return apply_turn(loop, record, {i: self._twins[i][1] for i in cancelled}, [t for _, t in twins])
        finally:
            self.turn_started = None
            for i in self._ended:
                self._twins.pop(i, None)
            self._ended.clear()

    def _twin(self, job: Job) -> tuple[int, Job]:
        # The loop runs a copy whose cancel flag only a turn record sets: a client leaving mid-turn must not end
        # the request here a turn before the other ranks.
        self._next_id += 1
        sampling = job.sampling if job.sampling.seed is not None else replace(job.sampling, seed=secrets.randbits(63))
        job_id, caller = self._next_id, job.on_event

        def forward(event: Any) -> None:
            if not isinstance(event, Delta):
                self._ended.append(job_id)
            caller(event)

        twin = replace(job, sampling=sampling, speculate="off", on_event=forward, _cancelled=threading.Event())
        self._twins[job_id] = (job, twin)
        return job_id, twin

    def _break(self, reason: str) -> None:
        if self.broken is None:
            self.broken = reason
            log.error("%s", reason)

    def _watch(self) -> None:
        """End the requests of a turn that never ends (a rank that hangs rather than dies)."""
        while self.broken is None:
            time.sleep(min(1.0, self.stall_s / 4))
            started = self.turn_started
            if started is not None and time.perf_counter() - started > self.stall_s:
                self._break(f"a rank of the distributed model has not answered for {self.stall_s:g} s")
                error = ClusterError(self.broken)
                for job, twin in list(self._twins.values()):
                    twin.on_event = _dropped  # whatever the stuck turn still emits goes nowhere
                    job.on_event(Failed(error))
