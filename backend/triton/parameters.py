"""What a Python-backend model reads from its config.pbtxt `parameters` (the JSON Triton passes to `initialize`),
and where a `model_path` parameter points."""
from __future__ import annotations

import os


def resolve_model_path(value: str, model_dir: str) -> str:
    """A `model_path` parameter: absolute, or relative to the model repository's root folder."""
    value = os.path.expandvars(os.path.expanduser(value))
    if not os.path.isabs(value):
        value = os.path.join(os.path.dirname(os.path.abspath(model_dir)), value)
    return os.path.normpath(value)


def model_parameters(model_config: dict) -> dict[str, str]:
    """config.pbtxt `parameters` as a plain {key: string_value} dict."""
    return {k: v["string_value"] for k, v in model_config.get("parameters", {}).items()}
