"""Prompt text or chat messages -> token ids, shared by `preprocess` (ensemble) and `vllm_model`."""
from __future__ import annotations

import json


def load_tokenizer(path: str):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def decode_utf8(value, field: str) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{field} is not valid UTF-8: {e}") from None
    return str(value)


def parse_messages(text: str) -> list[dict]:
    """A chat as JSON: a list of {"role": ..., "content": ...}; raises ValueError naming what is wrong."""
    try:
        messages = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"messages is not valid JSON: {e}") from None
    if not isinstance(messages, list) or not messages:
        raise ValueError('messages must be a non-empty JSON list of {"role": ..., "content": ...} objects')
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f'messages[{i}] must be an object with string "role" and "content", got {json.dumps(m)}')
    return messages


def encode_prompt(tokenizer, text: str | None = None, messages: str | None = None) -> list[int]:
    """Token ids of a prompt (special tokens such as BOS added) or of chat messages rendered by the tokenizer's
    chat template with the assistant's turn opened. Exactly one of the two must be given."""
    if (text is None) == (messages is None):
        raise ValueError("text_input is missing: every request needs a prompt (text_input, or messages for chat)"
                         if text is None else "send either text_input or messages, not both")
    if messages is not None:
        chat = parse_messages(messages)
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("messages needs a chat template, and this model's tokenizer has none")
        rendered = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        # The template writes any BOS itself.
        return tokenizer(rendered, add_special_tokens=False).input_ids
    if not text:
        raise ValueError("text_input is empty: send at least one character of prompt")
    return tokenizer(text).input_ids
