"""Prompt text or chat messages -> token ids, shared by `preprocess` (ensemble) and `vllm_model`."""
from __future__ import annotations

import json
import os

from trellm_backend.models.config import ModelConfigError, load_model_config

# Tokenizing a huge prompt holds up every request behind it in the same model instance, only for the engine to refuse
# it. A token of text is a few characters; this many per token of the model's context is more than any real prompt
# that fits, so longer ones are refused before tokenizing.
CHARS_PER_TOKEN_BOUND = 32


# One of these must exist for AutoTokenizer to build the model's tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def require_tokenizer_files(path: str) -> None:
    if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        raise ModelConfigError(f"{path}: no tokenizer files (one of {', '.join(TOKENIZER_FILES)}); copy the "
                               "checkpoint's tokenizer into the model folder")


def prompt_char_limit(model_path: str) -> int:
    return CHARS_PER_TOKEN_BOUND * load_model_config(model_path).max_position_embeddings


# Folders whose tokenizer AutoTokenizer would load as transformers' generic tokenizers.json class (the project's own
# models, Llama 3's): a tokenizer.json declared as that class, for a model type AutoTokenizer maps to no class of its
# own (Qwen2's, for one, it overrides). tests/test_detokenizer.py checks both loads agree on such folders.
GENERIC_TOKENIZER_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")
GENERIC_TOKENIZER_MODEL_TYPES = ("llama", "mistral")


def load_tokenizer(path: str):
    """The folder's tokenizer, as AutoTokenizer.from_pretrained(path) makes it. Where that is the generic class
    (above), the class is loaded directly: AutoTokenizer imports torch and every model config first, about 4 s in each
    of the four Triton models that load a tokenizer, all at once at the server's start."""
    def read(name: str) -> dict:
        try:
            with open(os.path.join(path, name), encoding="utf-8") as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}
    tc = read("tokenizer_config.json")
    if (tc.get("tokenizer_class") in GENERIC_TOKENIZER_CLASSES and "auto_map" not in tc
            and read("config.json").get("model_type") in GENERIC_TOKENIZER_MODEL_TYPES
            and os.path.isfile(os.path.join(path, "tokenizer.json"))):
        from transformers import PreTrainedTokenizerFast
        return PreTrainedTokenizerFast.from_pretrained(path)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def decode_utf8(value, field: str) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{field} is not valid UTF-8: {e}") from None
    return str(value)


def _json(text: str, name: str):
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:   # json's parser recurses once per nesting level
        raise ValueError(f"{name} is not valid JSON: {e!r}") from None


def parse_messages(text: str) -> list[dict]:
    """A chat as JSON: a list of {"role": ..., "content": ...}; an assistant message may carry OpenAI's
    `tool_calls` (content null), whose `arguments` (a JSON string there) become objects, as templates print them
    (vLLM hands them over the same way). Raises ValueError naming what is wrong."""
    messages = _json(text, "messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError('messages must be a non-empty JSON list of {"role": ..., "content": ...} objects')
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not (
                isinstance(m.get("content"), str) or (m.get("content") is None and m.get("tool_calls"))):
            raise ValueError(f'messages[{i}] must be an object with string "role" and "content", got {json.dumps(m)}')
        if m.get("tool_calls") is not None:
            m["tool_calls"] = [tool_call(c, f"messages[{i}].tool_calls[{k}]")
                               for k, c in enumerate(m["tool_calls"] if isinstance(m["tool_calls"], list) else [0])]
    return messages


def tool_call(c, where: str) -> dict:
    """One of a message's tool_calls, its arguments as an object; raises ValueError naming `where`."""
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or \
            not isinstance(fn.get("arguments"), (str, dict)):
        raise ValueError(f'{where} must be {{"type": "function", "function": {{"name", "arguments"}}}} (tool_calls '
                         "a list of them)")
    arguments = fn["arguments"]
    if isinstance(arguments, str):
        arguments = _json(arguments, f"{where}.function.arguments")
    return {**c, "function": {**fn, "arguments": arguments}}


def parse_tools(text: str) -> list[dict]:
    """Tools as JSON: a list of objects (OpenAI's function tools), as chat templates take them."""
    tools = _json(text, "tools")
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise ValueError('tools must be a JSON list of objects ({"type": "function", "function": {...}})')
    return tools


def encode_prompt(tokenizer, text: str | None = None, messages: str | None = None,
                  max_chars: int | None = None, tools: str | None = None) -> list[int]:
    """Token ids of a prompt (special tokens such as BOS added) or of chat messages rendered by the tokenizer's
    chat template with the assistant's turn opened, and the `tools` (JSON) the template shows the model. Exactly
    one of text and messages must be given, of at most `max_chars` characters with the tools (prompt_char_limit)."""
    if (text is None) == (messages is None):
        raise ValueError("text_input is missing: every request needs a prompt (text_input, or messages for chat)"
                         if text is None else "send either text_input or messages, not both")
    if tools is not None and messages is None:
        raise ValueError("tools go with messages (chat): a plain text_input has no template to show them")
    given = text if text is not None else messages + (tools or "")
    if max_chars is not None and len(given) > max_chars:
        shown = "text_input has" if text is not None else "messages and tools have" if tools else "messages has"
        raise ValueError(f"{shown} {len(given)} characters; at most {max_chars} are allowed "
                         f"({CHARS_PER_TOKEN_BOUND} per token of the model's context)")
    if messages is not None:
        chat = parse_messages(messages)
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("messages needs a chat template, and this model's tokenizer has none")
        tool_list = None if tools is None else parse_tools(tools)
        try:
            rendered = tokenizer.apply_chat_template(chat, tools=tool_list, tokenize=False, add_generation_prompt=True)
        except Exception as e:   # noqa: BLE001 -- jinja's errors on messages the template cannot print: this request's
            raise ValueError(f"the model's chat template cannot render these messages: {e!r}") from None
        # The template writes any BOS itself.
        return tokenizer(rendered, add_special_tokens=False).input_ids
    if not text:
        raise ValueError("text_input is empty: send at least one character of prompt")
    return tokenizer(text).input_ids
