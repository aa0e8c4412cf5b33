"""The engine layer: requests in, token deltas out, with no Triton in sight (it runs in tests and benchmarks
alone). It uses `trellm_backend.models` for the forward pass and nothing above it."""
