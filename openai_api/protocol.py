"""OpenAI request bodies -> the ensemble's fields, and the ensemble's responses -> OpenAI's response objects.

Sampling keys are the request field table's (backend/triton/fields.py, the vLLM contract's JSON names: OpenAI's
`max_tokens`, `temperature`, `top_p`, `seed`, `stop`, `n`, penalties, and vLLM's extras), so their types and ranges
are checked there, once. This module adds what only OpenAI has: `model`, `prompt` / `messages`, `stream`,
`stream_options`, `max_completion_tokens`, `echo`, `logprobs` / `top_logprobs` in their two shapes, `user`, and
chat's tool calls (`tools`, `tool_choice`, `parallel_tool_calls`: tools.py).
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from trellm_backend.triton import fields
from trellm_backend.triton.tokenization import tool_call
from trellm_openai.tools import ToolChoice, ToolError, parse_tool_choice

# OpenAI keys accepted and ignored (they change nothing this server does), and keys refused with a reason.
IGNORED = {"user", "service_tier", "store", "metadata", "modalities", "reasoning_effort", "verbosity"}
# Keys a router in front adds to every body it forwards (SGLang's router: docs/deployment.md, "Routing"),
# accepted at the value this server behaves as anyway and refused by name at any other.
AT_DEFAULT = {"skip_special_tokens": True, "no_stop_trim": False, "return_hidden_states": False,
              "continue_final_message": False, "separate_reasoning": True, "stream_reasoning": True}
MAX_TOP_LOGPROBS = 20          # OpenAI's own limit
MAX_ANSWERS = 64               # prompts x n of one completions request: each is an engine request of its own
OPENAI_ONLY = {"model", "prompt", "messages", "stream", "stream_options", "max_completion_tokens", "echo",
               "logprobs", "top_logprobs", "response_format", "tools", "tool_choice", "parallel_tool_calls"}
# Keys that would change the answer in ways this server cannot do yet: refused by name rather than ignored.
UNSUPPORTED = {"suffix": "suffix (insertion) is not supported",
               "best_of": "best_of is not supported: use n", "functions": "functions is deprecated: use tools",
               "function_call": "function_call is deprecated: use tool_choice", "prediction": "predicted outputs "
               "are not supported"}


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param, code="invalid_value" if param else None)


@dataclass
class Generation:
    """One OpenAI request as the ensemble will be asked it."""
    chat: bool
    model: str
    prompts: list[str] | None           # completions: one or more prompts, each answered n times
    messages: list[dict] | None         # chat
    params: dict                        # ensemble inputs (client.build_inputs names)
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    top_logprobs: int | None = None     # None: no logprobs; else how many alternatives per token
    tools: ToolChoice | None = None     # chat: the tools offered, and how the answer is read as calls
    created: int = field(default_factory=lambda: int(time.time()))
    id: str = field(default_factory=lambda: uuid.uuid4().hex)


def _param_of(message: str, keys) -> str | None:
    """The request key a field-table message names (it starts with the name it was shown)."""
    return next((k for k in keys if message.startswith(k)), None)


def _chat_messages(raw) -> list[dict]:
    """OpenAI's messages -> the ensemble's: content parts joined into one string; an assistant message's tool_calls
    and a tool message's tool_call_id and name kept."""
    if not isinstance(raw, list) or not raw:
        raise invalid("messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise invalid(f"messages[{i}] must be an object with a string role", f"messages[{i}]")
        content = m.get("content")
        if isinstance(content, list):      # content parts: text only
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise invalid(f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
                texts.append(part["text"])
            content = "".join(texts)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise invalid(f"messages[{i}].content must be a string or a list of text parts",
                          f"messages[{i}].content")
        message = {"role": m["role"], "content": content}
        if m.get("tool_calls"):
            message["tool_calls"] = _message_tool_calls(m["tool_calls"], f"messages[{i}].tool_calls")
        for key in ("tool_call_id", "name"):
            if m.get(key) is not None:
                if not isinstance(m[key], str):
                    raise invalid(f"messages[{i}].{key} must be a string", f"messages[{i}].{key}")
                message[key] = m[key]
        out.append(message)
    return out


def _message_tool_calls(calls, where: str) -> list[dict]:
    """An assistant message's tool_calls, checked by preprocess's own rule (so a bad one is a 400 naming it here)
    and passed on as sent."""
    if not isinstance(calls, list):
        raise invalid(f"{where} must be a list of calls", where)
    for k, c in enumerate(calls):
        try:
            tool_call(c, f"{where}[{k}]")
        except ValueError as e:
            raise invalid(str(e), _param_of(str(e), [f"{where}[{k}].function.arguments", f"{where}[{k}]"])) from None
    return calls


def parse(body, chat: bool, tool_call_parser: str | None = None) -> Generation:
    """Validate an OpenAI completions (chat=False) or chat completions body. Raises APIError (400) naming the
    parameter at fault. `tool_call_parser`: how `auto` tool choice reads calls (tools.py), None to refuse it."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model is required: a model id from GET /v1/models", "model")
    for key, why in UNSUPPORTED.items():
        if body.get(key) not in (None, False, [], {}):
            raise invalid(why, key)
    for key, value in AT_DEFAULT.items():
        if key in body and body[key] is not value:
            raise invalid(f"{key}={json.dumps(body[key])} is not supported; only {json.dumps(value)}", key)
    unknown = sorted(k for k in body if k not in OPENAI_ONLY and k not in IGNORED and k not in fields.BY_JSON
                     and k not in UNSUPPORTED and k not in AT_DEFAULT)
    if unknown:
        raise invalid(f"unknown parameter(s) {', '.join(unknown)}", unknown[0])
    sampling = {k: v for k, v in body.items() if k in fields.BY_JSON and k not in ("logprobs",)}
    sampling.update(_response_format(body.get("response_format")))
    tools = _tools(body, chat, tool_call_parser, sampling)
    if body.get("max_completion_tokens") is not None:
        sampling["max_tokens"] = body["max_completion_tokens"]
    if "temperature" not in sampling or sampling["temperature"] is None:
        sampling["temperature"] = 1.0                                  # OpenAI's default (the ensemble's is 0)
    try:
        values = fields.values_from_json(sampling)
    except ValueError as e:
        message = str(e).replace("max_tokens", "max_completion_tokens") \
            if body.get("max_completion_tokens") is not None and str(e).startswith("max_tokens") else str(e)
        raise invalid(message, _param_of(message, [*sampling, "max_completion_tokens"])) from None
    n = values.get("n", 1)
    params = fields.ensemble_inputs_from_values(values)
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise invalid("stream_options must be an object", "stream_options")
    include_usage = bool(options and _flag(options, "include_usage", "stream_options.include_usage"))
    top = _logprobs(body, chat)
    if top is not None and tools is not None and tools.parses_calls:
        raise invalid("logprobs cannot be combined with tool calls (tool_choice other than \"none\")", "logprobs")
    if top is not None:
        params["logprobs"] = top
        params["return_log_probs"] = True
    # Always streamed from the ensemble (so a non-streamed answer is the streamed deltas joined, and no prompt echo).
    params.update(return_num_input_tokens=True, return_num_output_tokens=True, stream=True)
    if chat:
        return Generation(True, model, None, _chat_messages(body.get("messages")), params, n, stream, include_usage,
                          top_logprobs=top, tools=tools)
    prompts = body.get("prompt")
    prompts = [prompts] if isinstance(prompts, str) else prompts
    if isinstance(prompts, list) and prompts and all(isinstance(p, int) or isinstance(p, list) for p in prompts):
        raise invalid("prompt as token ids is not supported: send the text", "prompt")
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) and p for p in prompts):
        raise invalid("prompt must be a non-empty string or a list of them", "prompt")
    if len(prompts) * n > MAX_ANSWERS:
        raise invalid(f"prompt has {len(prompts)} prompts of n={n} answers each; at most {MAX_ANSWERS} answers are "
                      "allowed per request", "prompt")
    return Generation(False, model, prompts, None, params, n, stream, include_usage, _flag(body, "echo"),
                      top_logprobs=top)


def _tools(body: dict, chat: bool, parser: str | None, sampling: dict) -> ToolChoice | None:
    """The request's ToolChoice; its guide joins `sampling`, which must hold no other."""
    if not chat:
        for key in ("tools", "tool_choice", "parallel_tool_calls"):
            if body.get(key) is not None:
                raise invalid(f"{key} is for chat completions (/v1/chat/completions)", key)
        return None
    try:
        tools = parse_tool_choice(body, parser)
    except ToolError as e:
        raise invalid(str(e), e.param) from None
    guide = tools.guide if tools else None
    if guide:
        taken = [k for k in sampling if k in fields.VLLM_GUIDES or k == "structured_outputs"]
        if taken:
            key = "response_format" if body.get("response_format") is not None else taken[0]
            raise invalid(f"{key} cannot be combined with tool_choice \"required\" or a named function, which "
                          "constrain the answer to a call", key)
        sampling.update(guide)
    return tools


def _response_format(fmt) -> dict:
    """The structured-output key of the vLLM contract (fields.VLLM_GUIDES) that OpenAI's response_format means."""
    if fmt is None or fmt == {"type": "text"}:
        return {}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_object":
        return {"guided_json_object": True}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
            raise invalid("response_format.json_schema must be an object with a name and a schema (an object)",
                          "response_format")
        return {"guided_json": spec.get("schema", {})}
    raise invalid("response_format.type must be text, json_object or json_schema", "response_format")


def _flag(obj: dict, key: str, shown: str | None = None) -> bool:
    v = obj.get(key, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise invalid(f"{shown or key} must be true or false, got {json.dumps(v)}", shown or key)
    return v


def _logprobs(body: dict, chat: bool) -> int | None:
    """Completions: `logprobs` is how many alternatives (0-20). Chat: `logprobs` true, `top_logprobs` how many."""
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if chat:
        if lp is None or lp is False:
            if top is not None:
                raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
            return None
        if lp is not True:
            raise invalid("logprobs must be true or false", "logprobs")
        lp = 0 if top is None else top
        name = "top_logprobs"
    else:
        if lp is None:
            return None
        name = "logprobs"
    if isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= MAX_TOP_LOGPROBS:
        raise invalid(f"{name} must be an integer in [0, {MAX_TOP_LOGPROBS}], got {json.dumps(lp)}", name)
    return lp


# -- responses -------------------------------------------------------------------------------------------------
FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort", "": None}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chunk_object(g: Generation, choices: list[dict], usage_block: dict | None = None) -> dict:
    obj = {"id": ("chatcmpl-" if g.chat else "cmpl-") + g.id,
           "object": "chat.completion.chunk" if g.chat else "text_completion", "created": g.created,
           "model": g.model, "choices": choices}
    if usage_block is not None:
        obj["usage"] = usage_block
    return obj


def stream_choice(g: Generation, index: int, text: str, finish_reason: str | None, logprobs, first: bool) -> dict:
    if g.chat:
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        if finish_reason and not text and not first:
            delta = {}
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def final_object(g: Generation, texts: list, reasons: list[str | None], logprobs: list, usage_block: dict) -> dict:
    """`texts`: each choice's text, or for chat its message (a dict: content and tool calls)."""
    if g.chat:
        choices = [{"index": i, "message": t, "logprobs": lp, "finish_reason": r}
                   for i, (t, r, lp) in enumerate(zip(texts, reasons, logprobs))]
    else:
        choices = [{"index": i, "text": t, "logprobs": lp, "finish_reason": r}
                   for i, (t, r, lp) in enumerate(zip(texts, reasons, logprobs))]
    return {"id": ("chatcmpl-" if g.chat else "cmpl-") + g.id,
            "object": "chat.completion" if g.chat else "text_completion", "created": g.created, "model": g.model,
            "choices": choices, "usage": usage_block}


def logprobs_block(g: Generation, tokens: list[str], token_logprobs: list[float], top: list, offset: int) -> dict:
    """The logprobs of one response's tokens: chat's `content` list, or completions' four parallel lists
    (text_offset counted from `offset`). `top`: per token [(token text, logprob), ...]."""
    if g.chat:
        return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode("utf-8")),
                             "top_logprobs": [{"token": a, "logprob": b, "bytes": list(a.encode("utf-8"))}
                                              for a, b in alts]}
                            for t, lp, alts in zip(tokens, token_logprobs, top)]}
    offsets, at = [], offset
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": [dict(alts) for alts in top],
            "text_offset": offsets}
