"""One exception hierarchy for the whole library.

The library raises these and never prints or exits; the CLI turns them into a
single line and a non-zero exit code. Every message names what failed, the
offending value, what was expected, and how to fix it.
"""


class MlxInferError(Exception):
    """Base class of every error mlxinfer raises on purpose."""


class ModelNotFoundError(MlxInferError):
    """A model path does not exist or holds no model files."""


class UnsupportedModelError(MlxInferError):
    """The model's architecture, a config value or a file format is not supported."""


class ConfigError(MlxInferError):
    """config.json (or GGUF metadata) is missing, malformed or inconsistent."""


class WeightMismatchError(MlxInferError):
    """Checkpoint tensors do not match the architecture (missing, unexpected, wrong shape)."""


class CorruptFileError(MlxInferError):
    """A weights file is truncated, malformed or was crafted to point outside itself."""


class TokenizerError(MlxInferError):
    """Tokenizer files are missing or cannot be built."""


class ChatTemplateError(MlxInferError):
    """A chat template is missing, fails to render, or tried something unsafe."""


class SamplingError(MlxInferError, ValueError):
    """A sampling parameter is NaN, infinite or out of its range."""


class ConversionError(MlxInferError):
    """A conversion cannot start or failed; no output folder is left behind."""


class DefaultModelError(MlxInferError):
    """The default model could not be fetched or found in the cache."""


class MemoryBudgetError(MlxInferError):
    """A request or model needs more memory than this machine can give without swapping."""


class BusyError(MlxInferError):
    """Every slot and queue place is taken; the request may be retried after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestTimeoutError(MlxInferError):
    """A request waited in the queue past its time limit."""


class ShutdownError(MlxInferError):
    """The engine is stopping; the request was ended or not started."""


class ServerConfigError(MlxInferError):
    """Server settings are unsafe or invalid (an exposed address without a key, a wildcard CORS origin)."""


class CacheError(MlxInferError):
    """A prefix-cache file or folder is unusable (unwritable, foreign, corrupt, or not ours to touch)."""


class BindError(MlxInferError):
    """The server cannot listen on its address (a privileged port, an address this machine does not have)."""


class PortInUseError(BindError):
    """Another process already listens on the port."""


class TrayError(MlxInferError):
    """There is nowhere to show the tray icon (no display, no system tray), or the icon failed to show."""


class DraftModelError(MlxInferError):
    """A draft model that cannot draft for this target (another tokenizer), or that could not be loaded."""


class GrammarError(SamplingError):
    """A structured-output constraint (JSON schema, regex, choices, grammar) is invalid or unsupported."""


class ToolCallError(MlxInferError, ValueError):
    """Tools, tool_choice or tool messages are malformed, or the model has no tool-calling syntax mlxinfer knows."""


class LibraryError(MlxInferError):
    """The list of local models cannot be changed: an added path that holds no model, an unwritable registry,
    a model that cannot be removed."""


class HubError(MlxInferError):
    """A pull from the Hugging Face Hub was refused (what it lists or serves is unloadable or hostile, the disk
    is too small) or stopped (the network); a stopped pull resumes when run again."""


class RemoteServerError(MlxInferError):
    """The resident server refused a request or failed while answering it (its message says why)."""


class EmbeddingError(UnsupportedModelError):
    """A model whose final hidden states cannot be had for embeddings (the reason is in the message)."""


class ClusterError(MlxInferError):
    """A distributed model lost a rank (its process ended or its link broke) or a rank stopped answering: the
    requests it was serving end with this error and the server reports itself unhealthy; restart the ranks."""


class ImageError(SamplingError):
    """An image in a request cannot be read, is of a kind not supported, or is past a limit (a 400 on the server)."""


class AdapterError(MlxInferError):
    """A LoRA or DoRA adapter cannot be read, or does not fit its base model (the message names what differs)."""
