"""One bounds-checked reader per file format: safetensors headers and GGUF files.

Nothing here knows a model family: the loader, the converter and the model library read files through these."""
