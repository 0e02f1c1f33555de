"""The generation engine: sampling, prefill, decode, text streaming, continuous batching."""

from .generate import GenerationRequest, prefill
from .job import Delta, Event, Failed, Finished, Job
from .loop import ModelRuntime, SchedulerConfig
from .sampling import SamplingParams
from .scheduler import Scheduler
from .single import TextGeneration, generate_ids
from .stats import GenerationStats

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
