"""The OpenAI-compatible front door (`python -m trellm_openai`): a client of tritonserver that speaks the OpenAI
API, with API keys and per-key limits. server.py: the HTTP side; protocol.py: bodies and answers; keys.py: keys;
relay.py and grpc_relay.py: Triton's KServe v2 HTTP routes and gRPC API on the door's public ports."""
