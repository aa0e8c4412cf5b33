"""The Triton layer: the request contracts (field table, `llm`, `ensemble`, `vllm_model`), responses, metrics and
load-time checks, all without importing `triton_python_backend_utils`, so they run in unit tests; the
`model_repository/*/1/model.py` files only hand Triton's objects to them. Uses the engine layer below it."""
