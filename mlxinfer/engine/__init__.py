"""The generation engine: one loop (loop.py) wiring admission, a model runner and an output stage; sampling,
speculation, structured output, embeddings, and the ServingThread thread that serves the loop to a server."""

from .drafting import DraftModel, DraftRuntime
from .embed import POOLINGS, check_ids, embed, embeddable, split_inputs
from .image_prompt import RequestSources, encode_chat, encode_text
from .images import PromptImages
from .job import Delta, Event, Failed, Finished, Job
from .loop import BatchLoop
from .prefill import SNAPSHOT_EVERY, Prefill, prefill
from .prefix_store import prefix_store_for
from .request import GenerationRequest, check_max_tokens
from .runtime import ModelRuntime, SchedulerConfig
from .sampling import SamplingParams, with_defaults
from .serving import ServingThread
from .single import TextGeneration, generate_ids, warm_alone
from .speculation import DRAFT_REASONS, MODES, REASONS, StepCosts, check_mode, check_startup_mode
from .stats import GenerationStats
from .structure import Structure, structure_of
from .text import check_stops
from .threads import call_on_device_thread

__all__ = [
    "PromptImages",
    "RequestSources",
    "encode_chat",
    "encode_text",
    "BatchLoop",
    "DRAFT_REASONS",
    "Delta",
    "DraftModel",
    "DraftRuntime",
    "Event",
    "Failed",
    "Finished",
    "GenerationRequest",
    "GenerationStats",
    "Job",
    "MODES",
    "ModelRuntime",
    "POOLINGS",
    "Prefill",
    "REASONS",
    "SNAPSHOT_EVERY",
    "SamplingParams",
    "with_defaults",
    "ServingThread",
    "SchedulerConfig",
    "StepCosts",
    "Structure",
    "TextGeneration",
    "call_on_device_thread",
    "check_ids",
    "check_max_tokens",
    "check_mode",
    "check_startup_mode",
    "check_stops",
    "embed",
    "embeddable",
    "generate_ids",
    "prefill",
    "prefix_store_for",
    "split_inputs",
    "structure_of",
    "warm_alone",
]
