"""The defaults more than one room uses, each in one place: the CLI, the Python API, the engine, the server and
the memory planner read them from here, so changing one changes every front end and every estimate together."""

DEFAULT_MAX_TOKENS = 256  # tokens generated when a caller names no limit (the server's own default is in settings)
MAX_TOKENS = 1_000_000  # the most tokens one request may ask for
PREFILL_CHUNK_TOKENS = 512  # prompt tokens per prefill step of a request running alone; what memory plans assume
SERVER_PREFILL_CHUNK_TOKENS = 256  # per prefill step while other requests decode: each waits at most one step
# What a generation samples with where neither the request nor the model (generation_config.json, a GGUF's
# general.sampling.* keys) names a field: greedy, as transformers decodes a model whose generation config does
# not ask it to sample. The same for the CLI, the Python API and every server route.
DEFAULT_SAMPLING = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
SAMPLING_FIELDS = (*DEFAULT_SAMPLING, "seed")  # what a request may set about sampling, on every front end

# Adapters a served model keeps loaded (the server's own, and the models folder's that requests name); a new one
# past it unloads the least recently used idle one. `mlxinfer serve --max-adapters` sets it.
DEFAULT_MAX_ADAPTERS = 8
