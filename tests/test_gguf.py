"""GGUF checkpoints: a llama.cpp file of each family we serve, in each tensor type, gives transformers' greedy tokens
on the same file; its config.json and tokenizer derived from the metadata say what the original folder said; what
the engine does not read is refused by name before anything is written.

The files come from the project's own checkpoints through tools/write_gguf.py, which lays tensors out as llama.cpp's
converter does. The oracle is transformers' own GGUF loader (its name mapping, un-permuting and dequantizers) with
the config.json derived here."""
from __future__ import annotations

import json
import os
from dataclasses import replace

import numpy as np
import pytest
import torch

from hf_models import hf_greedy, hf_lora_greedy, hf_model, make_lora, model_greedy, random_prompts, with_tokenizer
from rounding import FIXED_STEPS, Exact, assert_within_rounding
from test_engine import ARRIVALS, GREEDY, LENGTHS, run_staggered
from trellm_backend.engine.config import EngineConfig
from trellm_backend.engine.engine import LLMEngine
from trellm_backend.models.config import ModelConfigError, load_model_config
from trellm_backend.models.gguf import write_hf_files
from trellm_backend.models.rope import default_inv_freq, llama3_inv_freq, long_rope_from, rope_inv_freq
from trellm_backend.tools.write_gguf import quantize, write_gguf, write_gguf_folder
from trellm_kernels.group_quant import GroupWeight, pack

MAX_TOKENS = 10

# case -> (variant of hf_models.VARIANTS, changes to its config, the quantized GGUF types checked against
# transformers' GGUF loader with the derived config.json). Every case is also written in F32 and checked against its
# own folder, which needs no GGUF code on the oracle's side (transformers' loader does not map Mixtral) and checks
# the rope settings llama.cpp keeps in tensors. Changes: what llama.cpp keeps outside the metadata set to what a file
# says (Gemma's attention scale is 1/sqrt(head size); Qwen2-MoE files have no dense layers); widths of 256 where the
# K-quants are checked.
CASES = {
    "llama-gqa4-hd128": ("llama-gqa4-hd128", {}, ("Q8_0", "Q4_0", "Q4_1", "Q4_K_M", "Q5_K", "Q6_K", "BF16", "F16")),
    "llama3-rope-bias": ("llama3-rope-bias", {}, ("Q8_0",)),
    "qwen2-bias-gqa4": ("qwen2-bias-gqa4", {"hidden_size": 256}, ("Q8_0", "Q4_K_M")),
    "qwen3-qknorm-hd8": ("qwen3-qknorm-hd8", {}, ("Q8_0",)),
    "mistral-sliding": ("mistral-sliding", {}, ("Q8_0",)),
    "gemma2-softcap": ("gemma2-softcap", {}, ("Q8_0",)),
    "gemma3-text": ("gemma3-text", {"query_pre_attn_scalar": 16, "hidden_size": 256}, ("Q8_0", "Q4_K_M")),
    "phi3-longrope": ("phi3-longrope", {}, ("Q8_0",)),
    "mixtral-moe8": ("mixtral-moe8", {}, ()),
    "qwen3-moe8-qknorm": ("qwen3-moe8-qknorm", {}, ("Q8_0",)),
    "qwen2-moe-shared": ("qwen2-moe-shared", {"mlp_only_layers": []}, ("Q8_0",)),
}


@pytest.fixture(scope="module")
def hf_variants(tmp_path_factory, default_model_path):
    root = tmp_path_factory.mktemp("gguf-hf")
    return {name: with_tokenizer(variant, default_model_path, str(root / name), changes)
            for name, (variant, changes, _) in CASES.items()}


def gguf_folder(hf_folder: str, out_root, file_type: str) -> str:
    return write_gguf_folder(hf_folder, str(out_root / f"{os.path.basename(hf_folder)}-{file_type}"), file_type)


def transformers_greedy(folder: str, prompts: list[list[int]]) -> list[list[int]]:
    return model_greedy(hf_model(folder), prompts, MAX_TOKENS)


def engine_greedy(folder: str, prompts: list[list[int]]) -> list[list[int]]:
    engine = LLMEngine(EngineConfig(model_path=folder, kv_cache_bytes=16 << 20, dtype="float32"))
    return run_staggered(engine, prompts, ARRIVALS, replace(GREEDY, max_tokens=MAX_TOKENS))


def assert_same(got, expected):
    for i, (e, g) in enumerate(zip(expected, got)):
        assert g == e, f"prompt {i} (length {LENGTHS[i]}): engine {g} != transformers {e}"


@pytest.mark.parametrize("name,file_type", [(n, t) for n, (_, _, types) in CASES.items() for t in types])
def test_a_gguf_file_gives_transformers_greedy_tokens(hf_variants, tmp_path, name, file_type):
    folder = gguf_folder(hf_variants[name], tmp_path, file_type)
    prompts = random_prompts(0, 4096, LENGTHS)
    assert_same(engine_greedy(folder, prompts), transformers_greedy(folder, prompts))


@pytest.mark.parametrize("name", list(CASES))
def test_an_f32_gguf_file_gives_the_original_folders_greedy_tokens(hf_variants, tmp_path, name):
    """The tensor names, llama.cpp's q/k order, Gemma's norms and the stacked experts undone exactly."""
    folder = gguf_folder(hf_variants[name], tmp_path, "F32")
    prompts = random_prompts(0, 4096, LENGTHS)
    assert_same(engine_greedy(folder, prompts), hf_greedy(hf_variants[name], prompts, MAX_TOKENS))


@pytest.mark.parametrize("name", list(CASES))
def test_the_derived_config_says_what_the_checkpoint_said(hf_variants, tmp_path, name):
    original = load_model_config(hf_variants[name])
    derived = load_model_config(gguf_folder(hf_variants[name], tmp_path, "F32"))
    assert replace(derived, path="", dtype="", eos_token_ids=[], rope_scaling=None) == \
        replace(original, path="", dtype="", eos_token_ids=[], rope_scaling=None)
    # the rope's frequencies and longrope's factors, said two ways: the file holds them as float32, and the llama3
    # settings read back from its divisors compute them with other constants (a few float32 roundings)
    for got, want in ((rope_inv_freq(derived)[0], rope_inv_freq(original)[0]),
                      (long_factors(derived), long_factors(original)),
                      (torch.tensor([rope_inv_freq(derived)[1]]), torch.tensor([rope_inv_freq(original)[1]]))):
        want = want.double()
        assert_within_rounding(got.double(), Exact(want, want.abs(), FIXED_STEPS), narrow=torch.float32)
    assert long_rope_from(derived) == long_rope_from(original)
    assert derived.eos_token_ids[0] == original.eos_token_ids[0]
    assert derived.dtype == "float32"


def long_factors(cfg) -> torch.Tensor:
    return torch.tensor((cfg.rope_scaling or {}).get("long_factor", []), dtype=torch.float64)


LLAMA3 = dict(rope_type="llama3", original_max_position_embeddings=64)


@pytest.mark.parametrize("scaling", [
    dict(LLAMA3, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0),    # two frequencies in the blend
    dict(LLAMA3, factor=4.0, low_freq_factor=1.0, high_freq_factor=1.5),    # one
    dict(LLAMA3, factor=32.0, low_freq_factor=1.5, high_freq_factor=2.0),   # none: kept, then scaled
])
def test_llama3_rope_is_read_back_from_its_divisors_however_few_frequencies_blend(scaling):
    """rope_freqs holds a divisor per frequency; the llama3 settings read back give those frequencies whether the
    blend between kept and scaled frequencies has two points or more (the line through them), one, or none."""
    from trellm_backend.models.gguf import GgufTensor, rope_from_tensors
    inv = default_inv_freq(16, 10000.0).double()
    want = llama3_inv_freq(inv, scaling)
    divisors = (inv / want).float().numpy()
    rope = rope_from_tensors("m.gguf", "llama", {}, {"rope_freqs.weight": GgufTensor("rope_freqs.weight", "F32", (8,),
                                                                                     divisors)}, 10000.0, 16)
    assert rope["rope_type"] == "llama3" and rope["factor"] == scaling["factor"]
    assert_within_rounding(llama3_inv_freq(inv, rope), Exact(want, want.abs(), FIXED_STEPS), narrow=torch.float32)
    with pytest.raises(ModelConfigError, match="divisors below 1 or not finite"):
        rope_from_tensors("m.gguf", "llama", {}, {"rope_freqs.weight": GgufTensor(
            "rope_freqs.weight", "F32", (8,), divisors / 2)}, 10000.0, 16)


def test_the_tokenizer_and_chat_template_come_from_the_file(default_model_path, tmp_path):
    from transformers import AutoTokenizer
    folder = gguf_folder(default_model_path, tmp_path, "Q8_0")
    ours, original = AutoTokenizer.from_pretrained(folder), AutoTokenizer.from_pretrained(default_model_path)
    text = "Hello world, a test. <|user|>\n  two  spaces\ttabs 12345 ünïcödé 🙂</s>"
    assert ours(text).input_ids == original(text).input_ids
    assert len(ours) == len(original)
    chat = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        original.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    with open(os.path.join(folder, "generation_config.json")) as f:   # the chat template's end of turn stops too
        assert json.load(f)["eos_token_id"] == load_model_config(default_model_path).eos_token_ids


def rewrite(src: str, dst: str, drop_key: str | None = None, add: dict | None = None,
            tensor_type: dict | None = None, extra_tensor: str | None = None, extra_values=None) -> str:
    """A copy of GGUF file `src` with a metadata key dropped or added, or tensors rewritten in another type."""
    from gguf import GGUFReader, GGUFWriter, GGMLQuantizationType, GGUFValueType
    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(dst, arch=arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", drop_key):
            continue
        value = field.contents()
        kind = field.types[0]
        if kind == GGUFValueType.ARRAY:
            writer.add_key_value(key, value, kind, sub_type=field.types[-1])
        else:
            writer.add_key_value(key, value, kind)
    for key, value in (add or {}).items():
        writer.add_key_value(key, value, GGUFValueType.UINT32)
    for t in reader.tensors:
        if tensor_type and t.name in tensor_type:
            from gguf import quants
            w = quants.dequantize(np.asarray(t.data), t.tensor_type)
            qtype = GGMLQuantizationType[tensor_type[t.name]]
            data = w.astype(np.float16) if qtype == GGMLQuantizationType.F16 else quants.quantize(w, qtype)
            writer.add_tensor(t.name, data, raw_dtype=qtype)
        else:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    if extra_tensor:
        writer.add_tensor(extra_tensor, np.asarray(np.ones(16) if extra_values is None else extra_values,
                                                   dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


@pytest.mark.parametrize("change,message", [
    (dict(add={"llama.attention.clamp_kqv": 8}), "metadata key llama.attention.clamp_kqv is not supported"),
    (dict(add={"split.count": 2}), "split.count: split GGUF files are not supported"),
    (dict(tensor_type={"blk.0.attn_q.weight": "Q5_0"}), "tensor blk.0.attn_q.weight has type Q5_0"),
    (dict(extra_tensor="rope_freqs.weight", extra_values=np.linspace(3, 1, 16)),
     "tensor rope_freqs.weight does not follow Llama 3's rope scaling"),
    (dict(extra_tensor="rope_factors_long.weight"), "rope_factors_long.weight (rope settings) is read for "
                                                    "architecture phi3 only, not llama"),
])
def test_what_the_engine_does_not_read_is_refused_by_name_before_writing(default_model_path, tmp_path, change,
                                                                           message):
    src = tmp_path / "src.gguf"
    write_gguf(default_model_path, str(src), "Q8_0")
    folder = tmp_path / "m"
    folder.mkdir()
    file = rewrite(str(src), str(folder / "m.gguf"), **change)
    with pytest.raises(ModelConfigError) as e:
        write_hf_files(file)
    assert message in str(e.value)
    assert os.listdir(folder) == ["m.gguf"]


def test_an_architecture_we_do_not_serve_is_refused_by_name(default_model_path, tmp_path):
    from gguf import GGUFWriter
    folder = tmp_path / "m"
    folder.mkdir()
    writer = GGUFWriter(str(folder / "m.gguf"), arch="mamba")
    writer.add_tensor("token_embd.weight", np.ones((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelConfigError, match="general.architecture='mamba' is not supported"):
        write_hf_files(str(folder / "m.gguf"))


def test_a_tensor_no_layer_reads_fails_the_load_by_name(default_model_path, tmp_path):
    src = tmp_path / "src.gguf"
    write_gguf(default_model_path, str(src), "Q8_0")
    folder = tmp_path / "m"
    folder.mkdir()
    write_hf_files(rewrite(str(src), str(folder / "model.gguf"), extra_tensor="blk.0.attn_sinks.weight"))
    with pytest.raises(ModelConfigError, match="tensors blk.0.attn_sinks.weight are not read"):
        LLMEngine(EngineConfig(model_path=str(folder), kv_cache_bytes=16 << 20))


@pytest.mark.parametrize("file_type,bound", [("Q4_K", 0.09), ("Q5_K", 0.045), ("Q6_K", 0.022)])
def test_the_writers_k_quants_decode_with_gguf_py(file_type, bound):
    """The K-quant encoders against gguf-py's reference decoders: every weight within the bound of its grid (relative
    to the row's norm), so a layout error (a nibble or a scale in the wrong place) fails."""
    from gguf import quants
    w = np.random.default_rng(0).standard_normal((16, 1024)).astype(np.float32)
    data, qtype = quantize(w, file_type)
    back = quants.dequantize(data, qtype)
    assert back.shape == w.shape
    assert np.linalg.norm(back - w) / np.linalg.norm(w) < bound


def test_prefix_caching_speculation_and_lora_work_on_a_gguf_model(default_model_path, tmp_path):
    """The engine's features are the weights' business only through `linear`: on a Q8_0 file, n-gram speculation and
    prefix caching change no greedy token, and a PEFT adapter on the GGUF base gives transformers + peft's tokens on
    the same file."""
    folder = gguf_folder(default_model_path, tmp_path, "Q8_0")
    prompts = random_prompts(3, 4096, [5, 17, 40])
    prompts = prompts + [p[:4] + p[:4] + p for p in prompts]          # shared prefixes and repeats to guess from
    plain = engine_greedy(folder, prompts)
    assert plain == transformers_greedy(folder, prompts)
    engine = LLMEngine(EngineConfig(model_path=folder, kv_cache_bytes=16 << 20, dtype="float32",
                                    enable_prefix_caching=True, speculative_method="ngram"))
    assert run_staggered(engine, prompts, ARRIVALS, replace(GREEDY, max_tokens=MAX_TOKENS)) == plain
    adapter = make_lora(default_model_path, "attn-r8", str(tmp_path / "lora"))
    engine = LLMEngine(EngineConfig(model_path=folder, kv_cache_bytes=16 << 20, dtype="float32",
                                    lora_adapters=json.dumps({"a": adapter})))
    got = run_staggered(engine, prompts[:3], ARRIVALS, replace(GREEDY, max_tokens=MAX_TOKENS, lora_name="a"))
    assert got == hf_lora_greedy(folder, adapter, prompts[:3], MAX_TOKENS)


def test_a_truncated_or_foreign_file_is_refused_naming_it(default_model_path, tmp_path):
    full = tmp_path / "full.gguf"
    write_gguf(default_model_path, str(full), "Q8_0")
    for size in (100, full.stat().st_size // 2):
        folder = tmp_path / f"cut{size}"
        folder.mkdir()
        (folder / "m.gguf").write_bytes(full.read_bytes()[:size])
        with pytest.raises(ModelConfigError, match=f"{folder}/m.gguf: not a readable GGUF file"):
            write_hf_files(str(folder / "m.gguf"))
        assert os.listdir(folder) == ["m.gguf"]


@pytest.mark.parametrize("file_type", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"])
def test_every_block_format_is_held_as_the_files_own_values(file_type):
    """q * scale - min of the decoded blocks is gguf-py's dequantized tensor bit for bit, with the 4-bit formats'
    q in 0..15 (held two to a byte) and the others' in int8."""
    from gguf import quants

    from trellm_backend.models.gguf import GgufTensor, decode_blocks
    w = np.random.default_rng(1).standard_normal((8, 512)).astype(np.float32)
    data, qtype = quantize(w, file_type)
    q, scales, mins, group = decode_blocks(GgufTensor("w", file_type, w.shape, data))
    assert q.dtype == (np.uint8 if file_type in ("Q4_0", "Q4_1", "Q4_K") else np.int8)
    back = q.astype(np.float32) * np.repeat(scales, group, axis=1)
    if mins is not None:
        back = back - np.repeat(mins, group, axis=1)
    assert np.array_equal(back, quants.dequantize(data, qtype))


@pytest.mark.parametrize("name", ["llama-gqa4-hd128", "qwen2-bias-gqa4"])    # an LM head of its own, and tied
def test_a_quantized_lm_head_and_embeddings_stay_in_their_blocks(hf_variants, tmp_path, name):
    """The LM head and the embeddings are read from the file's blocks, not widened to float (one set of blocks when
    tied): at one user the LM head is a large share of a step's bytes, and with a large vocabulary the two are a
    large share of the memory."""
    folder = gguf_folder(hf_variants[name], tmp_path, "Q8_0")
    model = LLMEngine(EngineConfig(model_path=folder, kv_cache_bytes=16 << 20)).runner.model
    lm_head = model.lm_head
    assert lm_head.grouped is not None and lm_head.dense is None and lm_head.packed is None
    assert lm_head.grouped.out_features == model.cfg.vocab_size
    assert isinstance(model.embed, GroupWeight)
    assert (model.embed is lm_head.grouped) == model.cfg.tie_word_embeddings


@pytest.mark.parametrize("file_type", ["Q8_0", "Q4_K", "Q6_K", "Q4_1"])
@pytest.mark.parametrize("packed", [False, True])
def test_looking_rows_up_in_the_blocks_decodes_them_as_the_whole_weight(file_type, packed):
    """An embedding lookup from the blocks equals those rows of the decoded weight bit for bit, held as rows or
    packed for the operator, 4-bit (two to a byte) or int8, with minimums or without."""
    from trellm_backend.models.gguf import GgufTensor, decode_blocks
    w = np.random.default_rng(2).standard_normal((96, 512)).astype(np.float32)
    q, scales, mins, group = decode_blocks(GgufTensor("w", file_type, w.shape, quantize(w, file_type)[0]))
    weight = GroupWeight(torch.from_numpy(q.copy()), torch.from_numpy(scales).t().contiguous(),
                         None if mins is None else torch.from_numpy(mins).t().contiguous(), group)
    if packed:
        weight = pack(weight)
        assert weight.packed, "the C++ operators are built by setup (tests/test_cpu_ops.py)"
    ids = torch.tensor([0, 95, 31, 32, 7, 7, 64])
    assert torch.equal(weight.take_rows(ids), weight.tensor()[ids])


def test_the_load_check_counts_a_quantized_file_at_its_held_size_not_as_floats(hf_variants, tmp_path):
    """The memory check before a load (triton/checks.py) must not refuse a 4-bit model that fits because its weights
    were counted as float32: quantized tensors count at their held size, bounded from above."""
    from trellm_backend.models.gguf import gguf_weight_bytes
    q4 = gguf_folder(hf_variants["llama-gqa4-hd128"], tmp_path, "Q4_K_M")
    f32 = gguf_folder(hf_variants["llama-gqa4-hd128"], tmp_path, "F32")
    estimate = gguf_weight_bytes(q4, 4)
    assert estimate < 0.6 * gguf_weight_bytes(f32, 4)
    model = LLMEngine(EngineConfig(model_path=q4, kv_cache_bytes=16 << 20)).runner.model
    held = model.embed.nbytes + model.lm_head.grouped.nbytes
    held += sum(getattr(layer, site).grouped.nbytes for layer in model.layers
                for site in ("qkv", "o", "gate_up", "down"))
    assert held <= estimate
