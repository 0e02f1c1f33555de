"""One request on the caller's own thread: the generation loop with a batch of one.

The Python API and the CLI run through the same loop as the server (engine/loop.py),
turned here until the request ends. Stopping early keeps what was computed for the
prefix cache: a caller that stops reading (a closed stream) cancels the request
at once, and Ctrl-C keeps whatever every layer holds, even mid-forward.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from ..adapters import NO_ADAPTER, Chosen
from ..cache import PrefixCache
from ..defaults import MAX_TOKENS, PREFILL_CHUNK_TOKENS
from ..errors import SamplingError
from ..models.decoder import DecoderLM
from .images import PromptImages
from .job import Delta, Event, Failed, Finished, Job
from .loop import BatchLoop
from .request import GenerationRequest, check_options
from .runtime import SINGLE, ModelRuntime, SchedulerConfig
from .stats import GenerationStats
from .text import check_stops, truncate_at_stop


def run_alone(runtime: ModelRuntime, job: Job, config: SchedulerConfig = SINGLE) -> Iterator[Delta]:
    """The job's text deltas as they come; its stats are filled when this ends. Raises what failed it."""
    loop = BatchLoop(runtime, config, log_failures=False)
    # The Python API lets a caller run past the context, as it always did.
    loop.admission.check(job, within_context=False)
    events: deque[Event] = deque()
    job.on_event = events.append
    loop.add(job)
    try:
        while True:
            while events:
                event = events.popleft()
                if isinstance(event, Failed):
                    raise event.error
                if isinstance(event, Finished):
                    return
                yield event
            if not loop.has_work():  # every path ends a job with Finished or Failed; never spin without one
                raise RuntimeError("the generation loop went idle before the request ended")
            loop.turn()
    except GeneratorExit:  # the caller stopped reading: what was computed serves the next prompt
        job.cancel()
        loop.drop_cancelled()
        raise
    except KeyboardInterrupt:
        job.stats.finish_reason = "cancelled"
        loop.interrupt()
        raise


def warm_alone(
    runtime: ModelRuntime,
    ids: list[int],
    chunk: int = PREFILL_CHUNK_TOKENS,
    images: PromptImages | None = None,
    adapter: Chosen = NO_ADAPTER,
) -> None:
    """Prefill `ids` (with `images` at their tokens, under `adapter`) and keep their state in the prefix cache and
    on disk (MemoryBudgetError if it cannot fit)."""
    job = Job(ids, on_event=_unset, max_tokens=1, prefill_chunk=chunk, warm=True, images=images, adapter=adapter)
    for _ in run_alone(runtime, job):
        pass


def job_for(request: GenerationRequest, stop: Sequence[str], stats: GenerationStats, use_cache: bool) -> Job:
    """The loop's form of a Python API request."""
    check_options(request)
    return Job(
        list(request.prompt_ids),
        on_event=_unset,
        max_tokens=request.max_tokens,
        sampling=request.sampling,
        stop=stop,
        stats=stats,
        prefill_chunk=request.prefill_chunk_tokens,
        snapshot_every=request.snapshot_every,
        eos_token_ids=frozenset(request.eos_token_ids),
        use_cache=use_cache,
        constraint=request.constraint,
        speculate=request.speculate,
        images=request.images,
        adapter=request.adapter,
    )


def _unset(event: Event) -> None:
    raise AssertionError("run_alone sets the job's listener")


@dataclass
class TextGeneration:
    """One generation's stream of text; `ids`, `stats` fill in as it runs."""

    runtime: ModelRuntime
    request: GenerationRequest
    stop: Sequence[str] = ()
    use_cache: bool = True
    ids: list[int] = field(default_factory=list)
    stats: GenerationStats = field(default_factory=GenerationStats)

    started: bool = False

    def __post_init__(self) -> None:
        check_stops(self.stop)

    def deltas(self) -> Iterator[str]:
        """Yield text as it is produced: never half a character, never part of a stop string."""
        if self.started:
            raise SamplingError("this generation was already consumed; start a new one")
        self.started = True
        job = job_for(self.request, self.stop, self.stats, self.use_cache)
        for delta in run_alone(self.runtime, job):
            if delta.token is not None:
                self.ids.append(delta.token)
            if delta.text:
                yield delta.text

    def __iter__(self) -> Iterator[str]:
        return self.deltas()

    def text(self) -> str:
        """The whole text, decoded at once from the generated ids (after `deltas` ran)."""
        return truncate_at_stop(self.runtime.tokenizer.decode(self.ids), self.stop)


def generate_ids(
    model: DecoderLM, request: GenerationRequest, stats: GenerationStats, prefix_cache: PrefixCache | None = None
) -> Iterator[int]:
    """Generated ids for `request` (EOS itself is not yielded), filling `stats`; no tokenizer needed.

    With a `prefix_cache`, the longest cached prefix of the prompt is reused and the
    prompt and the tokens fed back while decoding are offered to it when it ends."""
    eos = frozenset(request.eos_token_ids)
    runtime = ModelRuntime(model, None, prefix_cache, None, request.kv_bits, eos, context_tokens=MAX_TOKENS)
    for delta in run_alone(runtime, job_for(request, (), stats, use_cache=prefix_cache is not None)):
        if delta.token is not None:
            yield delta.token
