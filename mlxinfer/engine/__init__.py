"""The generation engine: sampling, prefill, decode, text streaming, continuous batching."""

from .generate import GenerationRequest, generate_ids, prefill
from .job import Delta, Event, Failed, Finished, Job
from .sampling import SamplingParams
from .scheduler import ModelRuntime, Scheduler, SchedulerConfig
from .stats import GenerationStats
from .text import TextGeneration

__all__ = [
    "Delta",
    "Event",
    "Failed",
    "Finished",
    "GenerationRequest",
    "GenerationStats",
    "Job",
    "ModelRuntime",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "TextGeneration",
    "generate_ids",
    "prefill",
]
