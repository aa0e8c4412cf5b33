"""Helpers of the drop-in model tests: model folders derived from the default one, transformers' greedy text as
the oracle, a repository built with the add_model command, and the memory of a server's process tree."""
from __future__ import annotations

import json
import os
import shutil

from trellm_backend.tools.testbed import free_ports, processes_mentioning, rss_bytes  # noqa: F401 - tests import them

PROMPTS = ["The Python language", "A function definition"]
MAX_TOKENS = 16


def variant_model(default_model_path: str, out_dir: str, seed: int = 1, scale: float = 0.05) -> str:
    """A copy of the default model whose every weight carries seeded noise: same tokenizer, different output."""
    import torch
    from safetensors.torch import load_file, save_file
    shutil.copytree(default_model_path, out_dir, ignore=shutil.ignore_patterns("model.safetensors"))
    state = load_file(os.path.join(default_model_path, "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    noisy = {k: (v + scale * torch.randn(v.shape, generator=g, dtype=v.dtype)).contiguous() for k, v in state.items()}
    save_file(noisy, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def edit_json(path: str, **changes) -> None:
    with open(path) as f:
        data = json.load(f)
    data.update(changes)
    with open(path, "w") as f:
        json.dump(data, f)


def greedy_texts(model_path: str, prompts=PROMPTS, max_tokens: int = MAX_TOKENS) -> dict[str, str]:
    """transformers' greedy continuation of each prompt (stopping at EOS, as the engine does)."""
    from transformers import AutoTokenizer

    from hf_models import hf_model
    tok = AutoTokenizer.from_pretrained(model_path)
    model = hf_model(model_path)
    out = {}
    for p in prompts:
        ids = tok(p, return_tensors="pt").input_ids
        gen = model.generate(ids, max_new_tokens=max_tokens, do_sample=False)
        out[p] = tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)
    return out


def process_group_rss(pgid: int) -> int:
    """Resident bytes of every process in the group (tritonserver and its Python-backend stubs)."""
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            if int(stat.rsplit(")", 1)[1].split()[2]) == pgid:   # field 5, after "pid (comm) state ppid"
                total += rss_bytes(int(pid))
        except (OSError, ValueError, IndexError):
            pass   # the process ended while we looked
    return total


def explicit_mode_server(root, name: str, model_path: str, kv_cache_bytes: str):
    """Started tritonserver in explicit model-control mode on `root`/repository, holding one model `name` added
    with the add_model command (the caller stops it)."""
    from trellm_backend.tools.add_model import add_model
    from trellm_backend.tools.launch import TritonServer
    repo = root / "repository"
    repo.mkdir()
    add_model(name, model_path, str(repo), {"kv_cache_bytes": kv_cache_bytes})
    return TritonServer(str(repo), *free_ports(3), log_path=str(root / "server.log"), model_control_mode="explicit",
                        load_models=[name]).start()
