"""Prometheus metrics for GET /metrics: traffic, tokens, latency, queue, prefix cache, memory.

Each app has its own registry (several servers can live in one process, as in
the tests). Gauges are read from the schedulers when scraped, never polled.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from ..engine import GenerationStats, Scheduler
from .models import ModelSet

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

        def total(read: Callable[[Scheduler], float]) -> Callable[[], float]:
            return lambda: float(sum(read(s) for s in schedulers()))

        gauges = {
            "mlxinfer_queue_depth": ("Requests waiting for a place in a batch", lambda s: s.queued),
            "mlxinfer_running_requests": ("Requests prefilling or decoding", lambda s: s.running),
            "mlxinfer_prefix_cache_bytes": ("Bytes held by prefix caches", lambda s: _prefix(s, "bytes_held")),
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

    def record(self, stats: GenerationStats) -> None:
        """A generation ended: count its tokens and reason."""
        self.finished.labels(stats.finish_reason or "error").inc()
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.cached_tokens.inc(stats.cached_tokens)
        self.completion_tokens.inc(stats.generated_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _prefix(scheduler: Scheduler, name: str) -> float:
    cache = scheduler.runtime.prefix_cache
    return getattr(cache.stats, name) if cache else 0


def _hit_rate(schedulers: list[Scheduler]) -> float:
    looked_up = sum(_prefix(s, "prompt_tokens") for s in schedulers)
    return sum(_prefix(s, "cached_tokens") for s in schedulers) / looked_up if looked_up else 0.0
