"""Pipeline parallelism (backend/distributed/pipeline.py): the decoder's layers split into two stages, in two
processes on this host or across two network namespaces joined over TCP, give transformers' greedy tokens; what does
not split is refused by name. (Transformers' tokens for each family, one process's tokens with quantization,
speculation and LoRA, and a stage that dies or stops: test_tensor_parallel.py, beside the ranks.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import REPO, free_ports
from hf_models import hf_greedy, make_variant, model_dir_for, random_prompts
from test_engine import ARRIVALS, GREEDY, LENGTHS, run_staggered
from test_tensor_parallel import SHARPER
from trellm_backend.distributed.pipeline import stage_layers
from trellm_backend.engine.config import EngineConfig
from trellm_backend.engine.engine import LLMEngine
from trellm_backend.engine.runner import micro_batches
from trellm_backend.models.config import ModelConfigError

SMALL = dict(max_num_batched_tokens=48, block_size=16, kv_cache_bytes=8 << 20)


def engine(folder: str, **kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig(model_path=folder, **{**SMALL, **kwargs}))


def test_stages_take_every_layer_once_the_earlier_ones_more():
    assert [list(stage_layers(7, 3, s)) for s in range(3)] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [list(stage_layers(2, 2, s)) for s in range(2)] == [[0], [1]]


def test_a_step_splits_into_contiguous_micro_batches_of_about_equal_tokens():
    import random
    rng = random.Random(0)
    for _ in range(500):
        q_lens = [rng.choice([1, 1, 1, 4, 16, 128, 512]) for _ in range(rng.randint(1, 40))]
        most, least = rng.randint(1, 6), rng.choice([1, 64, 256])
        parts = micro_batches(q_lens, most, least)
        assert len(parts) == max(1, min(most, len(q_lens), sum(q_lens) // least))
        assert parts[0][0] == 0 and parts[-1][1] == len(q_lens)
        assert all(a < b for a, b in parts) and all(p[1] == q[0] for p, q in zip(parts, parts[1:]))
        largest = max(sum(q_lens[a:b]) for a, b in parts)
        assert largest <= sum(q_lens) / len(parts) + max(q_lens), (q_lens, most, parts)


def test_a_pipeline_in_bfloat16_gives_one_process_tokens(tmp_path):
    """Stages run the same operators on the same bfloat16 tensors as one process: the tokens are the same."""
    folder = make_variant("qwen2-bias-gqa4", str(tmp_path / "m"), changes=SHARPER["qwen2-bias-gqa4"])
    prompts = random_prompts(2, 320, LENGTHS)
    out = {}
    for pp in (1, 2):
        eng = engine(folder, pipeline_parallel_size=pp, dtype="bfloat16", quantization="int8", kv_cache_dtype="int8",
                     enable_prefix_caching=False)
        try:
            out[pp] = run_staggered(eng, prompts, ARRIVALS, GREEDY)
        finally:
            eng.close()
    assert out[2] == out[1]


@pytest.mark.parametrize("name, settings, says", [
    ("qwen2-bias-gqa4", dict(pipeline_parallel_size=3, distributed_init="tcp://127.0.0.1:1"),
     "exceeds num_hidden_layers=2"),
    ("qwen2-bias-gqa4", dict(pipeline_parallel_size=3), "3 processes on this host, which lets this server use"),
    ("qwen2-bias-gqa4", dict(pipeline_parallel_size=2, tensor_parallel_size=2), "one way or the other"),
    ("qwen2-bias-gqa4", dict(distributed_init="tcp://127.0.0.1:1"), "needs pipeline_parallel_size > 1"),
    ("qwen2-bias-gqa4", dict(pipeline_parallel_size=2, distributed_init="127.0.0.1:1"), "must be tcp://HOST:PORT"),
])
def test_what_does_not_split_into_stages_is_refused_by_name(tmp_path, name, settings, says):
    folder = model_dir_for(str(tmp_path), name)
    with pytest.raises((ValueError, ModelConfigError), match=says):
        engine(folder, **settings)


RANK0 = textwrap.dedent("""
    import json, sys, time
    from trellm_backend.engine.config import EngineConfig
    from trellm_backend.engine.engine import LLMEngine
    from trellm_backend.engine.request import SamplingParams
    folder, init, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    eng = LLMEngine(EngineConfig(folder, pipeline_parallel_size=2, distributed_init=init, block_size=16,
                                 kv_cache_bytes=8 << 20, parallel_timeout_s=30))
    start = time.perf_counter()
    tokens = eng.generate(prompts, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    print(json.dumps({"tokens": tokens, "step_ms": (time.perf_counter() - start) / 20 * 1e3}))
    eng.close()
""")


def ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


def test_two_stages_in_two_network_namespaces_joined_over_tcp(tmp_path):
    """Two "hosts": network namespaces joined by a veth pair with addresses of their own; stage 1 is started in the
    second as an operator would on another host, and joins rank 0 at distributed_init over that link only."""
    tag = f"{os.getpid() % 100000}"
    a, b = f"trellm-a{tag}", f"trellm-b{tag}"
    subnet = f"10.251.{os.getpid() % 250}"
    if ip("netns", "add", a).returncode != 0:
        pytest.skip("ip netns is refused here (network namespaces need root)")
    try:
        assert ip("netns", "add", b).returncode == 0
        for cmd in (["link", "add", f"va{tag}", "type", "veth", "peer", "name", f"vb{tag}"],
                    ["link", "set", f"va{tag}", "netns", a], ["link", "set", f"vb{tag}", "netns", b],
                    ["-n", a, "addr", "add", f"{subnet}.1/24", "dev", f"va{tag}"],
                    ["-n", b, "addr", "add", f"{subnet}.2/24", "dev", f"vb{tag}"],
                    ["-n", a, "link", "set", f"va{tag}", "up"], ["-n", b, "link", "set", f"vb{tag}", "up"],
                    ["-n", a, "link", "set", "lo", "up"], ["-n", b, "link", "set", "lo", "up"]):
            done = ip(*cmd)
            assert done.returncode == 0, (cmd, done.stderr)
        folder = model_dir_for(str(tmp_path), "llama-gqa4-hd128")
        prompts = random_prompts(4, 320, [9, 33])
        [port] = free_ports(1)
        init = f"tcp://{subnet}.1:{port}"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
        # one core each, as two hosts would have their own (when this one has two)
        cores = sorted(os.sched_getaffinity(0))
        pin = [["taskset", "-c", str(c)] for c in (cores[:2] if len(cores) > 1 else cores * 2)]
        rank0 = subprocess.Popen(["ip", "netns", "exec", a, *pin[0], sys.executable, "-c", RANK0, folder, init,
                                  json.dumps(prompts)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 env=env)
        stage1 = subprocess.Popen(["ip", "netns", "exec", b, *pin[1], sys.executable, "-m",
                                   "trellm_backend.distributed.worker", "--join", init, "--rank", "1"],
                                  stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True, env=env)
        try:
            out, err = rank0.communicate(timeout=240)
            assert rank0.returncode == 0, err[-3000:]
            assert stage1.wait(timeout=30) == 0, stage1.stderr.read()[-3000:]
        finally:
            for p in (rank0, stage1):
                if p.poll() is None:
                    p.kill()
        result = json.loads(out.strip().splitlines()[-1])
        one = engine(folder)
        try:
            local_ms = _step_ms(one, prompts)
        finally:
            one.close()
        assert result["tokens"] == hf_greedy(folder, prompts, 20)
        print(f"two namespaces, pipeline of 2: {result['step_ms']:.2f} ms a step; one process: {local_ms:.2f} ms")
    finally:
        ip("netns", "del", a)
        ip("netns", "del", b)


def _step_ms(eng: LLMEngine, prompts) -> float:
    from trellm_backend.engine.request import SamplingParams
    start = time.perf_counter()
    eng.generate(prompts, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    return (time.perf_counter() - start) / 20 * 1e3
