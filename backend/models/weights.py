"""Read a Hugging Face safetensors folder (single file or sharded with an index) into a name -> tensor dict, and take
its tensors as the model wants them (`Checkpoint`: on the device, in the dtype, linears prepared for their kernel)."""
from __future__ import annotations

import json
import os
from dataclasses import replace

import torch
from safetensors import safe_open

from trellm_backend.models.config import ModelConfig, ModelConfigError
from trellm_backend.models.gguf import FLOAT_TYPES, GgufState, gguf_file_of
from trellm_backend.models.quant_formats import take_int4
from trellm_kernels.int4 import cat_outputs
from trellm_kernels.group_quant import GroupWeight, cat_outputs as cat_groups, pack as pack_groups
from trellm_kernels.linear import Weight, prepare_int4, prepare_weight


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


def load_state_dict(path: str, dtype: torch.dtype, pick=None) -> dict[str, torch.Tensor] | GgufState:
    """All tensors of the folder on CPU, the floating ones cast to `dtype` (a GPTQ/AWQ checkpoint's packed int32
    weights keep their type); a GGUF folder's are read as they are taken (gguf.GgufState). `pick(name, part)`: the
    part of each tensor to read, from safetensors' slice of it (a rank's share: sharding.shard_tensor), or None to
    leave it (a pipeline stage's tensors: pipeline.stage_holds)."""
    if gguf_file_of(path) is not None:
        return GgufState(path)
    state = {}
    for file in safetensors_files(path):
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    t = f.get_tensor(name) if pick is None else pick(name, f.get_slice(name))
                    if t is None:   # not this process's
                        continue
                    state[name] = t.to(dtype) if t.is_floating_point() else t
        except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
            raise ModelConfigError(f"{file}: cannot read weights ({e})") from None
    return state


class Checkpoint:
    """A loaded state dict as the model takes it, each tensor once (taken tensors leave the dict, so the host copy
    goes as the device copy is made). `quantization` applies to the linears (`linear`); a GPTQ/AWQ checkpoint
    (cfg.quant) is read as the INT4 it stores and takes no `quantization` of its own. Errors name the folder."""

    def __init__(self, cfg: ModelConfig, state: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype,
                 quantization: str = "none"):
        if cfg.quant is not None and quantization != "none":
            raise ModelConfigError(f"{os.path.join(cfg.path, 'config.json')}: the checkpoint is already quantized "
                                   f"({cfg.quant.method}); quantization={quantization!r} must be none")
        self.cfg, self.state, self.device, self.dtype, self.quantization = cfg, state, device, dtype, quantization

    def take(self, name: str, required: bool = True) -> torch.Tensor | None:
        t = self.state.pop(name, None)
        if t is None:
            if required:
                raise ModelConfigError(f"{self.cfg.path}: weight {name!r} missing from the safetensors files")
            return None
        return t.to(device=self.device, dtype=self.dtype).contiguous()

    def stacked(self, *names: str) -> torch.Tensor:
        """The tensors `names` stacked along their first dimension (merged q/k/v or gate/up biases)."""
        ts = [self.take(n) for n in names]
        return ts[0] if len(ts) == 1 else torch.cat(ts, dim=0).contiguous()

    def linear(self, *names: str) -> Weight:
        """The linears `names` (sharing one input) as one weight, stacked along the outputs."""
        if isinstance(self.state, GgufState):
            return self.gguf_linear(names)
        if self.cfg.quant is None:
            # a tensor-parallel share of each row's inputs comes with the whole rows' max |w| (sharding.py)
            row_amax = self.state.pop(names[0] + ".row_amax", None) if len(names) == 1 else None
            return prepare_weight(self.stacked(*(n + ".weight" for n in names)), self.quantization, row_amax=row_amax)
        source = self.cfg.path
        try:
            w = cat_outputs([take_int4(self.state, n, self.cfg.quant, source) for n in names], f"{source}: {names}")
        except ValueError as e:
            raise ModelConfigError(str(e)) from None
        w.scales = w.scales.to(device=self.device, dtype=self.dtype)
        w.packed, w.zeros = w.packed.to(self.device), w.zeros.to(self.device)
        w.perm = None if w.perm is None else w.perm.to(self.device)
        return prepare_int4(w)

    def gguf_linear(self, names: tuple[str, ...]) -> Weight:
        """A GGUF file's linears: kept in their blocks (kernels/group_quant.py: int8, or 4-bit two to a byte) where
        every part is quantized, else in float (`quantization` applies then)."""
        types = [self.state.type_of(n + ".weight") for n in names]
        blocks = [self.in_blocks(n + ".weight") for n in names]
        if not any(blocks):
            return prepare_weight(self.stacked(*(n + ".weight" for n in names)), self.quantization)
        if self.quantization != "none":
            raise ModelConfigError(f"{self.state.file}: the linears are already quantized "
                                   f"({', '.join(sorted(set(types)))}); quantization={self.quantization!r} must be none")
        if not all(blocks):     # a float part beside quantized ones (no file we know of mixes them in one layer)
            return prepare_weight(self.stacked(*(n + ".weight" for n in names)))
        return self.held_blocks(cat_groups([self.state.pop_blocks(n + ".weight") for n in names]))

    def held_blocks(self, w) -> Weight:
        """A GGUF linear's blocks packed for its device's operator (the C++ operator's blocks on a CPU, rows on a
        GPU), on the device."""
        if self.device.type == "cpu":
            w = pack_groups(w)
        if w.q.device != self.device:
            w = replace(w, q=w.q.to(self.device), scales=w.scales.to(self.device),
                        mins=None if w.mins is None else w.mins.to(self.device))
        return Weight(None, grouped=w)

    def in_blocks(self, name: str) -> bool:
        """Whether `name` is a GGUF file's quantized tensor, which is held in its blocks."""
        return isinstance(self.state, GgufState) and self.state.type_of(name) not in (None, *FLOAT_TYPES)

    def embeddings(self) -> torch.Tensor | GroupWeight:
        """The embeddings [vocab, hidden] in the model's dtype; a GGUF file's quantized ones stay in their blocks
        (GroupWeight.take_rows decodes the rows a step looks up), shared with the LM head when tied."""
        name = "model.embed_tokens.weight"
        return self.held_blocks(self.state.pop_blocks(name)).grouped if self.in_blocks(name) else self.take(name)

    def lm_head(self, embed: torch.Tensor | GroupWeight) -> Weight:
        """The LM head in the model's dtype (the embeddings `embed` when tied). A GGUF file's quantized one stays in
        its blocks: at one user the LM head is a large share of the bytes a step reads, and of the memory of a
        large vocabulary."""
        tied = self.cfg.tie_word_embeddings
        if self.in_blocks("lm_head.weight"):
            return self.held_blocks(self.state.pop_blocks("lm_head.weight"))
        lm_head = self.take("lm_head.weight", required=not tied)
        head = embed if tied or lm_head is None else lm_head
        return Weight(None, grouped=head) if isinstance(head, GroupWeight) else prepare_weight(head)
