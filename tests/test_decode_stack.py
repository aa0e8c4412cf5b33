"""The decoder's layers in one C++ call (models/decode_stack.py, kernels/cpu/decode_layers.cpp) give the same logits
to the bit as the same layers run operator by operator from Python, over prefill, decode and verification steps of
two sequences, for each kind of weight and KV cache it takes; and models or steps it does not take run the Python
loop."""
import pytest
import torch

from hf_models import model_dir_for
from trellm_backend.engine.forward_inputs import StepInputs, allocate_kv_cache
from trellm_backend.models.config import load_model_config
from trellm_backend.models.llama import LlamaModel
from trellm_backend.models.weights import load_state_dict
from trellm_kernels import cpu_ops

pytestmark = pytest.mark.skipif(cpu_ops.load() is None, reason="the C++ CPU operators are not built here")

BLOCK, BLOCKS_PER_SEQ = 16, 4


def load(tmp_path, name: str, dtype: torch.dtype, quantization: str = "none") -> LlamaModel:
    folder = model_dir_for(str(tmp_path), name)
    return LlamaModel(load_model_config(folder), load_state_dict(folder, dtype), torch.device("cpu"), dtype,
                      BLOCK * BLOCKS_PER_SEQ, quantization)


def run_steps(model: LlamaModel, kv_dtype: torch.dtype, steps) -> list[torch.Tensor]:
    """Each step's logits of every row, two sequences. steps: [(tokens of seq 0, tokens of seq 1)], appended."""
    cache, scales = allocate_kv_cache(model.cfg, 2 * BLOCKS_PER_SEQ, BLOCK, kv_dtype, torch.device("cpu"))
    tables = torch.arange(2 * BLOCKS_PER_SEQ, dtype=torch.int32).view(2, BLOCKS_PER_SEQ)
    inputs, lengths, out = StepInputs(torch.device("cpu")), [0, 0], []
    for chunk in steps:
        q_lens = [len(c) for c in chunk]
        rows = torch.arange(sum(q_lens), dtype=torch.int32)
        ids, meta, logits_rows, _ = inputs.build([t for c in chunk for t in c], list(lengths), q_lens, tables, BLOCK,
                                                 rows)
        out.append(model.forward(ids, meta, cache, logits_rows, scales))
        lengths = [n + q for n, q in zip(lengths, q_lens)]
    return out


def steps_of(vocab: int) -> list:
    g = torch.Generator().manual_seed(0)

    def tokens(n):
        return torch.randint(0, vocab, (n,), generator=g).tolist()
    return ([(tokens(20), tokens(7))]                  # prefill: a row longer than the C++ attention takes
            + [(tokens(1), tokens(1)) for _ in range(5)]  # decodes
            + [(tokens(3), tokens(2)), (tokens(1), tokens(1))])   # a verification of guesses, then a decode


CASES = [   # (model, dtype, quantization, KV cache dtype, TRELLM_CPU_LINEAR)
    ("qwen2-bias-gqa4", torch.float32, "none", torch.float32, "cpp"),        # q/k/v biases, GQA
    ("qwen2-bias-gqa4", torch.float32, "none", torch.float32, "onednn"),
    ("qwen2-bias-gqa4", torch.bfloat16, "none", torch.bfloat16, "cpp"),
    ("qwen2-bias-gqa4", torch.bfloat16, "none", torch.bfloat16, "torch"),
    ("qwen2-bias-gqa4", torch.float32, "int8", torch.int8, "cpp"),           # INT8 weights beside an INT8 cache
    ("llama-gqa4-hd128", torch.bfloat16, "int8", torch.float8_e4m3fn, "cpp"),
    ("qwen2-bias-gqa4", torch.float32, "int4-g64", torch.float32, "cpp"),    # INT4 in the group operator's blocks
    ("mistral-sliding", torch.float32, "int8", torch.float32, "cpp"),        # a sliding window
    ("qwen3-qknorm-hd8", torch.float32, "none", torch.float32, "cpp"),       # q/k norms, head_dim 8
    ("gemma2-softcap", torch.float32, "none", torch.float32, "cpp"),         # GELU, capped scores, output norms
    ("gemma3-text", torch.bfloat16, "none", torch.bfloat16, "cpp"),          # sliding layers with their own rope
    ("qwen2-bias-gqa4", torch.float32, "none", torch.float32, "auto"),       # the calls timed at load (the default)
]


@pytest.mark.parametrize("name,dtype,quantization,kv_dtype,cpu_linear", CASES,
                         ids=[f"{n}-{str(d)[6:]}-{q}-kv-{str(k)[6:]}-{c}" for n, d, q, k, c in CASES])
def test_one_call_for_the_layers_gives_the_python_loops_logits_to_the_bit(tmp_path, kernel_settings, monkeypatch,
                                                                          name, dtype, quantization, kv_dtype,
                                                                          cpu_linear):
    kernel_settings(cpu_linear=cpu_linear)     # a written-down rule, not a timed choice: the same layout every run
    model = load(tmp_path, name, dtype, quantization)
    assert model.decode_stack is not None
    steps = steps_of(model.cfg.vocab_size)
    in_python = []
    layers = model._layers
    monkeypatch.setattr(model, "_layers", lambda *a: in_python.append(a[0].shape[0]) or layers(*a))
    stacked = run_steps(model, kv_dtype, steps)
    # the prefill's rows are too long for the stack; the verification's 5 rows run in it where every linear's
    # operator at 5 tokens is the one it holds (not AMX tiles, not a widened weight)
    assert in_python == ([27] if model.decode_stack.takes(5, 3) else [27, 5])
    model.decode_stack = None
    loop = run_steps(model, kv_dtype, steps)
    for i, (a, b) in enumerate(zip(stacked, loop)):
        assert torch.equal(a, b), f"step {i}: the stack's logits differ from the loop's"


def test_a_step_the_stack_takes_runs_in_it(tmp_path, kernel_settings, monkeypatch):
    """The comparison above is meaningful only if the decodes ran in C++: count the Python loop's runs."""
    kernel_settings(cpu_linear="cpp")
    model = load(tmp_path, "qwen2-bias-gqa4", torch.float32, "int8")
    loops = []
    original = model._layers
    monkeypatch.setattr(model, "_layers", lambda *a: loops.append(a[0].shape[0]) or original(*a))
    run_steps(model, torch.float32, steps_of(model.cfg.vocab_size))
    assert loops == [27], "only the prefill (rows of 20 tokens) runs the Python loop"


@pytest.mark.parametrize("name", ["mixtral-moe8", "phi3-longrope"])
def test_sparse_layers_and_longrope_run_the_python_loop(tmp_path, kernel_settings, name):
    kernel_settings(cpu_linear="cpp")
    assert load(tmp_path, name, torch.float32, "int8").decode_stack is None


def test_turned_off_by_the_setting(tmp_path, kernel_settings):
    kernel_settings(cpu_linear="cpp", decode_layers=False)
    assert load(tmp_path, "qwen2-bias-gqa4", torch.float32, "int8").decode_stack is None


def test_the_stack_calls_the_operator_that_linear_calls(kernel_settings, monkeypatch):
    """kernels/linear.py's cpu_operator says which operator `linear` runs for a weight at a token count; the stack
    calls that one itself. For every way a CPU weight is held here and counts across each threshold, `linear` calls
    exactly that operator on that very weight tensor, or (where cpu_operator says None) none of them on it."""
    from trellm_kernels import linear as lin
    ops = cpu_ops.load()
    names = {lin.FP32_PACKED: "fp32_linear", lin.HALF_PACKED: "half_linear", lin.BF16_PAIRS: "bf16_linear",
             lin.INT8_PACKED: "int8_linear", lin.GROUPS: "group_linear", lin.TORCH: "torch", lin.ONEDNN: "onednn"}
    calls = []

    def recorder(name, original, weight_at):
        def record(*args, **kwargs):
            calls.append((name, args[weight_at]))
            return original(*args, **kwargs)
        return record
    for name in ("fp32_linear", "half_linear", "bf16_linear", "int8_linear", "group_linear", "bf16_amx_linear"):
        monkeypatch.setattr(ops, name, recorder(name, getattr(ops, name), 2))
    monkeypatch.setattr(torch.nn.functional, "linear", recorder("torch", torch.nn.functional.linear, 1))
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise",
                        recorder("onednn", torch.ops.mkldnn._linear_pointwise, 1))
    g = torch.Generator().manual_seed(0)
    weights = []
    for dtype in (torch.float32, torch.bfloat16):
        dense = torch.randn(64, 128, generator=g).to(dtype)
        for mode in ("cpp", "onednn", "torch"):
            kernel_settings(cpu_linear=mode)
            held = lin.prepare_weight(dense)
            weights.append(held)
            layout = "cpp" if held.packed is not None else "onednn" if held.prepared is not None else "torch"
            for call in lin.linear_choice.calls_of(layout, dtype, tuple(dense.shape)):   # each call a choice can name
                weights.append(lin.Weight(held.dense, held.prepared, held.packed,
                                          calls=(call,) * len(lin.linear_choice.COUNTS)))
        for quantization in ("int8", "int4-g64"):
            weights.append(lin.prepare_weight(dense, quantization))
    taken = set()
    for w in weights:
        held = [t for t in (w.dense, w.prepared, w.packed, w.qweight, w.int4 and w.int4.groups and w.int4.groups.q)
                if t is not None]
        for tokens in (1, 2, 3, 4, 5, 8, 16, 33, 255, 256):
            x = torch.randn(tokens, 128, generator=g).to(w.scales.dtype if w.scales is not None else held[0].dtype
                                                          if held[0].is_floating_point() else torch.float32)
            calls.clear()
            lin.linear(x, w)
            op = lin.cpu_operator(w, tokens)
            if op is not None:
                assert calls == [(names[op[0]], op[1])] and any(op[1] is t for t in held)
                taken.add(op[0])
            else:
                assert not [c for c in calls if c[0] in names.values() and any(c[1] is t for t in held)], calls
    assert {lin.INT8_PACKED, lin.GROUPS, lin.TORCH, lin.ONEDNN} <= taken
