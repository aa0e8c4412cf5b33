"""Structured output: a request's guide (JSON schema, any JSON, regex, a choice of strings, an EBNF grammar) turned
into a per-step token mask, with xgrammar (what vLLM and TensorRT-LLM default to).

- `Guide` is the request's constraint as plain data. `Guide.validate` runs where the request is made and is cheap:
  the size cap, the JSON parse, and every JSON-schema keyword against what xgrammar enforces. xgrammar warns in its
  log and drops a keyword it cannot enforce (`uniqueItems`, `not`, `if`, `multipleOf` on numbers...), so the output
  would not follow the schema as sent; here such a keyword is refused by name and path instead.
- `GrammarCompiler` compiles on its own worker thread (xgrammar releases the GIL), one guide at a time, behind a
  cache keyed by the guide: a request waits for its own grammar (loop.py adds it to the engine once it is compiled,
  or fails it after loop.COMPILE_TIMEOUT_S) while every other request keeps decoding. A failed compile fails that
  request only.
- `fill_masks` writes the step's bitmask: one batched xgrammar call for the rows without guesses; a row with
  speculative guesses is filled after its matcher accepts each guess, then rolled back (the engine accepts what
  verification keeps). A guess the grammar forbids is masked at its own row, so it is rejected like any other
  guess the target would not have sampled: constrained output is the same with speculation on or off.
"""
from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# TRT-LLM's guided_decoding_guide_type values, plus `choice` (vLLM's guided_choice: a JSON list of strings).
GUIDE_TYPES = ("json", "json_schema", "regex", "ebnf_grammar", "choice")
MAX_GUIDE_CHARS = 65536          # compile time grows with the guide; 64 KiB compiles in well under a second here
MAX_SCHEMA_DEPTH = 32            # nesting of a JSON schema (compile time grows steeply with depth)
MAX_CHOICES = 1024
COMPILE_CACHE_ENTRIES = 256

# JSON-schema keywords xgrammar enforces, and the annotations it may ignore without changing what is valid.
SCHEMA_KEYWORDS = {
    "type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems", "maxItems",
    "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions", "minimum", "maximum",
    "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength", "pattern", "format", "minProperties",
    "maxProperties", "patternProperties", "propertyNames", "unevaluatedProperties", "unevaluatedItems",
    "multipleOf"}
ANNOTATIONS = {"title", "description", "default", "examples", "$comment", "$schema", "$id", "readOnly",
               "writeOnly", "deprecated", "contentMediaType", "contentEncoding"}
FORMATS = {"email", "date", "time", "date-time", "duration", "hostname", "uuid", "uri", "uri-reference",
           "uri-template", "json-pointer", "relative-json-pointer", "ipv4", "ipv6"}
# Keywords whose value is a schema, a list of schemas, or a map of name -> schema.
_SUB_SCHEMA = {"items", "additionalProperties", "propertyNames", "unevaluatedProperties", "unevaluatedItems"}
_SCHEMA_LISTS = {"anyOf", "oneOf", "allOf", "prefixItems"}
_SCHEMA_MAPS = {"properties", "$defs", "definitions", "patternProperties"}


class GuideError(ValueError):
    """A guide that cannot be enforced; the message names what and where."""


@dataclass(frozen=True)
class Guide:
    type: str        # one of GUIDE_TYPES
    text: str = ""   # the schema (JSON text), regex, choices (JSON list) or grammar; "" for type json

    def validate(self) -> None:
        if self.type not in GUIDE_TYPES:
            raise GuideError(f"guided_decoding_guide_type must be one of {', '.join(GUIDE_TYPES)}, got {self.type!r}")
        if len(self.text) > MAX_GUIDE_CHARS:
            raise GuideError(f"the {self.type} guide has {len(self.text)} characters; at most {MAX_GUIDE_CHARS} are "
                             "allowed")
        if self.type in ("json_schema", "choice"):
            try:
                value = json.loads(self.text)
            except (json.JSONDecodeError, RecursionError) as e:
                raise GuideError(f"the {self.type} guide is not valid JSON: {e}") from None
            if self.type == "choice":
                _check_choices(value)
            else:
                check_schema(value)
        elif not self.text and self.type != "json":
            raise GuideError(f"the {self.type} guide is empty (guided_decoding_guide)")
        elif self.type == "regex":
            check_regex(self.text, "the regex guide")

    def compiled_text(self) -> str:
        """The text xgrammar compiles: a JSON schema's pattern + length pairs folded into the pattern (fold_lengths),
        since xgrammar would drop the lengths; every other guide as sent."""
        if self.type == "json_schema" and '"pattern"' in self.text and "Length" in self.text:
            return json.dumps(fold_lengths(json.loads(self.text)))
        return self.text

    def ebnf_of_choices(self) -> str:
        return "root ::= " + " | ".join(json.dumps(c) for c in json.loads(self.text))


def _check_choices(value) -> None:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise GuideError("a choice guide must be a non-empty JSON list of non-empty strings")
    if len(value) > MAX_CHOICES:
        raise GuideError(f"a choice guide has {len(value)} entries; at most {MAX_CHOICES} are allowed")


# One character (a class, an escape, a dot or a literal), optionally anchored and repeated: the patterns a length
# folds into.
_REPEATED_ATOM = re.compile(
    r"(\^?)(\[(?:\\.|[^\\\]])+\]|\\[dDwWsS]|\\[^A-Za-z0-9]|[^\\\[\]().*+?{}|^$]|\.)(\*|\+|\?|\{(\d+)(,(\d*))?\})?(\$?)")
_LOOKAROUNDS = ("?=", "?!", "?<=", "?<!")


def check_regex(regex: str, what: str) -> None:
    """Raise GuideError for a regex construct xgrammar's converter drops with a warning instead of enforcing:
    lookahead and lookbehind assertions. (What it cannot parse at all fails the compile, with its own message.)"""
    i, in_class = 0, False
    while i < len(regex):
        ch = regex[i]
        if ch == "\\":
            i += 2
            continue
        if in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
        elif ch == "(" and regex.startswith(_LOOKAROUNDS, i + 1):
            raise GuideError(f"{what} uses a lookaround assertion ({regex[i:i + 4]}... at position {i}), which is "
                             "not supported")
        i += 1


def fold_length(pattern: str, min_length: int, max_length: int | None) -> str | None:
    """`pattern` with a string length in [min_length, max_length] folded in, where the pattern is one repeated
    character class (such as ^[a-z]+$: each repetition is one character); None for any other pattern."""
    m = _REPEATED_ATOM.fullmatch(pattern)
    if m is None:
        return None
    quantifier = m.group(3) or ""
    lo, hi = {"": (1, 1), "*": (0, None), "+": (1, None), "?": (0, 1)}.get(quantifier, (None, None))
    if lo is None:   # {m}, {m,}, {m,n}
        lo = int(m.group(4))
        hi = lo if m.group(5) is None else (int(m.group(6)) if m.group(6) else None)
    lo = max(lo, min_length)
    hi = max_length if hi is None else hi if max_length is None else min(hi, max_length)
    if hi is not None and lo > hi:
        return None
    return f"{m.group(1)}{m.group(2)}{{{lo},{'' if hi is None else hi}}}{m.group(7)}"


def fold_lengths(schema):
    """The schema with each pattern + minLength/maxLength pair replaced by the folded pattern (check_schema has
    refused the pairs that do not fold)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if isinstance(out.get("pattern"), str) and ("minLength" in out or "maxLength" in out):
        out["pattern"] = fold_length(out["pattern"], out.pop("minLength", 0), out.pop("maxLength", None))
    for key, value in out.items():
        if key in _SUB_SCHEMA:
            out[key] = fold_lengths(value)
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            out[key] = [fold_lengths(v) for v in value]
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: fold_lengths(v) for name, v in value.items()}
    return out


def _check_string_keywords(schema: dict, path: str) -> None:
    """xgrammar enforces a pattern, a format and lengths each alone; lengths beside a format it drops, and beside a
    pattern they are folded into it where they can be."""
    lengths = [k for k in ("minLength", "maxLength") if k in schema]
    pattern = schema.get("pattern")
    if pattern is not None:
        if not isinstance(pattern, str):
            raise GuideError(f"JSON schema keyword 'pattern' (at {path}/pattern) must be a string")
        check_regex(pattern, f"the JSON schema pattern at {path}/pattern")
    if not lengths:
        return
    for k in lengths:
        if not isinstance(schema[k], int) or isinstance(schema[k], bool) or schema[k] < 0:
            raise GuideError(f"JSON schema keyword {k!r} (at {path}/{k}) must be a non-negative integer")
    if "format" in schema:
        raise GuideError(f"JSON schema 'format' with {' and '.join(map(repr, lengths))} (at {path}) is not supported: "
                         "the lengths would not be enforced")
    if pattern is not None and fold_length(pattern, schema.get("minLength", 0), schema.get("maxLength")) is None:
        raise GuideError(f"JSON schema 'pattern' with {' and '.join(map(repr, lengths))} (at {path}) is supported only "
                         "where the pattern is one repeated character class such as ^[a-z]+$ that admits those "
                         "lengths; write the lengths into the pattern instead")


def check_schema(schema, path: str = "#", depth: int = 0) -> None:
    """Raise GuideError naming the first keyword (and its path) that xgrammar would not enforce."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise GuideError(f"the JSON schema at {path} must be an object or a boolean")
    if depth > MAX_SCHEMA_DEPTH:
        raise GuideError(f"the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels at {path}")
    _check_string_keywords(schema, path)
    for name in schema.get("patternProperties", {}) if isinstance(schema.get("patternProperties"), dict) else ():
        check_regex(name, f"the JSON schema patternProperties name at {path}/patternProperties")
    for key, value in schema.items():
        where = f"{path}/{key}"
        if key in ANNOTATIONS:
            continue
        if key not in SCHEMA_KEYWORDS:
            raise GuideError(f"JSON schema keyword {key!r} (at {where}) is not supported")
        if key == "format" and value not in FORMATS:
            raise GuideError(f"JSON schema format {value!r} (at {where}) is not supported; supported: "
                             f"{', '.join(sorted(FORMATS))}")
        if key == "multipleOf" and schema.get("type") != "integer":
            raise GuideError(f"JSON schema keyword 'multipleOf' (at {where}) is supported for type integer only")
        if key == "allOf" and isinstance(value, list) and len(value) > 1:
            raise GuideError(f"JSON schema keyword 'allOf' (at {where}) is supported with one schema only")
        if key in _SUB_SCHEMA and isinstance(value, (dict, bool)):
            check_schema(value, where, depth + 1)
        elif key in _SCHEMA_LISTS:
            if not isinstance(value, list):
                raise GuideError(f"JSON schema keyword {key!r} (at {where}) must be a list of schemas")
            for i, sub in enumerate(value):
                check_schema(sub, f"{where}/{i}", depth + 1)
        elif key in _SCHEMA_MAPS:
            if not isinstance(value, dict):
                raise GuideError(f"JSON schema keyword {key!r} (at {where}) must map names to schemas")
            for name, sub in value.items():
                check_schema(sub, f"{where}/{name}", depth + 1)


@dataclass
class CompileStats:
    """Since start: compile requests, how many the cache answered, seconds spent compiling; mask-filling seconds
    and the steps that filled masks."""
    requests: int = 0
    cache_hits: int = 0
    compile_s: float = 0.0
    mask_s: float = 0.0
    mask_steps: int = 0


class GrammarCompiler:
    """Guides -> xgrammar CompiledGrammar futures, compiled one at a time on a worker thread, cached by guide."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids):
        import xgrammar as xgr
        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(stop_token_ids))
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self.batch = xgr.BatchGrammarMatcher(max_threads=1)   # on the stepping thread, beside the compute's threads
        self._cache: OrderedDict[Guide, Future] = OrderedDict()
        self._lock = threading.Lock()
        self.vocab_size = vocab_size
        self.stats = CompileStats()

    def compile(self, guide: Guide) -> Future:
        """The guide's compiled grammar, as a future (done at once for a cached guide). Thread-safe."""
        with self._lock:
            self.stats.requests += 1
            fut = self._cache.get(guide)
            if fut is not None and not (fut.done() and fut.exception() is not None):
                self.stats.cache_hits += 1
                self._cache.move_to_end(guide)
                return fut
            fut = self._cache[guide] = self._pool.submit(self._compile, guide)
            while len(self._cache) > COMPILE_CACHE_ENTRIES:
                self._cache.popitem(last=False)
            return fut

    def _compile(self, guide: Guide):
        start = time.perf_counter()
        c = self._compiler
        try:
            if guide.type in ("json", "json_schema"):   # json: any JSON object (OpenAI's json_object)
                # Compact separators: with any whitespace allowed, a sampled answer can pad itself without end.
                return c.compile_json_schema(guide.compiled_text() or '{"type": "object"}', any_whitespace=False)
            if guide.type == "regex":
                return c.compile_regex(guide.text)
            if guide.type == "choice":
                return c.compile_grammar(guide.ebnf_of_choices())
            return c.compile_grammar(guide.text)
        except Exception as e:   # xgrammar's parse errors: RuntimeError with the C++ location first
            message = str(e).strip().splitlines()[0].split("] ", 1)[-1]
            raise GuideError(f"the {guide.type} guide cannot be compiled: {message}") from None
        finally:
            with self._lock:
                self.stats.compile_s += time.perf_counter() - start

    def matcher(self, compiled):
        return self._xgr.GrammarMatcher(compiled)


@dataclass
class GuidedRow:
    """One sampled row of a guided request: its matcher and the guesses before this row in the step."""
    matcher: object
    guesses: list[int] = field(default_factory=list)


def fill_masks(compiler: GrammarCompiler, rows: list[GuidedRow | None]) -> torch.Tensor | None:
    """The step's token bitmask [rows, ceil(V/32)] (int32, all allowed where a row is unguided), or None when no
    row is guided. Rows of one request follow each other: row j with j guesses before it."""
    if all(r is None for r in rows):
        return None
    start = time.perf_counter()
    xgr = compiler._xgr
    bitmask = xgr.allocate_token_bitmask(len(rows), compiler.vocab_size)
    plain = [i for i, r in enumerate(rows) if r is not None and not r.guesses]
    with_guesses = [i for i, r in enumerate(rows) if r is not None and r.guesses]
    if plain:
        compiler.batch.batch_fill_next_token_bitmask([rows[i].matcher for i in plain], bitmask, plain)
    for i in with_guesses:
        r = rows[i]
        accepted = 0
        for token in r.guesses:
            if not r.matcher.accept_token(token):
                break       # this row follows a guess the grammar forbids: the guess is rejected before it
            accepted += 1
        if accepted == len(r.guesses):
            r.matcher.fill_next_token_bitmask(bitmask, i)
        if accepted:
            r.matcher.rollback(accepted)
    compiler.stats.mask_s += time.perf_counter() - start
    compiler.stats.mask_steps += 1
    return bitmask


def apply_masks(logits: torch.Tensor, bitmask: torch.Tensor, vocab_size: int) -> None:
    """-inf in place for the tokens each row's grammar forbids."""
    import xgrammar as xgr
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=vocab_size)
