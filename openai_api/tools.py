"""Tool calls: OpenAI's `tools` and `tool_choice` on chat completions, as vLLM's front end reads them.

The tools go to the model's chat template (preprocess renders them with the messages), and the answer's text becomes
the message's `tool_calls`. How the text is made and read depends on `tool_choice`:
- a named function (`{"type": "function", "function": {"name": ...}}`): the answer is constrained to the function's
  `parameters` schema (structured output), so the whole answer is the call's arguments, valid JSON of that schema;
- `required`: the answer is constrained to a JSON list of one or more `{"name", "parameters"}` objects, each naming
  one of the tools with its own arguments (one at most when `parallel_tool_calls` is false);
- `auto` (the default when tools are given): the model decides, writing calls in its own format, which the front
  door reads with the parser it was started with (`--tool-call-parser`). Models differ in that format, so without
  a parser `auto` is refused by name, as vLLM refuses it. `hermes` (Hermes', Qwen2.5's and Qwen3's format, and this
  project's default model's template): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of
  them; text before the first call is the message's content. `llama3_json` (Llama 3.1-3.3's format for JSON
  tool calls): an answer that is `{"name": ..., "parameters": {...}}`, several joined by `;`, after an optional
  `<|python_tag|>`; an answer that starts otherwise is content;
- `none`: the tools are still shown to the model (vLLM does the same) and the answer is plain content.

A streamed named call streams its arguments as they come. `required` and `auto` hold the call text back and send
the calls whole when the answer ends (text before an `auto` answer's first call streams as content): a partial
call cannot be parsed, and a client reads calls only once they are whole anyway.
"""
from __future__ import annotations

import functools
import json
import re
import uuid
from dataclasses import dataclass

from trellm_backend.engine.structured_output import Guide, GuideError, check_schema

TOOL_CALL_PARSERS = ("hermes", "llama3_json")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")     # OpenAI's rule for function names
MAX_TOOLS = 128                                        # OpenAI's own limit
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}   # a function without parameters


class ToolError(ValueError):
    """A tools or tool_choice value that cannot be served; `param` is the request key it names."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolChoice:
    """What a request's tools ask of its answer."""
    mode: str                  # "none", "auto", "required" or "named"
    tools: tuple               # the request's tools (validated), as the chat template gets them
    name: str | None = None    # the function, when mode is "named"
    parallel: bool = True      # parallel_tool_calls
    parser: str = "hermes"     # how an `auto` answer's calls are written (TOOL_CALL_PARSERS)

    @property
    def parses_calls(self) -> bool:
        return self.mode != "none"

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    @functools.cached_property
    def guide(self) -> dict | None:
        """The structured-output key (the field table's `guided_json`) that makes the answer a call, or None.
        Built once: parse_tool_choice checks it, and the request sends the same one."""
        schemas = {t["function"]["name"]: t["function"].get("parameters", NO_PARAMETERS) for t in self.tools}
        if self.mode == "named":
            return {"guided_json": schemas[self.name]}
        if self.mode != "required":
            return None
        defs, calls = {}, []
        for name, schema in schemas.items():
            schema = _hoist_definitions(schema, name, defs)
            calls.append({"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                                            "parameters": schema},
                          "required": ["name", "parameters"], "additionalProperties": False})
        return {"guided_json": {"type": "array", "items": {"anyOf": calls}, "minItems": 1,
                                **({} if self.parallel else {"maxItems": 1}), **({"$defs": defs} if defs else {})}}


def _hoist_definitions(schema: dict, tool: str, defs: dict) -> dict:
    """A tool's parameters schema moved under `required`'s list: its `$defs` / `definitions` go to the list's root
    as `TOOL.NAME` (two tools may name theirs alike), and its `$ref`s are rewritten to match. A `$ref` to anything
    else (its own root, say) would point elsewhere once moved, so it is refused by name."""
    local = {**schema.get("definitions", {}), **schema.get("$defs", {})}
    renamed = {name: f"{tool}.{name}" for name in local}

    def moved(node):
        if isinstance(node, list):
            return [moved(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                section, _, rest = value.removeprefix("#/").partition("/")
                name, slash, tail = rest.partition("/")
                if section not in ("$defs", "definitions") or name not in renamed:
                    raise ToolError(f"tools: {tool}'s parameters use $ref {value!r}; with tool_choice \"required\" "
                                    "only references to its own $defs or definitions are supported", "tools")
                out[key] = f"#/$defs/{renamed[name]}{slash}{tail}"
            else:
                out[key] = moved(value)
        return out
    for name, sub in local.items():
        defs[renamed[name]] = moved(sub)
    return moved({k: v for k, v in schema.items() if k not in ("$defs", "definitions")})


def parse_tool_choice(body: dict, parser: str | None) -> ToolChoice | None:
    """A chat body's tools, tool_choice and parallel_tool_calls -> ToolChoice (None without tools). Raises ToolError
    naming the key at fault."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    parallel = True if parallel is None else parallel
    if not isinstance(parallel, bool):
        raise ToolError(f"parallel_tool_calls must be true or false, got {json.dumps(parallel)}",
                        "parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise ToolError("tool_choice needs tools: a list of functions the model may call", "tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ToolError(f"tools must be a list of at most {MAX_TOOLS} functions", "tools")
    names = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise ToolError(f'tools[{i}] must be {{"type": "function", "function": {{"name": ...}}}}', "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
            raise ToolError(f"tools[{i}].function.name must be 1 to 64 letters, digits, _ or -, got "
                            f"{json.dumps(name)}", "tools")
        if name in names:
            raise ToolError(f"tools[{i}].function.name {name!r} names two tools", "tools")
        names.append(name)
        if not isinstance(fn.get("description", ""), str):
            raise ToolError(f"tools[{i}].function.description must be a string", "tools")
        if "parameters" in fn:
            if not isinstance(fn["parameters"], dict):
                raise ToolError(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
            try:
                check_schema(fn["parameters"], f"tools[{i}].function.parameters")
            except GuideError as e:
                raise ToolError(str(e), "tools") from None
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or name not in names:
            raise ToolError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                            f'{{"name": NAME}}}} naming one of the tools ({", ".join(names)})', "tool_choice")
        tool_choice = ToolChoice("named", tuple(tools), name, parallel)
    elif choice not in ("none", "auto", "required"):
        raise ToolError(f'tool_choice must be "none", "auto", "required" or a named function, got '
                        f"{json.dumps(choice)}", "tool_choice")
    elif choice == "auto" and parser is None:
        raise ToolError('tool_choice "auto" (the default when tools are given) needs the front door started with '
                        f"--tool-call-parser ({', '.join(TOOL_CALL_PARSERS)}), the format this model writes calls "
                        'in; "required" or a named function work without one', "tool_choice")
    else:
        tool_choice = ToolChoice(choice, tuple(tools), None, parallel, parser or "hermes")
    guide = tool_choice.guide
    if guide:   # the wrapped schemas, checked as a guide the engine would be sent (depth and size included)
        try:
            Guide("json_schema", json.dumps(guide["guided_json"])).validate()
        except GuideError as e:
            raise ToolError(f"tools, as tool_choice {tool_choice.mode} sends them: {e}", "tools") from None
    return tool_choice


def call(name: str, arguments: str) -> dict:
    """One entry of a message's tool_calls."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


@dataclass
class ParsedAnswer:
    content: str | None
    calls: list[dict]


def parse_answer(choice: ToolChoice, text: str) -> ParsedAnswer:
    """A whole answer's text -> its content and tool calls. Text that does not parse as calls of the tools (an
    answer cut short by max_tokens, a malformed call, a name that is none of the tools) stays content, whole, so
    nothing the model wrote is lost. Once calls parse, text after the first one is dropped (as vLLM's parsers do)."""
    if choice.mode == "named":
        return ParsedAnswer(None, [call(choice.name, text)])
    if choice.mode == "required":
        try:
            items = json.loads(text)
        except (ValueError, RecursionError):
            items = None
        if not isinstance(items, list) or not items or not all(
                isinstance(c, dict) and c.get("name") in choice.names and isinstance(c.get("parameters"), dict)
                for c in items):
            return ParsedAnswer(text, [])
        return ParsedAnswer(None, [call(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in items])
    if choice.mode == "auto":
        return parse_llama3_json(text, choice) if choice.parser == "llama3_json" else parse_hermes(text, choice)
    return ParsedAnswer(text, [])


def _named_call(obj, choice: ToolChoice, arguments_key: str) -> dict | None:
    """A decoded call object as a tool_calls entry, or None unless it names one of the tools with object arguments."""
    if not isinstance(obj, dict) or obj.get("name") not in choice.names:
        return None
    arguments = obj.get("arguments", obj.get(arguments_key, {}))   # "arguments" first where both are, as vLLM
    return call(obj["name"], json.dumps(arguments, ensure_ascii=False)) if isinstance(arguments, dict) else None


def parse_llama3_json(text: str, choice: ToolChoice) -> ParsedAnswer:
    """The whole answer as `{"name", "parameters"}` calls joined by `;` (an optional `<|python_tag|>` first)."""
    body = text.lstrip().removeprefix(PYTHON_TAG).lstrip()
    if not body.startswith("{"):
        return ParsedAnswer(text, [])
    decoder, calls, at = json.JSONDecoder(), [], 0
    while True:
        try:
            obj, at = decoder.raw_decode(body, at)
        except (ValueError, RecursionError):
            return ParsedAnswer(text, [])
        entry = _named_call(obj, choice, "parameters")
        if entry is None:
            return ParsedAnswer(text, [])
        calls.append(entry)
        rest = body[at:].lstrip()
        if not rest or rest.rstrip() == ";":
            return ParsedAnswer(None, calls if choice.parallel else calls[:1])
        if not rest.startswith(";") or not rest[1:].lstrip().startswith("{"):
            return ParsedAnswer(text, [])
        at = len(body) - len(rest[1:].lstrip())


def parse_hermes(text: str, choice: ToolChoice) -> ParsedAnswer:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of them (the first only when
    parallel_tool_calls is false), each JSON read whole (so a "</tool_call>" inside an argument's string is text);
    the last may be left unclosed by a stop."""
    start = text.find(HERMES_OPEN)
    if start < 0:
        return ParsedAnswer(text, [])
    decoder, calls, at = json.JSONDecoder(), [], start
    while at >= 0:
        body = at + len(HERMES_OPEN)
        try:
            obj, end = decoder.raw_decode(text, body + len(text[body:]) - len(text[body:].lstrip()))
        except (ValueError, RecursionError):
            return ParsedAnswer(text, [])
        rest = text[end:].lstrip()
        entry = _named_call(obj, choice, "arguments")
        if entry is None or not (rest.startswith(HERMES_CLOSE) or not rest):
            return ParsedAnswer(text, [])
        calls.append(entry)
        at = text.find(HERMES_OPEN, len(text) - len(rest)) if rest else -1
    return ParsedAnswer(text[:start] or None, calls if choice.parallel else calls[:1])


def streamable_content(choice: ToolChoice, text: str) -> int:
    """How many leading characters of an unfinished answer are surely content, so may stream now: all of a `none`
    answer, none of a `required` one, and of an `auto` one what comes before anything that starts a call (text that
    could still become `<tool_call>` is held back)."""
    if choice.mode == "none":
        return len(text)
    if choice.mode != "auto":
        return 0
    if choice.parser == "llama3_json":   # a call is the whole answer: content only if it starts otherwise
        head = text.lstrip()
        could_call = head.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(head)
        return 0 if could_call else len(text)
    start = text.find(HERMES_OPEN)
    if start >= 0:
        return start
    for keep in range(min(len(HERMES_OPEN) - 1, len(text)), 0, -1):
        if HERMES_OPEN.startswith(text[-keep:]):
            return len(text) - keep
    return len(text)


def final_message(choice: ToolChoice | None, text: str, reason: str | None) -> tuple[dict, str | None]:
    """A non-streamed chat choice: its message and finish reason (`tool_calls` when the model chose to call)."""
    if choice is None or not choice.parses_calls:
        return {"role": "assistant", "content": text}, reason
    parsed = parse_answer(choice, text)
    message = {"role": "assistant", "content": parsed.content}
    if parsed.calls:
        message["tool_calls"] = parsed.calls
    return message, _finish_reason(choice, parsed, reason)


def _finish_reason(choice: ToolChoice, parsed: ParsedAnswer, reason: str | None) -> str | None:
    # OpenAI's: a forced named call ends with "stop"; a call the model chose (or was required to make) with
    # "tool_calls"; an answer cut short keeps "length".
    return "tool_calls" if parsed.calls and choice.mode != "named" and reason == "stop" else reason


class CallStream:
    """One streamed chat choice under a ToolChoice that parses calls: the deltas each new piece of text makes.
    The streamed content and calls join to what final_message gives for the same text."""

    def __init__(self, choice: ToolChoice):
        self.choice = choice
        self.sent = 0            # characters of the text already sent (as content, or as a named call's arguments)
        self.started = False
        self.named_id = call(choice.name, "")["id"] if choice.mode == "named" else None

    def deltas(self, text: str, reason: str | None) -> tuple[list[dict], str | None]:
        """The deltas for the answer's text so far (`reason` set when it has ended), and the finish reason."""
        out = []
        if self.choice.mode == "named":
            new = text[self.sent:]
            if not self.started:
                out.append({"role": "assistant", "content": None, "tool_calls": [
                    {"index": 0, "id": self.named_id, "type": "function",
                     "function": {"name": self.choice.name, "arguments": new}}]})
            elif new:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": new}}]})
            self.sent, self.started = len(text), True
            return out, reason
        parsed = parse_answer(self.choice, text) if reason else None
        if parsed is None:
            upto = streamable_content(self.choice, text)
        else:
            upto = len(parsed.content or "") if parsed.calls else len(text)
        new = text[self.sent:max(upto, self.sent)]
        if not self.started:   # a required answer is content only if it turns out not to be calls
            out.append({"role": "assistant", "content": None if self.choice.mode == "required" and not new else new})
        elif new:
            out.append({"content": new})
        self.sent, self.started = max(upto, self.sent), True
        if parsed is not None and parsed.calls:
            out.append({"tool_calls": [{"index": k, **c} for k, c in enumerate(parsed.calls)]})
            reason = _finish_reason(self.choice, parsed, reason)
        return out, reason
