"""README.md and docs/ name only what exists: links (and their #anchors) resolve, repository paths in backticks are
there, `make` targets are the Makefile's, and every --flag a documented command line passes is one that command
takes (found in its source, else in its --help)."""
from __future__ import annotations

import functools
import glob
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = [os.path.join(REPO, "README.md"), *sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))]
# Paths the docs may name that a checkout makes later (setup, the default model, a benchmark's output).
MADE_LATER = ("hf_models/", "perf/out", ".venv", "perf/results/out")
TOP = ("backend/", "kernels/", "perf/", "tests/", "deploy/", "docs/", "scripts/", "model_repository/", "client/",
       "openai_api/", ".ci/")
MODULES = {"trellm_backend": "backend", "trellm_kernels": "kernels", "trellm_client": "client",
           "trellm_openai": "openai_api"}


def text(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def rel(path: str) -> str:
    return os.path.relpath(path, REPO)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but hyphens dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: str) -> set[str]:
    body = re.sub(r"```.*?```", "", text(path), flags=re.S)
    found = {slug(m) for m in re.findall(r"^#+ (.+)$", body, re.M)}
    return found | set(re.findall(r'<a id="([^"]+)"', body))


def code_blocks(doc: str) -> list[str]:
    """Each command line of the doc's bash blocks (continuation lines joined, comments dropped), and each inline code
    span that runs python or make."""
    body = text(doc)
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", body, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if line and not line.startswith("#"):
                lines.append(line)
    prose = re.sub(r"```.*?```", "", body, flags=re.S)
    for span in re.findall(r"`([^`]+)`", prose):
        span = " ".join(span.split())
        if re.match(r"(\S+=\S+ )*(\.venv/bin/)?python3? |make \w", span):
            lines.append(span)
    return lines


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_links_resolve(doc):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text(doc)):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = os.path.normpath(os.path.join(os.path.dirname(doc), path)) if path else doc
        if not os.path.exists(file):
            broken.append(target)
        elif anchor and file.endswith(".md") and anchor not in anchors(file):
            broken.append(target)
    assert not broken, f"{rel(doc)} links to what does not exist: {broken}"


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_named_repository_paths_exist(doc):
    missing = []
    for token in re.findall(r"`([^`\s]+)`", text(doc)):
        path = token.rstrip(".,:;)").split("::")[0]
        if not path.startswith(TOP) and path not in ("Makefile", "Dockerfile", "docker-compose.yml", "pyproject.toml"):
            continue
        if any(c in path for c in "<>*{}[]$") or "..." in path or path.startswith(MADE_LATER):
            continue
        if not os.path.exists(os.path.join(REPO, path)):
            missing.append(path)
    assert not missing, f"{rel(doc)} names paths that do not exist: {sorted(set(missing))}"


@functools.cache
def help_text(command: tuple[str, ...]) -> str:
    r = subprocess.run([sys.executable, *command, "--help"], cwd=REPO, capture_output=True, text=True, timeout=120)
    return r.stdout + r.stderr


def sources_of(command: tuple[str, ...]) -> list[str]:
    """The files that define a command's options: a script, or a module (its __main__ too, for a package)."""
    if command[0] == "-m":
        package, *rest = command[1].split(".")
        base = os.path.join(REPO, MODULES[package], *rest)
        return [p for p in (base + ".py", os.path.join(base, "__main__.py"), os.path.join(base, "server.py"),
                            os.path.join(base, "client.py")) if os.path.exists(p)]
    return [os.path.join(REPO, command[0])]


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_documented_command_flags_exist(doc):
    unknown = []
    makefile = text(os.path.join(REPO, "Makefile"))
    for line in code_blocks(doc):
        words = line.split()
        if words[0] == "make" and len(words) > 1 and "=" not in words[1]:
            if not re.search(rf"^{re.escape(words[1])}:", makefile, re.M):
                unknown.append(line)
            continue
        m = re.search(r"(?:^|\s)(?:\.venv/bin/)?python3? (-m [\w.]+|perf/\w+\.py|scripts/\w+\.py)", line)
        if m is None:
            continue
        command = tuple(m.group(1).split())
        if command[0] == "-m" and command[1].split(".")[0] not in MODULES:
            continue
        source = "".join(text(p) for p in sources_of(command))
        assert source, f"{rel(doc)}: {line!r} names a command with no source here"
        for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", line[m.end():]):
            if f'"{flag}"' not in source and f"'{flag}'" not in source and flag not in help_text(command):
                unknown.append(f"{' '.join(command)} {flag}")
    assert not unknown, f"{rel(doc)} documents options or targets that do not exist: {unknown}"
