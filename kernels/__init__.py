"""Hot-path operations of the engine, one module per operation.

Each module holds the PyTorch reference (which also serves CPUs and is the kernels' test oracle) and the one
dispatch function the engine calls. dispatch.py holds the choice's settings (the TRELLM_* environment variables,
read once) and `use_triton(t)`: a Triton-lang kernel runs on CUDA tensors always, on CPU tensors only when
TRELLM_FORCE_TRITON=1 together with TRITON_INTERPRET=1 (Triton's interpreter), which is how the tests check
kernels without a GPU; otherwise a CPU tensor takes the C++ operator where there is one, else the reference.

The package itself imports nothing, so that formats.py (plain values) loads without torch.
"""
