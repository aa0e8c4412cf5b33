"""Add (or remove) a served model in the Triton repository with one command.

    python -m trellm_backend.tools.add_model NAME HF_FOLDER [--dtype float16] [--kv-cache-bytes N] [--max-model-len N]
                                       [--max-num-seqs N] [--repository model_repository] [--force]
    python -m trellm_backend.tools.add_model NAME FILE.gguf [...]   # a llama.cpp file, in a folder of its own
    python -m trellm_backend.tools.add_model --remove NAME

The default model's entries (TEMPLATE_ENTRIES, those that exist) are the template: each config.pbtxt is parsed
with protobuf, renamed, pointed at HF_FOLDER and given the engine settings, so tensor lists are never copied by
hand and follow the template whenever it changes. The entry `ensemble` becomes NAME (the model clients call);
every other entry X becomes NAME_X.

The version folders (`1/model.py`) are copied, not symlinked: a symlink would follow the template's file, so an
edit there would change a running model's code at its next reload without anyone re-adding it, and a link out of
the repository breaks where only the repository is mounted (docker-compose). Re-running the command with
`--force` updates a model's entries from the current template.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
from dataclasses import fields, replace

from tritonclient.grpc import model_config_pb2

from trellm_backend.engine.config import EngineConfig
from trellm_backend.tools.repository import default_repository, read_config, set_parameters, write_config

DEFAULT_REPOSITORY = default_repository()

# The default model's entries, in the repository shipped with the project: the template of every added model.
TEMPLATE_ENTRIES = ("preprocess", "llm", "postprocess", "ensemble", "vllm_model")
ENGINE_ENTRY = "llm"                       # the entry whose parameters are EngineConfig fields
ENTRY_NAME_PARAMETERS = ("llm_model",)     # parameters whose value names another template entry
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def entry_names(name: str, template_dir: str = DEFAULT_REPOSITORY) -> dict[str, str]:
    """Template entry -> the new model's entry name, for the template entries that exist."""
    return {e: (name if e == "ensemble" else f"{name}_{e}") for e in TEMPLATE_ENTRIES
            if os.path.isfile(os.path.join(template_dir, e, "config.pbtxt"))}


def relative_model_path(hf_folder: str, repository: str) -> str:
    """model_path as Triton's models resolve it: relative to the repository folder when the model folder sits
    beside it (so the pair can be moved or mounted together), absolute otherwise."""
    folder, repo = os.path.abspath(hf_folder), os.path.abspath(repository)
    rel = os.path.relpath(folder, repo)
    return rel if rel.startswith("..") and not rel.startswith("../..") else folder


def render_entry(template: model_config_pb2.ModelConfig, names: dict[str, str], model_path: str,
                 engine: dict[str, str]) -> model_config_pb2.ModelConfig:
    """The template entry's config under its new name, pointing at the new model."""
    cfg = model_config_pb2.ModelConfig()
    cfg.CopyFrom(template)
    entry = template.name
    cfg.name = names[entry]
    for step in cfg.ensemble_scheduling.step:
        if step.model_name not in names:
            raise ValueError(f"template ensemble step {step.model_name!r} is not one of {sorted(names)}")
        step.model_name = names[step.model_name]
    set_parameters(cfg, {"model_path": model_path}, only_existing=True)
    for key in ENTRY_NAME_PARAMETERS:
        if key in cfg.parameters and cfg.parameters[key].string_value in names:
            cfg.parameters[key].string_value = names[cfg.parameters[key].string_value]
    if entry == ENGINE_ENTRY:
        set_parameters(cfg, engine)
    return cfg


def gguf_folder(path: str) -> str:
    """The model folder of `path`: itself, or for a GGUF file (or a folder holding one and no config.json) the
    file's folder, with config.json and the tokenizer derived from the file's metadata written beside it
    (models/gguf.py)."""
    if os.path.isdir(path):
        ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if os.path.isfile(os.path.join(path, "config.json")) or not ggufs:
            return path
        if len(ggufs) > 1:
            raise ValueError(f"{path}: holds {len(ggufs)} GGUF files ({', '.join(ggufs)}); name the one to serve")
        path = os.path.join(path, ggufs[0])
    if not path.endswith(".gguf"):
        return path
    from trellm_backend.models.gguf import write_hf_files
    return write_hf_files(path)


def check_model(config: EngineConfig, repository: str) -> None:
    """Read the folder's config.json as the llm's load will (an architecture or key the engine does not implement
    is refused by name), and each adapter of `lora_adapters` against it (load_adapter), so the command fails naming
    the file instead of the model's start. Adapter folders resolve like the llm's: relative to the repository."""
    from trellm_backend.models.config import load_model_config
    from trellm_backend.models.lora import adapter_table
    cfg = load_model_config(config.model_path)
    table = adapter_table(config.lora_adapters)
    if not table:
        return
    import torch

    from trellm_backend.models.lora import load_adapter
    from trellm_backend.triton.parameters import resolve_model_path
    for name, folder in table.items():
        load_adapter(name, resolve_model_path(folder, os.path.join(repository, name)), cfg, config.max_lora_rank,
                     torch.float32, torch.device("cpu"))


def add_model(name: str, hf_folder: str, repository: str = DEFAULT_REPOSITORY, engine: dict[str, str] | None = None,
              template_dir: str = DEFAULT_REPOSITORY, force: bool = False) -> list[str]:
    """Write NAME's entries into `repository`; return their names. Engine settings are checked against
    EngineConfig here, so a typo fails now rather than at load."""
    if not NAME_PATTERN.match(name):
        raise ValueError(f"model name {name!r}: use letters, digits, '_', '.', '-' (starting with a letter or digit)")
    engine = {k: str(v) for k, v in (engine or {}).items()}
    config = EngineConfig.from_strings({"model_path": hf_folder, **engine})   # raises on unknown names and bad values
    hf_folder = gguf_folder(hf_folder)     # only after the settings are checked: it writes beside a GGUF file
    config = replace(config, model_path=hf_folder)
    if not os.path.isfile(os.path.join(hf_folder, "config.json")):
        raise ValueError(f"{os.path.join(hf_folder, 'config.json')}: missing; HF_FOLDER must be a Hugging Face "
                         "model folder")
    check_model(config, repository)
    names = entry_names(name, template_dir)
    if set(names.values()) & set(TEMPLATE_ENTRIES) and os.path.samefile(repository, template_dir):
        raise ValueError(f"model name {name!r} would overwrite a template entry")
    existing = [n for n in names.values() if os.path.exists(os.path.join(repository, n))]
    if existing and not force:
        raise FileExistsError(f"{repository} already has {existing}; pass --force to replace them")
    model_path = relative_model_path(hf_folder, repository)
    # Build every entry in a scratch folder next to the repository, then move each into place, so a server
    # polling the repository never sees half an entry.
    scratch = tempfile.mkdtemp(prefix=f".add-{name}-", dir=os.path.dirname(os.path.abspath(repository)))
    try:
        for entry, new in names.items():
            src = os.path.join(template_dir, entry)
            dst = os.path.join(scratch, new)
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("config.pbtxt", "__pycache__"))
            cfg = render_entry(read_config(os.path.join(src, "config.pbtxt")), names, model_path, engine)
            write_config(os.path.join(dst, "config.pbtxt"), cfg,
                         f"# Generated by `python -m trellm_backend.tools.add_model` from the template entry '{entry}'.\n")
        for new in names.values():
            target = os.path.join(repository, new)
            if os.path.exists(target):
                shutil.rmtree(target)
            os.rename(os.path.join(scratch, new), target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return list(names.values())


def remove_model(name: str, repository: str = DEFAULT_REPOSITORY, template_dir: str = DEFAULT_REPOSITORY) -> list[str]:
    """Delete NAME's entries from `repository`; return the names removed."""
    names = entry_names(name, template_dir).values()
    if os.path.samefile(repository, template_dir) and set(names) & set(TEMPLATE_ENTRIES):
        raise ValueError(f"{name!r} is the template model; it cannot be removed")
    removed = [n for n in names if os.path.isdir(os.path.join(repository, n))]
    if not removed:
        raise FileNotFoundError(f"{repository} has no entries of a model named {name!r}")
    for n in removed:
        shutil.rmtree(os.path.join(repository, n))
    return removed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name")
    ap.add_argument("hf_folder", nargs="?", help="Hugging Face model folder (config.json, *.safetensors, "
                    "tokenizer), or a GGUF file (config.json and the tokenizer are derived from it, beside it)")
    ap.add_argument("--repository", default=DEFAULT_REPOSITORY)
    ap.add_argument("--remove", action="store_true", help="delete NAME's entries instead of adding them")
    ap.add_argument("--force", action="store_true", help="replace NAME's entries if they exist")
    known = [f.name for f in fields(EngineConfig) if f.name != "model_path"]
    for key in known:   # one option per engine setting: --dtype, --kv-cache-bytes, --max-model-len, ...
        ap.add_argument("--" + key.replace("_", "-"), dest=key, metavar="VALUE", help="llm parameter (docs/operating.md)")
    ap.add_argument("--lora", action="append", default=[], metavar="NAME=FOLDER",
                    help="a LoRA adapter served beside the model (PEFT folder; repeat for more): lora_adapters")
    args = ap.parse_args(argv)
    try:
        if args.lora:
            if args.lora_adapters:
                ap.error("give adapters with --lora or with --lora-adapters, not both")
            pairs = [spec.split("=", 1) for spec in args.lora]
            if any(len(p) != 2 or not p[0] or not p[1] for p in pairs):
                ap.error("--lora takes NAME=FOLDER")
            args.lora_adapters = json.dumps({n: os.path.abspath(folder) for n, folder in pairs})
        if args.remove:
            removed = remove_model(args.name, args.repository)
            print(f"removed {', '.join(removed)} from {args.repository}; unload them from a running server with "
                  f"the repository API (POST /v2/repository/models/{args.name}/unload)")
            return 0
        if not args.hf_folder:
            ap.error("HF_FOLDER is required unless --remove is given")
        engine = {k: getattr(args, k) for k in known if getattr(args, k, None) is not None}
        written = add_model(args.name, args.hf_folder, args.repository, engine, force=args.force)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {', '.join(written)} into {args.repository}\nserve it: restart tritonserver, or with "
          f"--model-control-mode=explicit load it: POST /v2/repository/models/{args.name}/load")
    return 0


if __name__ == "__main__":
    sys.exit(main())
