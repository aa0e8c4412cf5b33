"""Client of the repository's LLM service over tritonclient gRPC and HTTP."""
