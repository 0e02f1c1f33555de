"""Prometheus metrics for GET /metrics: traffic, tokens, latency, queue, prefix cache, memory, speculation.

Each app has its own registry (several servers can live in one process, as in
the tests). Gauges are read from the schedulers when scraped, never polled.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..engine import DRAFT_REASONS, REASONS, GenerationStats, ServingThread
from .model_pool import ModelSet

disable_created_metrics()  # no `*_created` series: they double the output and nobody here reads them

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5, 5, 10)


class Metrics:
    """The server's instruments; `models` is read at every scrape."""

    def __init__(self, models: ModelSet):
        schedulers = models.schedulers
        self.registry = registry = CollectorRegistry()
        self.requests = Counter(
            "mlxinfer_requests", "HTTP requests answered", ["endpoint", "status"], registry=registry
        )
        self.dropped = Counter(
            "mlxinfer_connections_dropped",
            "Connections the server closed: headers too slow, room for a new one, or none to spare",
            ["reason"],
            registry=registry,
        )
        self.finished = Counter("mlxinfer_generations", "Generations ended, by reason", ["reason"], registry=registry)
        self.prompt_tokens = Counter("mlxinfer_prompt_tokens", "Prompt tokens received", registry=registry)
        self.cached_tokens = Counter(
            "mlxinfer_cached_prompt_tokens", "Prompt tokens from the prefix cache", registry=registry
        )
        self.completion_tokens = Counter("mlxinfer_completion_tokens", "Tokens generated", registry=registry)
        self.ttft = Histogram(
            "mlxinfer_time_to_first_token_seconds", "Arrival to first token", buckets=LATENCY_BUCKETS, registry=registry
        )
        self.token_latency = Histogram(
            "mlxinfer_time_per_output_token_seconds", "Between output tokens", buckets=TOKEN_BUCKETS, registry=registry
        )

        def total(read: Callable[[ServingThread], float]) -> Callable[[], float]:
            return lambda: float(sum(read(s) for s in schedulers()))

        gauges = {
            "mlxinfer_queue_depth": ("Requests waiting for a place in a batch", lambda s: s.queued),
            "mlxinfer_running_requests": ("Requests prefilling or decoding", lambda s: s.running),
            "mlxinfer_prefix_cache_bytes": ("Bytes held by prefix caches (draft models' too)", _prefix_bytes),
            "mlxinfer_prefix_cache_hit_tokens": (
                "Prompt tokens served from prefix caches",
                lambda s: _prefix(s, "cached_tokens"),
            ),
            "mlxinfer_prefix_cache_lookup_tokens": ("Prompt tokens looked up", lambda s: _prefix(s, "prompt_tokens")),
        }
        for name, (doc, read) in gauges.items():
            Gauge(name, doc, registry=registry).set_function(total(read))
        Gauge(
            "mlxinfer_memory_in_use_bytes", "MLX memory in use: weights, KV caches, prefix caches", registry=registry
        ).set_function(lambda: float(models.memory_in_use))
        Gauge(
            "mlxinfer_prefix_cache_hit_rate", "Share of prompt tokens served from prefix caches", registry=registry
        ).set_function(lambda: _hit_rate(list(schedulers())))
        self._speculation(registry, schedulers)

    def _speculation(self, registry: CollectorRegistry, schedulers: Callable[[], list[ServingThread]]) -> None:
        self.drafted_tokens = Counter(
            "mlxinfer_speculative_drafted_tokens", "Drafted tokens the target verified", registry=registry
        )
        self.accepted_tokens = Counter(
            "mlxinfer_speculative_accepted_tokens", "Drafted tokens the target kept", registry=registry
        )
        self.speculation_off = Counter(
            "mlxinfer_speculation_off",
            "Generations that ended decoding plainly with speculation on (reason: slower, seeded, unverified)",
            ["reason"],
            registry=registry,
        )
        self.draft_not_used = Counter(
            "mlxinfer_draft_model_not_used",
            "Generations under auto that drafted by prompt lookup though a draft model was loaded "
            "(reason: slower, unread)",
            ["reason"],
            registry=registry,
        )
        for label in REASONS.values():  # every reason listed from the start, at 0
            self.speculation_off.labels(label)
        for label in DRAFT_REASONS.values():
            self.draft_not_used.labels(label)
        registry.register(_PlainBatchSteps(schedulers))

    def record(self, stats: GenerationStats) -> None:
        """A generation ended: count its tokens, reason and speculation."""
        self.finished.labels(stats.finish_reason or "error").inc()
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.cached_tokens.inc(stats.cached_tokens)
        self.completion_tokens.inc(stats.generated_tokens)
        self.drafted_tokens.inc(stats.drafted_tokens)
        self.accepted_tokens.inc(stats.accepted_tokens)
        if stats.speculation_off:
            self.speculation_off.labels(REASONS.get(stats.speculation_off, "other")).inc()
        if stats.draft_declined:
            self.draft_not_used.labels(DRAFT_REASONS.get(stats.draft_declined, "other")).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _prefix(scheduler: ServingThread, name: str) -> float:
    cache = scheduler.runtime.prefix_cache
    return getattr(cache.stats, name) if cache else 0


def _prefix_bytes(scheduler: ServingThread) -> float:
    draft = scheduler.runtime.draft
    held = draft.prefix_cache.stats.bytes_held if draft is not None and draft.prefix_cache else 0
    return _prefix(scheduler, "bytes_held") + held


def _hit_rate(schedulers: list[ServingThread]) -> float:
    looked_up = sum(_prefix(s, "prompt_tokens") for s in schedulers)
    return sum(_prefix(s, "cached_tokens") for s in schedulers) / looked_up if looked_up else 0.0


class _PlainBatchSteps(Collector):
    """Batch steps the schedulers took plainly although a row could have speculated, by reason, read at scrape.

    A gauge, like the prefix-cache totals: it restarts when a model is unloaded."""

    def __init__(self, schedulers: Callable[[], list[ServingThread]]):
        self._schedulers = schedulers

    def collect(self) -> Iterator[Metric]:
        steps: collections.Counter[str] = collections.Counter()
        for scheduler in self._schedulers():
            steps.update(scheduler.plain_batch_steps)
        family = GaugeMetricFamily(
            "mlxinfer_speculation_plain_batch_steps",
            "Batch steps decoded plainly while a row had drafts (another row had none, or does not speculate)",
            labels=["reason"],
        )
        for reason, count in sorted(steps.items()):
            family.add_metric([reason], count)
        yield family
