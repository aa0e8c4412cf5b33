"""The OpenAI-compatible front door (`python -m trellm_openai`): a client of tritonserver that speaks the OpenAI
API, with API keys and per-key limits. server.py: the HTTP side; protocol.py: bodies and answers; keys.py: keys."""
