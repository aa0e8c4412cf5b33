"""The model layer: a Hugging Face Llama-family folder read into a forward pass (config, weights, rotary tables,
the layers). It calls `trellm_kernels` for the hot-path operations and knows nothing of requests or scheduling."""
