"""Read a Hugging Face safetensors folder (single file or sharded with an index) into a name -> tensor dict."""
from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open

from trellm_backend.models.config import ModelConfigError


def safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(path, s) for s in shards]
    else:
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ModelConfigError(f"{path}: no *.safetensors weights found")
    for f in files:
        if not os.path.isfile(f):
            raise ModelConfigError(f"{f}: listed in model.safetensors.index.json but missing")
    return files


def tensor_header(file: str) -> dict[str, tuple[list[int], str]]:
    """Name -> (shape, safetensors dtype such as "F32" or "I32") of every tensor in one file, from its header alone
    (no tensor is read). Raises ModelConfigError naming the file when the header is unreadable or the data is shorter
    than it says."""
    size = os.path.getsize(file)
    try:
        with open(file, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if size < 8 or n > size - 8:
                raise ValueError(f"header length {n} exceeds the file size {size}")
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        end = max((int(t["data_offsets"][1]) for t in header.values()), default=0)
        tensors = {name: ([int(d) for d in t["shape"]], str(t["dtype"])) for name, t in header.items()}
    except (ValueError, KeyError, TypeError, IndexError) as e:   # JSONDecodeError is a ValueError
        raise ModelConfigError(f"{file}: not a safetensors file ({e})") from None
    if 8 + n + end != size:
        raise ModelConfigError(f"{file}: truncated or corrupt: the header describes {8 + n + end} bytes, "
                               f"the file has {size}")
    return tensors


def load_state_dict(path: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """All tensors of the folder on CPU, the floating ones cast to `dtype` (a GPTQ/AWQ checkpoint's packed int32
    weights keep their type)."""
    state = {}
    for file in safetensors_files(path):
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    t = f.get_tensor(name)
                    state[name] = t.to(dtype) if t.is_floating_point() else t
        except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
            raise ModelConfigError(f"{file}: cannot read weights ({e})") from None
    return state
