"""LoRA adapters (backend/models/lora.py): PEFT folders made with peft on the default model, served mixed in one
batch with the base; greedy tokens equal transformers + peft (unmerged and merged) for every adapter; broken folders
refused by name while the others serve; two adapters never share prefix-cache blocks."""
from __future__ import annotations

import json
import os
import shutil

import pytest
from safetensors.torch import load_file, save_file

from hf_models import LORAS, hf_lora_greedy, make_lora, random_prompts
from rounding import Exact, assert_within_rounding, exact_lora_add
from test_engine import run
from trellm_backend.engine.config import EngineConfig
from trellm_backend.engine.engine import LLMEngine
from trellm_backend.engine.request import SamplingParams
from trellm_backend.models.lora import AdapterError, load_adapter


@pytest.fixture(scope="module")
def adapters(default_model_path, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("loras")
    return {name: make_lora(default_model_path, name, str(root / name)) for name in LORAS}


def engine_with(model_path, adapters, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model_path, lora_adapters=json.dumps(adapters), **kw))


def greedy(eng: LLMEngine, prompts, names, max_tokens, after_step=None) -> list[list[int]]:
    """Every (prompt, adapter) pair admitted at once: one continuous batch mixing the adapters and the base.
    `after_step()`, if given, runs after every step (a test's per-step check)."""
    jobs = [(p, n) for n in names for p in prompts]
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, lora_name=n) for _, n in jobs]
    return [r["tokens"] for r in run(eng, [p for p, _ in jobs], None, params_of=params.__getitem__,
                                     after_step=after_step)]


def running_adapters_at_most(eng: LLMEngine, n: int) -> None:
    assert len({r.lora.name for r in eng.scheduler.running if r.lora is not None}) <= n


def test_mixed_batch_equals_transformers_and_peft_for_every_adapter(default_model_path, adapters):
    prompts = random_prompts(3, 4096, [5, 17, 40])
    names = [None, *LORAS]
    eng = engine_with(default_model_path, adapters, max_num_batched_tokens=64)   # prefill chunks share steps
    got = greedy(eng, prompts, names, 12)
    by_name = {n: got[i * len(prompts):(i + 1) * len(prompts)] for i, n in enumerate(names)}
    for n in names:
        want = hf_lora_greedy(default_model_path, adapters.get(n), prompts, 12)
        assert by_name[n] == want, f"adapter {n}"
    assert len({tuple(map(tuple, v)) for v in by_name.values()}) == len(names), "each adapter changes the answer"
    merged = hf_lora_greedy(default_model_path, adapters["all-r16"], prompts, 12, merged=True)
    assert by_name["all-r16"] == merged


def test_adapters_on_an_int8_base_equal_transformers_and_peft_on_its_dequantized_weights(default_model_path, adapters):
    """The adapters' term is added to a quantized base's output as to a float one: the engine with INT8 weights
    makes transformers' tokens when transformers runs the engine's own INT8 weights, dequantized, under peft."""
    from trellm_kernels.linear import prepare_weight
    prompts = random_prompts(4, 4096, [6, 23])
    names = [None, "attn-r8", "all-r16"]
    got = greedy(engine_with(default_model_path, adapters, quantization="int8"), prompts, names, 12)
    for i, n in enumerate(names):
        want = hf_lora_greedy(default_model_path, adapters.get(n), prompts, 12,
                              base_weights=lambda w: prepare_weight(w, "int8").tensor())
        assert got[i * len(prompts):(i + 1) * len(prompts)] == want, f"adapter {n}"
    assert got[len(prompts):2 * len(prompts)] != got[:len(prompts)], "the adapter changes the int8 base's answer"


def test_max_loras_and_max_cpu_loras_bound_what_runs_and_what_stays_in_memory(default_model_path, adapters):
    """Three adapters and the base, max_loras 1 (one adapter among the running requests; the base does not count)
    and max_cpu_loras 1 (the others reread on use): the same tokens as without limits."""
    prompts = random_prompts(4, 4096, [6, 9])
    names = [*LORAS, None]
    free = greedy(engine_with(default_model_path, adapters), prompts, names, 6)
    eng = engine_with(default_model_path, adapters, max_loras=1, max_cpu_loras=1)
    assert greedy(eng, prompts, names, 6, after_step=lambda: running_adapters_at_most(eng, 1)) == free
    assert eng.loras.num_in_memory == 1 and eng.loras.loads >= 2 and eng.loras.evictions >= 2


def test_adapters_never_share_prefix_cache_blocks(default_model_path, adapters):
    eng = engine_with(default_model_path, adapters, block_size=16)
    prompt = random_prompts(5, 4096, [64])
    base_first = greedy(eng, prompt, [None], 8)
    hits = eng.kv.num_hits
    with_adapter = greedy(eng, prompt, ["attn-r8"], 8)
    assert eng.kv.num_hits == hits, "the adapter's prompt must not reuse the base's blocks"
    assert greedy(eng, prompt, ["attn-r8"], 8) == with_adapter and eng.kv.num_hits > hits   # its own blocks, yes
    assert with_adapter != base_first


def test_a_broken_adapter_is_refused_by_name_while_the_others_serve(default_model_path, adapters, tmp_path):
    bad_rank = tmp_path / "bad-shape"
    shutil.copytree(adapters["attn-r8"], bad_rank)
    weights = load_file(str(bad_rank / "adapter_model.safetensors"))
    key = next(k for k in weights if "layers.1.self_attn.v_proj.lora_B" in k)
    weights[key] = weights[key][:, :4].contiguous()
    save_file(weights, str(bad_rank / "adapter_model.safetensors"))
    no_weights = tmp_path / "empty"
    no_weights.mkdir()
    (no_weights / "adapter_config.json").write_text("{}")
    eng = engine_with(default_model_path, {"good": adapters["mlp-r4-rslora"], "bad": str(bad_rank),
                                           "empty": str(no_weights)})
    assert eng.loras.names == ["good"]
    with pytest.raises(ValueError, match=r"'bad'.*layers\.1\.\*\.v_proj\.lora_B\.weight has shape \[\d+, 4\]; "
                                         r"the base model and r=8 need \[\d+, 8\]"):
        eng.add_request("x", [1, 2, 3], SamplingParams(lora_name="bad"))
    with pytest.raises(ValueError, match="adapter_model.safetensors is missing"):
        eng.add_request("y", [1, 2, 3], SamplingParams(lora_name="empty"))
    with pytest.raises(ValueError, match="'nope' is not an adapter of this model; known: good"):
        eng.add_request("z", [1, 2, 3], SamplingParams(lora_name="nope"))
    assert greedy(eng, random_prompts(1, 4096, [6]), ["good"], 4)[0]


@pytest.mark.unit
def test_a_control_request_applies_all_of_its_adapters_or_none(default_model_path, adapters, tmp_path):
    """lora_control loads and unloads as one: with one bad folder among its loads nothing changes (before, the good
    ones were loaded and the answer was the bad one's error); then the same request without it applies whole."""
    from trellm_backend.triton.llm import apply_lora_control
    eng = engine_with(default_model_path, {"good": adapters["mlp-r4-rslora"]})
    model_dir = str(tmp_path / "repo" / "llm")
    command = {"load": {"new": adapters["attn-r8"], "bad": str(tmp_path)}, "unload": ["good"]}
    with pytest.raises(ValueError, match=f"'bad': {tmp_path}/adapter_config.json is missing"):
        apply_lora_control(eng.loras, json.dumps(command), model_dir)
    assert eng.loras.names == ["good"]
    with pytest.raises(ValueError, match="'new' is not an adapter of this model; known: good"):
        eng.add_request("x", [1, 2, 3], SamplingParams(lora_name="new"))
    with pytest.raises(ValueError, match="'gone' is not declared"):
        apply_lora_control(eng.loras, json.dumps({"load": {"new": adapters["attn-r8"]}, "unload": ["gone"]}),
                           model_dir)
    assert eng.loras.names == ["good"]
    del command["load"]["bad"]
    assert apply_lora_control(eng.loras, json.dumps(command), model_dir) == {"adapters": ["new"]}
    assert greedy(eng, random_prompts(1, 4096, [6]), ["new"], 4)[0]
    with pytest.raises(ValueError, match="'good' is not an adapter of this model; known: new"):
        eng.add_request("y", [1, 2, 3], SamplingParams(lora_name="good"))


@pytest.mark.unit
def test_adapter_configs_the_engine_cannot_apply_are_named(default_model_path, adapters, tmp_path):
    from trellm_backend.models.config import load_model_config
    import torch
    cfg = load_model_config(default_model_path)
    for key, value, message in [("use_dora", True, "use_dora is True"), ("r", 99, r"r is 99; it must be in \[1, 64\]"),
                                ("modules_to_save", ["lm_head"], "modules_to_save is set"),
                                ("bias", "all", "bias is 'all'")]:
        d = tmp_path / key
        shutil.copytree(adapters["attn-r8"], d)
        ac = json.loads((d / "adapter_config.json").read_text())
        ac[key] = value
        (d / "adapter_config.json").write_text(json.dumps(ac))
        with pytest.raises(AdapterError, match=message):
            load_adapter("x", str(d), cfg, 64, torch.float32, torch.device("cpu"))
    assert os.path.isfile(os.path.join(adapters["attn-r8"], "adapter_model.safetensors"))


@pytest.mark.server
def test_every_entry_point_serves_each_adapter_as_transformers_and_peft(default_model_path, adapters, tmp_path):
    """A repository whose llm declares the adapters: the ensemble (gRPC, lora_name input) and vllm_model (HTTP,
    sampling_parameters.lora_name) give transformers + peft's greedy text for each, requests of all at once."""
    import concurrent.futures
    import urllib.error

    from transformers import AutoTokenizer

    from trellm_backend.tools.launch import TritonServer
    from trellm_backend.tools.testbed import free_ports, private_repository
    from trellm_client.client import LLMClient, http_generate, infer_input
    repo = private_repository(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                           "model_repository"), str(tmp_path / "repo"),
                              {"llm": {"lora_adapters": json.dumps(adapters)}})
    tok = AutoTokenizer.from_pretrained(default_model_path)
    prompt = "The Python language"
    ids = tok(prompt)["input_ids"]
    want = {n: tok.decode(hf_lora_greedy(default_model_path, adapters.get(n), [ids], 10)[0], skip_special_tokens=True)
            for n in [None, *LORAS]}
    with TritonServer(repo, *free_ports(3), log_path=str(tmp_path / "server.log")) as server:
        def ensemble(name):
            with LLMClient(server.grpc_url) as c:
                return c.generate(prompt, max_tokens=10, ignore_eos=True, exclude_input_in_output=True,
                                  lora_name=name)

        def vllm(name):
            sampling = {"max_tokens": 10, "temperature": 0, "ignore_eos": True, **({"lora_name": name} if name else {})}
            try:
                return http_generate(server.http_url, prompt, "vllm_model", timeout=60, exclude_input_in_output=True,
                                     sampling_parameters=json.dumps(sampling))[0]["text_output"]
            except urllib.error.HTTPError as e:
                return f"HTTP {e.code}: {e.read().decode()}"
        names = [None, *LORAS] * 2
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            got_ensemble = list(pool.map(ensemble, names))
            got_vllm = list(pool.map(vllm, names))
        assert got_ensemble == [want[n] for n in names]
        assert got_vllm == [want[n] for n in names]
        with LLMClient(server.grpc_url) as c, pytest.raises(Exception, match="'nope' is not an adapter"):
            c.generate(prompt, lora_name="nope")
        # Adapters added and removed while serving: a control request to llm.
        import numpy as np
        import tritonclient.grpc as grpcclient

        def control(command):
            client = grpcclient.InferenceServerClient(server.grpc_url)
            answers = []
            client.start_stream(callback=lambda result, error: answers.append((result, error)))
            text = np.array([[json.dumps(command).encode()]], dtype=np.object_)
            client.async_stream_infer("llm", [infer_input(grpcclient, "lora_control", text)])
            client.stop_stream()
            client.close()
            result, error = answers[0]
            if error is not None:
                raise error
            return json.loads(result.as_numpy("text_output").reshape(-1)[0])
        assert control({"load": {"again": adapters["attn-r8"]}, "unload": ["all-r16"]})["adapters"] == \
            ["again", "attn-r8", "mlp-r4-rslora"]
        assert ensemble("again") == want["attn-r8"]
        with pytest.raises(Exception, match="'all-r16' is not an adapter"):
            ensemble("all-r16")
        with pytest.raises(Exception, match="adapter_config.json is missing"):   # all or nothing
            control({"load": {"broken": str(tmp_path), "fine": adapters["attn-r8"]}})
        assert "fine" not in control({})["adapters"]
        assert control({"load": {"all-r16": adapters["all-r16"]}, "unload": ["again"]})["adapters"] == sorted(LORAS)
        # The served benchmark's adapter pass: the same requests again, on the adapters in turn, and the ratio.
        import subprocess
        import sys
        out = tmp_path / "bench"

        def benchmark(names):
            return subprocess.run([sys.executable, os.path.join(
                os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "perf", "benchmark.py"),
                "--url", server.grpc_url, "--metrics-url", f"http://localhost:{server.metrics_port}/metrics",
                "--model-dir", default_model_path, "--smoke", "--profiles", "anchor", "--out", str(out),
                "--no-progress", *(f"--lora={n}={adapters.get(n, tmp_path)}" for n in names)], capture_output=True, text=True,
                timeout=300)
        run = benchmark(LORAS)
        assert run.returncode == 0, run.stdout + run.stderr
        assert "anchor c=4: adapters / base output tok/s = " in run.stdout
        doc = json.loads((out / "benchmark.json").read_text())
        (base,), (lora,) = doc["levels"], doc["lora"]["levels"]
        assert lora["errors"] == 0 and lora["output_tokens"] == base["output_tokens"] > 0
        run = benchmark(["nope"])   # the requests do name their adapter: an unknown one fails each of them
        assert run.returncode == 1 and json.loads((out / "benchmark.json").read_text())["lora"]["levels"][0][
            "errors"] == 4, run.stdout + run.stderr
        # The OpenAI front door lists each adapter as a model (vLLM's way) and serves it by that name.
        import httpx2 as httpx   # the HTTP client the openai SDK (pinned) brings

        from trellm_backend.tools import launch
        port = free_ports(1)[0]
        door = launch.start_front_door(server, port, None)
        try:
            listed = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).json()["data"]
            assert {m["id"]: m["parent"] for m in listed} == {"ensemble": None, **{n: "ensemble" for n in LORAS}}
            for name in LORAS:
                out = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60, json={
                    "model": name, "prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True}).json()
                assert out["choices"][0]["text"] == want[name], name
            # An adapter a control request adds is listed and served there too (the door asks llm, `{}` lists).
            assert control({"load": {"again": adapters["attn-r8"]}}) == control({}) == \
                {"adapters": sorted([*LORAS, "again"])}
            listed = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).json()["data"]
            assert {m["id"]: m["parent"] for m in listed}["again"] == "ensemble"
            out = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60, json={
                "model": "again", "prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True}).json()
            assert out["choices"][0]["text"] == want["attn-r8"]
            # served and listed once a control request has loaded it, without waiting for the door's refresh (a
            # request for an id it lacks, and a listing, read the list again if it is older than FRESH_MODELS_S)
            import time

            from trellm_openai.server import FRESH_MODELS_S
            assert control({"load": {"fresh": adapters["all-r16"]}}) == {"adapters": sorted([*LORAS, "again", "fresh"])}
            time.sleep(FRESH_MODELS_S)
            out = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60, json={
                "model": "fresh", "prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True}).json()
            assert out["choices"][0]["text"] == want["all-r16"], out
            assert control({"unload": ["fresh"]}) == {"adapters": sorted([*LORAS, "again"])}
            time.sleep(FRESH_MODELS_S)
            listed = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).json()["data"]
            assert "fresh" not in {m["id"] for m in listed}
        finally:
            launch.stop_front_door(door)


@pytest.mark.unit
def test_lora_name_is_one_field_of_every_contract():
    import numpy as np

    from trellm_backend.triton import fields
    assert fields.sampling_params(fields.values_from_sampling_json('{"lora_name": "sql"}')).lora_name == "sql"
    tensors = {"lora_name": np.array([[b"sql"]], dtype=np.object_)}
    assert fields.sampling_params(fields.values_from_tensors(tensors)).lora_name == "sql"
    with pytest.raises(ValueError, match="sampling_parameters.lora_name must be a string, got 5"):
        fields.values_from_sampling_json('{"lora_name": 5}')


@pytest.mark.unit
def test_the_kernels_stacked_layout_adds_what_the_grouped_matmuls_add(default_model_path, adapters):
    """The two ways a step adds its adapters' term: grouped matmuls over each adapter's rows (CPU) and the
    stacked matrices with a slot per token that the Triton kernels read (here through their PyTorch references),
    for interleaved requests of adapters of different ranks and modules, and of none."""
    import torch

    from trellm_backend.models.config import load_model_config
    from trellm_backend.models.lora import LoraStep, module_shapes, stack_adapters, step_rows
    cfg = load_model_config(default_model_path)
    loaded = [load_adapter(n, adapters[n], cfg, 64, torch.float32, torch.device("cpu")) for n in LORAS]
    # rows: 0-2 adapter 0, 3-4 none, 5 adapter 1, 6-8 adapter 0, 9-10 adapter 2
    ranges = {0: [(0, 3), (6, 9)], 1: [(5, 6)], 2: [(9, 11)]}
    grouped = LoraStep([(loaded[i], step_rows(r, 11, torch.device("cpu"))) for i, r in ranges.items()])
    slots = torch.full((11,), -1, dtype=torch.int32)
    for i, rs in ranges.items():
        for s, e in rs:
            slots[s:e] = i
    stacked = LoraStep(stack=stack_adapters(loaded, cfg), slots=slots)
    # A step whose every token is one adapter's (no row views on a CPU), against the kernels' layout.
    whole = LoraStep([(loaded[2], step_rows([(0, 4), (4, 11)], 11, torch.device("cpu")))])
    assert whole.groups[0][1] is None
    whole_stacked = LoraStep(stack=stack_adapters([loaded[2]], cfg), slots=torch.zeros(11, dtype=torch.int32))
    shapes = module_shapes(cfg)
    g = torch.Generator().manual_seed(0)
    for site, n_in, n_out in [("qkv", cfg.hidden_size, shapes["v_proj"][1] + shapes["v_proj"][2]),
                              ("o", shapes["o_proj"][0], cfg.hidden_size),
                              ("gate_up", cfg.hidden_size, 2 * cfg.intermediate_size),
                              ("down", cfg.intermediate_size, cfg.hidden_size)]:
        x = torch.randn(11, n_in, generator=g)
        base = torch.randn(11, n_out, generator=g)
        want, got = base.clone(), base.clone()
        grouped.add(want, x, 1, site)
        stacked.add(got, x, 1, site)
        exact = exact_step(base, x, site, [(loaded[i], r) for i, r in ranges.items()])
        assert_within_rounding(got, exact)
        assert_within_rounding(want, exact)
        want_whole, got_whole = base.clone(), base.clone()
        whole.add(want_whole, x, 1, site)
        whole_stacked.add(got_whole, x, 1, site)
        exact = exact_step(base, x, site, [(loaded[2], [(0, 11)])])
        assert_within_rounding(got_whole, exact)
        assert_within_rounding(want_whole, exact)
        assert not torch.equal(want_whole, base), f"adapter {loaded[2].name} targets {site}"
        assert torch.equal(got[3:5], base[3:5]), "rows of no adapter are left alone"
        assert not torch.equal(want, base), f"the adapters target {site}"


def exact_step(base, x, site, adapters_rows):
    """A step's LoRA terms at `site` of layer 1 in float64 (tests/rounding.py): base plus each adapter's term on its
    [start, end) row ranges."""
    value, magnitude, length = base.double(), base.double().abs(), 0
    for adapter, ranges in adapters_rows:
        sw = adapter.sites.get((1, site))
        for s, e in ranges if sw is not None else ():
            exact = exact_lora_add(base[s:e], x[s:e], sw.at, sw.bt, adapter.scale)
            value[s:e], magnitude[s:e], length = exact.value, exact.magnitude, max(length, exact.length)
    return Exact(value, magnitude, length)


def test_thirty_two_adapters_with_max_loras_4_serve_a_mixed_workload(default_model_path, adapters):
    """32 declared adapters (copies of the three folders under 32 names), max_loras 4, max_cpu_loras 8: 64 mixed
    requests all finish, adapters are evicted and reread, and each answer is its folder's."""
    folders = sorted(LORAS)
    table = {f"a{i:02d}": adapters[folders[i % 3]] for i in range(32)}
    eng = engine_with(default_model_path, table, max_loras=4, max_cpu_loras=8)
    prompt = random_prompts(9, 4096, [7])
    names = [f"a{i % 32:02d}" for i in range(64)]
    out = greedy(eng, prompt, names, 5, after_step=lambda: running_adapters_at_most(eng, 4))
    by_folder = {f: greedy(engine_with(default_model_path, adapters), prompt, [f], 5)[0] for f in folders}
    assert all(out[i] == by_folder[folders[int(n[1:]) % 3]] for i, n in enumerate(names))
    assert eng.loras.num_in_memory == 8 and eng.loras.evictions >= 24 and eng.loras.loads > 0
