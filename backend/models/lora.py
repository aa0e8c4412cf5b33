"""LoRA adapters: PEFT folders checked against their base model, and the batched extra term of a step.

An adapter adds `x @ A^T @ B^T * scale` to the output of each linear it targets (scale = lora_alpha / r, or
lora_alpha / sqrt(r) with rsLoRA). Adapter weights stay apart from the base weights (quantized or not): a step that
mixes requests of several adapters (and of none) runs the base linears once for every token, then, for each adapter
in the step, the tokens of its requests through its two small matrices (a shrink to rank r, an expand back), added
into the right columns of the fused projections (q/k/v in qkv, gate/up in gate_up). On a GPU, Triton kernels do it
for every adapter in one launch through a token -> slot index (Punica's BGMV; kernels/triton_lora.py) over the
step's adapters stacked (`stack_adapters`); on a CPU, one shrink and one fused expand per adapter over its rows.
"""
from __future__ import annotations

import json
import math
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from safetensors import safe_open

from trellm_backend.models.config import ModelConfig
from trellm_backend.models.sharding import Shard, shard_config, shard_tensor, splits_inputs
from trellm_kernels.lora import lora_add, lora_expand, lora_shrink

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
# The fused linear each module's output lives in.
SITE_OF = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "o", "gate_proj": "gate_up",
           "up_proj": "gate_up", "down_proj": "down"}


class AdapterError(ValueError):
    """An adapter folder that does not fit its base model; the message names the file, the key and what differs."""


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int, int]]:
    """{module: (in features, out features, first output column in its fused site)}."""
    q, kv, h, i = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size, \
        cfg.intermediate_size
    return {"q_proj": (h, q, 0), "k_proj": (h, kv, q), "v_proj": (h, kv, q + kv), "o_proj": (q, h, 0),
            "gate_proj": (h, i, 0), "up_proj": (h, i, i), "down_proj": (i, h, 0)}


@dataclass
class SiteWeights:
    """An adapter's matrices for one fused site: the targeted modules' A stacked, and their B as one block-diagonal
    matrix over the site's whole output width (zero for untargeted modules' columns), both transposed, so the term is
    one shrink and one expand whatever the number of modules (kernels/lora.py's lora_add)."""
    at: torch.Tensor                                  # [in, sum of the ranks]
    bt: torch.Tensor                                  # [sum of the ranks, the site's output width]
    spans: torch.Tensor                               # [sum of the ranks, 2] int64: each rank row's module columns


@dataclass
class LoraAdapter:
    name: str
    path: str
    rank: int
    scale: float
    # (layer, module) -> (A [r, in], B [out, r]); the term is ((x @ A^T) @ B^T) * scale, in PEFT's order
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # (layer, fused site) -> the A of its targeted modules stacked, and each module's (first column, rank offset, B)
    sites: dict[tuple[int, str], "SiteWeights"] = field(default_factory=dict)


def load_adapter(name: str, path: str, cfg: ModelConfig, max_rank: int, dtype: torch.dtype,
                 device: torch.device, shard: Shard | None = None) -> LoraAdapter:
    """A PEFT LoRA folder (adapter_config.json + adapter_model.safetensors), checked against the base model `cfg`:
    every weight's shape, the target modules, the rank (<= max_rank). Raises AdapterError naming what is wrong.
    With a tensor-parallel `shard`, the rank's share: B's rows of the outputs its q/k/v and gate/up hold, A's columns
    of the inputs its o and down hold (their partial terms are added with the base's partial sums)."""
    config_path = os.path.join(path, "adapter_config.json")
    weights_path = os.path.join(path, "adapter_model.safetensors")
    for p in (config_path, weights_path):
        if not os.path.isfile(p):
            raise AdapterError(f"LoRA adapter {name!r}: {p} is missing (a PEFT folder has adapter_config.json and "
                               "adapter_model.safetensors)")
    try:
        with open(config_path) as f:
            ac = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise AdapterError(f"LoRA adapter {name!r}: {config_path} is not valid JSON: {e}") from None

    def refuse(key, why):
        raise AdapterError(f"LoRA adapter {name!r}: {config_path}: {key} {why}")
    if ac.get("peft_type", "LORA") != "LORA":
        refuse("peft_type", f"is {ac.get('peft_type')!r}; only LORA adapters are served")
    for key, off in (("use_dora", False), ("fan_in_fan_out", False), ("bias", "none")):
        if ac.get(key, off) not in (off, None):
            refuse(key, f"is {ac[key]!r}; only {off!r} is supported")
    for key in ("modules_to_save", "rank_pattern", "alpha_pattern", "layers_to_transform"):
        if ac.get(key):
            refuse(key, "is set; adapters with per-module or per-layer exceptions are not supported")
    rank = ac.get("r")
    if not isinstance(rank, int) or not 1 <= rank <= max_rank:
        refuse("r", f"is {rank!r}; it must be in [1, {max_rank}] (max_lora_rank)")
    alpha = ac.get("lora_alpha", rank)
    scale = alpha / math.sqrt(rank) if ac.get("use_rslora") else alpha / rank
    shapes = module_shapes(cfg)
    adapter = LoraAdapter(name, path, rank, scale)
    prefix = "base_model.model.model.layers."
    with safe_open(weights_path, "pt") as f:
        keys = list(f.keys())
        pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for key in keys:
            rest = key[len(prefix):] if key.startswith(prefix) else None
            parts = rest.split(".") if rest else []
            # {layer}.{self_attn|mlp}.{module}.lora_{A|B}.weight
            if cfg.moe is not None and parts and parts[0].isdigit() and (
                    "experts" in parts or "shared_expert" in parts
                    or (len(parts) > 2 and parts[2] in ("gate_proj", "up_proj", "down_proj")
                        and cfg.moe.is_sparse(int(parts[0])))):
                raise AdapterError(f"LoRA adapter {name!r}: {weights_path}: key {key!r} targets the experts of "
                                   f"mixture-of-experts layer {parts[0]}; LoRA on experts is not supported (the "
                                   "attention projections are)")
            if len(parts) != 5 or parts[2] not in MODULES or parts[3] not in ("lora_A", "lora_B") \
                    or parts[4] != "weight" or not parts[0].isdigit():
                raise AdapterError(f"LoRA adapter {name!r}: {weights_path}: key {key!r} is not a LoRA weight of "
                                   f"{', '.join(MODULES)} (base_model.model.model.layers.N.*.MODULE.lora_A.weight)")
            layer, module = int(parts[0]), parts[2]
            if layer >= cfg.num_layers:
                raise AdapterError(f"LoRA adapter {name!r}: {weights_path}: key {key!r} names layer {layer}; the "
                                   f"base model has {cfg.num_layers}")
            pairs.setdefault((layer, module), {})[parts[3]] = f.get_tensor(key)
    for (layer, module), ab in sorted(pairs.items()):
        where = f"base_model.model.model.layers.{layer}.*.{module}"
        if set(ab) != {"lora_A", "lora_B"}:
            raise AdapterError(f"LoRA adapter {name!r}: {weights_path}: {where} has {sorted(ab)} but needs "
                               "lora_A and lora_B")
        n_in, n_out, _ = shapes[module]
        for part, want in (("lora_A", (rank, n_in)), ("lora_B", (n_out, rank))):
            got = tuple(ab[part].shape)
            if got != want:
                raise AdapterError(f"LoRA adapter {name!r}: {weights_path}: {where}.{part}.weight has shape "
                                   f"{list(got)}; the base model and r={rank} need {list(want)}")
        a, b = ab["lora_A"], ab["lora_B"]
        if shard is not None:   # the base's split, on the matrix that touches the split dimension
            base = f"model.layers.{layer}.{'self_attn' if module in ATTENTION else 'mlp'}.{module}.weight"
            if splits_inputs(base):
                a = shard_tensor(cfg, shard, base, a)
            else:
                b = shard_tensor(cfg, shard, base, b)
        adapter.weights[(layer, module)] = (a.to(device=device, dtype=dtype).contiguous(),
                                            b.to(device=device, dtype=dtype).contiguous())
    if not adapter.weights:
        raise AdapterError(f"LoRA adapter {name!r}: {weights_path} holds no LoRA weights")
    if shard is not None:
        shapes = module_shapes(shard_config(cfg, shard))
    for layer in range(cfg.num_layers):
        for site in dict.fromkeys(SITE_OF.values()):
            mods = [m for m in MODULES if SITE_OF[m] == site and (layer, m) in adapter.weights]
            if mods:
                width = sum(shapes[m][1] for m in MODULES if SITE_OF[m] == site)
                bt = torch.zeros(rank * len(mods), width, dtype=dtype, device=device)
                spans = []
                for i, m in enumerate(mods):
                    col, n_out = shapes[m][2], shapes[m][1]
                    bt[i * rank:(i + 1) * rank, col:col + n_out] = adapter.weights[(layer, m)][1].T
                    spans += [(col, n_out)] * rank
                adapter.sites[(layer, site)] = SiteWeights(
                    torch.cat([adapter.weights[(layer, m)][0] for m in mods]).T.contiguous(), bt,
                    torch.tensor(spans, dtype=torch.int64))
    declared = set(ac.get("target_modules") or []) if isinstance(ac.get("target_modules"), list) else None
    if declared is not None and not declared <= set(MODULES):
        refuse("target_modules", f"names {sorted(declared - set(MODULES))}; supported: {', '.join(MODULES)}")
    return adapter


def adapter_table(text: str) -> dict[str, str]:
    """The `lora_adapters` setting: a JSON object {adapter name: PEFT folder} (vllm_backend's multi_lora.json)."""
    try:
        table = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"lora_adapters is not valid JSON: {e}") from None
    return checked_table(table, "lora_adapters")


def checked_table(table, shown: str) -> dict[str, str]:
    """`table` if it maps adapter names to folders (non-empty strings both), else ValueError naming `shown`."""
    if not isinstance(table, dict) or not all(isinstance(k, str) and k and isinstance(v, str) and v
                                              for k, v in table.items()):
        raise ValueError(f'{shown} must be a JSON object {{"adapter name": "PEFT folder", ...}}')
    return table


class AdapterRegistry:
    """The declared adapters: each checked once at start (a broken folder is refused by name, the others serve),
    at most `max_cpu_loras` kept in memory (least recently used out first; 0: all), the others read again from
    their folder when a request names them. A request holds its adapter, so an eviction never touches one in use.
    Thread-safe: requests are made on Triton's threads."""

    def __init__(self, table: dict[str, str], cfg: ModelConfig, max_rank: int, max_cpu_loras: int,
                 dtype: torch.dtype, device: torch.device, shard: Shard | None = None):
        """`shard`: with tensor parallelism, rank 0's (each worker reads the adapters a step uses itself)."""
        self._table = dict(table)
        self._read = lambda name, path: load_adapter(name, path, cfg, max_rank, dtype, device, shard)
        self._load = lambda name: self._read(name, self._table[name])
        self.max_cpu_loras = max_cpu_loras
        self.broken: dict[str, str] = {}
        self._cache: OrderedDict[str, LoraAdapter] = OrderedDict()
        self._lock = threading.Lock()
        self.loads = self.evictions = 0      # since start, beyond the first check
        for name in table:
            try:
                self._put(self._load(name))
            except AdapterError as e:
                self.broken[name] = str(e)
        self.names = sorted(n for n in table if n not in self.broken)

    def get(self, name: str) -> LoraAdapter:
        """The adapter `name`, read again from its folder when it was evicted; ValueError names an unknown or a
        broken one."""
        with self._lock:
            if name in self._cache:
                self._cache.move_to_end(name)
                return self._cache[name]
        if name in self.broken:
            raise ValueError(self.broken[name])
        if name not in self.names:
            known = ", ".join(self.names) or "none (the llm parameter lora_adapters declares them)"
            raise ValueError(f"lora_name {name!r} is not an adapter of this model; known: {known}")
        adapter = self._load(name)
        with self._lock:
            self.loads += 1
            self._put(adapter)
        return adapter

    def apply(self, load: dict[str, str], unload: list[str]) -> None:
        """Undeclare the adapters `unload`, then declare (or replace) `load` {name: folder}, while serving, all or
        nothing: every folder is read and checked first, and a failure (AdapterError, or ValueError for an
        undeclared name to unload) changes nothing. New requests naming an unloaded adapter are refused; running
        requests finish with the adapter they started with."""
        with self._lock:
            unknown = [n for n in unload if n not in self._table]
        if unknown:
            raise ValueError(f"lora adapter {unknown[0]!r} is not declared; declared: {', '.join(self.names) or 'none'}")
        adapters = {name: self._read(name, path) for name, path in load.items()}
        with self._lock:
            for name in unload:
                self._table.pop(name, None)
                self._cache.pop(name, None)
                self.broken.pop(name, None)
            for name, adapter in adapters.items():
                self._table[name] = load[name]
                self.broken.pop(name, None)
                self._cache.pop(name, None)
                self._put(adapter)
            self.names = sorted((set(self.names) - set(unload)) | set(load))

    def _put(self, adapter: LoraAdapter) -> None:
        self._cache[adapter.name] = adapter
        self._cache.move_to_end(adapter.name)
        while self.max_cpu_loras and len(self._cache) > self.max_cpu_loras:
            self._cache.popitem(last=False)
            self.evictions += 1

    @property
    def num_in_memory(self) -> int:
        return len(self._cache)


@dataclass
class StackedSite:
    """One fused site of a step's adapters stacked for the kernels: each targeted module gets a rank slot of width R
    (the largest rank; zero-padded, and zero where an adapter does not target the module)."""
    a: torch.Tensor                                   # [adapters, modules * R, in]
    parts: list[tuple[int, int, torch.Tensor]]        # per module: (first output column, rank offset, B [adapters, out, R])


@dataclass
class AdapterStack:
    names: tuple[str, ...]
    scales: torch.Tensor                              # [adapters] float32
    sites: dict[tuple[int, str], StackedSite]


def stack_adapters(adapters: list[LoraAdapter], cfg: ModelConfig) -> AdapterStack:
    """The adapters' matrices stacked per (layer, site), slot i being adapters[i] (kernels/lora.py)."""
    shapes = module_shapes(cfg)
    rank = max(a.rank for a in adapters)
    some = next(iter(adapters[0].weights.values()))[0]
    sites = {}
    for layer in range(cfg.num_layers):
        for site in dict.fromkeys(SITE_OF.values()):
            mods = [m for m in MODULES if SITE_OF[m] == site and any((layer, m) in ad.weights for ad in adapters)]
            if not mods:
                continue
            n_in = shapes[mods[0]][0]
            a = some.new_zeros(len(adapters), len(mods) * rank, n_in)
            parts = []
            for i, m in enumerate(mods):
                b = some.new_zeros(len(adapters), shapes[m][1], rank)
                for slot, ad in enumerate(adapters):
                    if (layer, m) in ad.weights:
                        wa, wb = ad.weights[(layer, m)]
                        a[slot, i * rank:i * rank + ad.rank] = wa
                        b[slot, :, :ad.rank] = wb
                parts.append((shapes[m][2], i * rank, b))
            sites[(layer, site)] = StackedSite(a, parts)
    scales = torch.tensor([a.scale for a in adapters], dtype=torch.float32, device=some.device)
    return AdapterStack(tuple(a.name for a in adapters), scales, sites)


@dataclass
class LoraStep:
    """The adapters of one step. On a CPU, `groups`: each adapter with the flat-batch rows of its requests' tokens
    (None for all of them, a slice when they are one run, else an index tensor), each adapter's term added over its
    rows (kernels/lora.py's lora_add). With the kernels (a GPU), `stack` and `slots` instead: every adapter's
    matrices stacked and each token's slot in them (-1: none)."""
    groups: list[tuple[LoraAdapter, slice | torch.Tensor | None]] = field(default_factory=list)
    stack: AdapterStack | None = None
    slots: torch.Tensor | None = None

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, site: str) -> None:
        """out[rows, each targeted module's columns] += ((x[rows] @ A^T) @ B^T) * scale."""
        if self.stack is not None:
            sw = self.stack.sites.get((layer, site))
            if sw is not None:
                t = lora_shrink(x, sw.a, self.slots)
                for col, r0, b in sw.parts:
                    lora_expand(out, t, b, self.slots, self.stack.scales, col, r0)
            return
        # Per adapter: one shrink for all the site's modules, one fused expand (out += scale * (t @ B^T)).
        for adapter, rows in self.groups:
            sw = adapter.sites.get((layer, site))
            if sw is None:
                continue
            if rows is None:        # one adapter for the whole step
                lora_add(out, x, sw.at, sw.bt, sw.spans, adapter.scale)
            elif isinstance(rows, slice):
                lora_add(out[rows], x[rows], sw.at, sw.bt, sw.spans, adapter.scale)
            else:
                out.index_add_(0, rows, (x[rows] @ sw.at) @ sw.bt, alpha=adapter.scale)


def step_rows(ranges: list[tuple[int, int]], num_rows: int, device: torch.device) -> slice | torch.Tensor | None:
    """[start, end) row ranges of a batch of `num_rows`: None when they are all of it, one slice when they touch end
    to end (the scheduler orders chunks by adapter), else an index tensor on `device`."""
    if all(ranges[i][1] == ranges[i + 1][0] for i in range(len(ranges) - 1)):
        if ranges[0][0] == 0 and ranges[-1][1] == num_rows:
            return None
        return slice(ranges[0][0], ranges[-1][1])
    return torch.cat([torch.arange(s, e) for s, e in ranges]).to(device)
