"""Plain values the kernels accept, importable without torch.

Why a module of its own: model folders are checked where torch is never loaded (preprocess and vllm_model read
config.json to size prompts; only `llm` pays torch's import), and a GPTQ/AWQ folder's group size is checked against
what the INT4 kernels run.
"""

GROUP_SIZES = (32, 64, 128)     # INT4 groups the reference and the Triton kernel run (int4.py)
