"""Import mlx-lm's model modules without importing the rest of mlx-lm.

`mlx_lm/__init__.py` imports its converter and tokenizer helpers, which import
transformers (and torch where it is installed): 1.5 s and ~200 MB before the
first token, for code the runtime never calls. The model modules only need mlx
and their siblings, so we import them through a stand-in parent package, then
drop the stand-in so a later `import mlx_lm` loads the real package as usual.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
import types

_lock = threading.Lock()


def model_module(name: str) -> types.ModuleType:
    """The module `mlx_lm.models.<name>` (e.g. "llama")."""
    full = f"mlx_lm.models.{name}"
    with _lock:
        if full in sys.modules or "mlx_lm" in sys.modules:
            return importlib.import_module(full)
        spec = importlib.util.find_spec("mlx_lm")
        if spec is None or spec.submodule_search_locations is None:
            return importlib.import_module(full)  # raises the usual ModuleNotFoundError
        stand_in = types.ModuleType("mlx_lm")
        stand_in.__path__ = list(spec.submodule_search_locations)
        stand_in.__spec__ = spec
        sys.modules["mlx_lm"] = stand_in
        try:
            return importlib.import_module(full)
        finally:
            del sys.modules["mlx_lm"]
