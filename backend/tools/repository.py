"""The model repository as the tools see it: where it is, and its config.pbtxt files read and written through
Triton's protobuf schema (never edited as text, so a file that parses keeps parsing).

Where it is: `TRELLM_MODEL_REPOSITORY` when set; else the checkout's `model_repository/` when these modules run
from a checkout (an editable install); else `./model_repository` (an installed wheel, run where the repository
was copied, as the Dockerfile does).
"""
from __future__ import annotations

import os

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

_CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def default_repository() -> str:
    env = os.environ.get("TRELLM_MODEL_REPOSITORY")
    if env:
        return os.path.abspath(env)
    checkout = os.path.join(_CHECKOUT, "model_repository")
    if os.path.isdir(checkout):
        return checkout
    return os.path.abspath("model_repository")


def read_config(path: str) -> model_config_pb2.ModelConfig:
    with open(path) as f:
        return text_format.Parse(f.read(), model_config_pb2.ModelConfig())


def write_config(path: str, cfg: model_config_pb2.ModelConfig, header: str = "") -> None:
    with open(path, "w") as f:
        f.write(header + text_format.MessageToString(cfg))


def set_parameters(cfg: model_config_pb2.ModelConfig, values: dict[str, str], only_existing: bool = False) -> None:
    """Set config.pbtxt `parameters` string values (adding keys unless `only_existing`)."""
    for key, value in values.items():
        if key in cfg.parameters or not only_existing:
            cfg.parameters[key].string_value = str(value)
