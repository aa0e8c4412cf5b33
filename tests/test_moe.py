"""Mixture of experts outside the Triton kernel (test_kernels.py has that): the router against transformers' own, the
CPU path (each expert's tokens through `linear`) against the float64 reference, and what a MoE folder may not ask."""
import json
import os

import pytest
import torch

from hf_models import model_dir_for
from kernel_cases import moe_case, randn
from rounding import assert_within_rounding, exact_moe
from trellm_backend.models.config import ModelConfigError, load_model_config
from trellm_backend.models.lora import AdapterError, load_adapter
from trellm_kernels import linear, moe


@pytest.mark.parametrize("family, renormalize", [("mixtral", True), ("qwen3_moe", False), ("qwen3_moe", True)])
def test_route_is_transformers_router(family, renormalize):
    import transformers
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter
    if family == "mixtral":
        router = MixtralTopKRouter(transformers.MixtralConfig(hidden_size=24, num_local_experts=16,
                                                              num_experts_per_tok=3))
    else:
        router = Qwen3MoeTopKRouter(transformers.Qwen3MoeConfig(hidden_size=24, num_experts=16, num_experts_per_tok=3,
                                                                norm_topk_prob=renormalize))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        router.weight.copy_(randn(g, 16, 24))
        x = randn(g, 40, 24)
        _, hf_weights, hf_ids = router(x)
    weights, ids = moe.route(x @ router.weight.detach().T, 3, renormalize)
    assert torch.equal(ids, hf_ids)
    assert torch.equal(weights, hf_weights.float())


def as_experts(w13, w2, quantization="none") -> moe.Experts:
    return moe.Experts([linear.prepare_weight(w.contiguous(), quantization) for w in w13],
                       [linear.prepare_weight(w.contiguous(), quantization) for w in w2])


@pytest.mark.parametrize("tokens, experts, top_k, hidden, inter", [(1, 4, 1, 32, 16), (9, 8, 2, 64, 48),
                                                                     (130, 16, 4, 48, 40), (5, 64, 8, 16, 24)])
def test_cpu_path_matches_the_reference(tokens, experts, top_k, hidden, inter):
    x, w13, w2, weights, ids = moe_case(tokens, experts, top_k, hidden, inter)
    assert_within_rounding(moe.fused_moe(x, as_experts(w13, w2), weights, ids), exact_moe(x, w13, w2, weights, ids))


def test_int8_experts_are_quantized_at_load_and_serve(tmp_path):
    """quantization=int8 applies to each expert's linears as to the dense ones (their arithmetic is the INT8
    operator's, tested in test_kernels.py and test_cpu_ops.py); the router and the LM head keep the dtype."""
    from test_engine import GREEDY, run
    from trellm_backend.engine.config import EngineConfig
    from trellm_backend.engine.engine import LLMEngine
    folder = model_dir_for(str(tmp_path), "mixtral-moe8")
    engine = LLMEngine(EngineConfig(model_path=folder, quantization="int8", kv_cache_bytes=8 << 20))
    layer = engine.runner.model.layers[0]
    assert all(w.qweight is not None and w.qweight.dtype == torch.int8
               for w in layer.sparse.experts.gate_up + layer.sparse.experts.down)
    assert layer.sparse.router.dtype == torch.float32
    out = run(engine, [[1, 5, 9, 30], [2, 7]], GREEDY)
    assert [len(o["tokens"]) for o in out] == [GREEDY.max_tokens] * 2


def test_experts_no_token_chose_are_not_run():
    """An expert with NaN weights that the router never picks leaves no trace: only the chosen experts run."""
    x, w13, w2, weights, ids = moe_case(12, 8, 2, 32, 16)
    unused = sorted(set(range(8)) - set(ids.unique().tolist()))
    if not unused:
        ids = ids % 6
        unused = [6, 7]
    w13[unused], w2[unused] = float("nan"), float("nan")
    out = moe.fused_moe(x, as_experts(w13, w2), weights, ids)
    assert torch.isfinite(out).all()


def write_config(folder, **changes):
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        c = json.load(f)
    c.update(changes)
    with open(path, "w") as f:
        json.dump(c, f)


@pytest.mark.parametrize("changes, message", [
    (dict(num_experts_per_tok=9), "num_experts_per_tok=9 is more than the 8 experts"),
    (dict(num_local_experts=0), "num_local_experts=0 must be an integer >= 1"),
    (dict(quantization_config=dict(quant_method="gptq", bits=4, group_size=128)),
     "quantization_config with experts (mixtral) is not supported"),
])
def test_a_moe_folder_outside_what_is_served_is_refused_by_name(tmp_path, changes, message):
    folder = model_dir_for(str(tmp_path), "mixtral-moe8")
    write_config(folder, **changes)
    with pytest.raises(ModelConfigError, match=r"config\.json: " + message.replace("(", r"\(").replace(")", r"\)")):
        load_model_config(folder)


def test_mlp_only_layers_outside_the_model_are_refused(tmp_path):
    folder = model_dir_for(str(tmp_path), "qwen2-moe-shared")
    write_config(folder, mlp_only_layers=[2])
    with pytest.raises(ModelConfigError, match=r"mlp_only_layers=\[2\] must list layer indices in \[0, 2\)"):
        load_model_config(folder)


def test_lora_on_experts_is_refused_by_name(tmp_path):
    from safetensors.torch import save_file
    folder = model_dir_for(str(tmp_path), "qwen3-moe8-qknorm")
    cfg = load_model_config(folder)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                            "target_modules": ["gate_proj"]}))
    key = "base_model.model.model.layers.0.mlp.experts.3.gate_proj.lora_A.weight"
    save_file({key: torch.zeros(4, cfg.hidden_size),
               key.replace("lora_A", "lora_B"): torch.zeros(cfg.moe.intermediate_size, 4)},
              str(adapter / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match="targets the experts of mixture-of-experts layer 0; LoRA on experts is "
                                           "not supported"):
        load_adapter("a", str(adapter), cfg, 8, torch.float32, torch.device("cpu"))
