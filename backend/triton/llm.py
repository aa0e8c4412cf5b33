"""The `llm` model's contract without Triton: tensors in -> validated engine requests; engine outputs -> what
each response carries. `model_repository/llm/1/model.py` only moves these between Triton objects.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import numpy as np

from trellm_backend.engine.detokenizer import TokenRun
from trellm_backend.engine.request import RequestOutput, RequestTimes, SamplingParams
from trellm_backend.triton import fields


@dataclass(frozen=True)
class OutputSwitches:
    """Which optional outputs a request asked for (TRT-LLM's return_* switches, and the outputs the caller named).
    Every response carries finish_reason, token_ids, batch_index and sequence_index; the rest only when switched
    on, so a streamed token costs a few small tensors unless more were asked for, and an output nobody asked for
    is never made or sent empty. (A final response with no new token, e.g. an abort, still carries an empty
    token_ids.)"""
    text: bool = True                # text_output (the ensemble does not ask: its postprocess step makes it)
    token_run: bool = False          # context_ids, cut_chars: what postprocess needs besides token_ids
    log_probs: bool = False          # output_log_probs, cum_log_probs, top_logprobs (return_log_probs or logprobs)
    num_input_tokens: bool = False
    num_output_tokens: bool = False
    perf_metrics: bool = False       # the seven PerfMetrics outputs


@dataclass
class LLMRequestSpec:
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    echo_prompt: bool
    outputs: OutputSwitches = OutputSwitches()


def parse_llm_inputs(tensors: dict[str, np.ndarray], requested: set[str] | None = None) -> LLMRequestSpec:
    """Validate the llm step's tensors (`input_ids` plus any of fields.FIELDS' tensors); raise ValueError naming the
    field at fault. `requested`: the output names the caller asked for (None: all)."""
    if "input_ids" not in tensors:
        raise ValueError("input_ids is missing")
    ids = np.asarray(tensors["input_ids"])
    if ids.ndim == 2:
        if ids.shape[0] != 1:
            raise ValueError(f"one prompt per request is supported, got a batch of {ids.shape[0]}; "
                             "send one request per prompt")
        ids = ids[0]
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"input_ids has dtype {ids.dtype}; expected integers")
    if "input_lengths" in tensors:
        lengths = np.asarray(tensors["input_lengths"]).reshape(-1)
        if lengths.size != 1 or not np.issubdtype(lengths.dtype, np.integer):
            raise ValueError(f"input_lengths must be one integer, got {lengths.size} value(s) of {lengths.dtype}")
        n = int(lengths[0])
        if not 1 <= n <= ids.size:
            raise ValueError(f"input_lengths={n} is out of range: it must be in [1, {ids.size}] "
                             f"(the number of input_ids sent)")
        ids = ids[:n]
    values = fields.values_from_tensors(tensors)
    params = fields.sampling_params(values)
    outputs = OutputSwitches(text=requested is None or "text_output" in requested,
                             token_run=requested is not None and "context_ids" in requested,
                             log_probs=params.logprobs is not None,
                             num_input_tokens=bool(values.get("return_num_input_tokens", False)),
                             num_output_tokens=bool(values.get("return_num_output_tokens", False)),
                             perf_metrics=bool(values.get("return_perf_metrics", False)))
    return LLMRequestSpec(ids.astype(np.int64).tolist(), params, bool(values.get("stream", False)),
                          echo_prompt=not values.get("exclude_input_in_output", False), outputs=outputs)


def fan_out(params: SamplingParams) -> list[SamplingParams]:
    """One engine request per parallel sample; with a seed, sample i uses seed + i (so samples differ)."""
    if params.n == 1:
        return [params]
    return [dataclasses.replace(params, n=1, seed=None if params.seed is None else (params.seed + i) % (1 << 64))
            for i in range(params.n)]


@dataclass
class ResponsePayload:
    """One llm response of one sequence: its tokens, what makes their text (`run`), and the text itself when the
    caller asked for text_output (None otherwise: the ensemble's postprocess makes it from `run`)."""
    run: TokenRun
    text: str | None
    logprobs: list[float]
    top_logprobs: list[tuple[int, list[tuple[int, float]]]]    # per token: (rank, [(id, logprob), ...])
    finished: bool
    finish_reason: str | None
    cumulative_logprob: float
    num_input_tokens: int
    num_output_tokens: int
    times: RequestTimes
    num_cached_tokens: int

    def top_logprobs_json(self) -> str:
        return json.dumps([[rank, [[t, lp] for t, lp in top]] for rank, top in self.top_logprobs]) \
            if self.top_logprobs else ""


class ResponsePlan:
    """Decides what each response of one sequence carries.

    Streaming: the first text goes out as soon as there is some; after it, a response once `stream_interval` new
    tokens have gathered (vLLM's stream_interval: 1 sends every token; more sends fewer, larger responses, which
    costs the server, the network and the client less per token), and the final one whenever the sequence ends. A
    step whose tokens made no text yet (skipped special tokens) is held and merged into the next response, so no
    non-final response is empty.
    Not streaming: one response at the end. When the prompt is echoed (TRT-LLM's exclude_input_in_output=false),
    its tokens lead the response's token_ids and its text leads the text, as TRT-LLM's output_ids do.
    Each response's text is detokenizer.run_text of its run: its tokens after the context the engine made their
    text after. `text_of` makes it (None: the caller did not ask for text_output)."""

    def __init__(self, stream: bool, stream_interval: int = 1, text_of=None, echo_prompt_ids: list[int] | None = None):
        self.stream = stream
        self.stream_interval = stream_interval
        self.text_of = text_of
        self.echo = list(echo_prompt_ids) if echo_prompt_ids is not None and not stream else None
        self.context, self.token_ids, self.has_text, self.logprobs, self.top = None, [], False, [], []
        self.sent_text = False    # a response with text has gone out: the interval applies from now on

    def on_output(self, out: RequestOutput) -> ResponsePayload | None:
        if self.context is None and out.new_token_ids:
            self.context = out.context_ids      # a merged response's text is made after its first output's context
        self.has_text = self.has_text or bool(out.text)
        self.token_ids.extend(out.new_token_ids)
        if out.logprobs:
            self.logprobs.extend(out.logprobs)
            self.top.extend(out.top_logprobs or [])
        if not out.finished and (not self.stream or not self.has_text
                                 or (self.sent_text and len(self.token_ids) < self.stream_interval)):
            return None
        self.sent_text = True
        if self.echo is not None:
            run = TokenRun([], self.echo + self.token_ids, out.cut_chars)
        else:
            run = TokenRun(self.context or [], self.token_ids, out.cut_chars)
        p = ResponsePayload(run, None if self.text_of is None else self.text_of(run), self.logprobs, self.top,
                            out.finished, out.finish_reason, out.cumulative_logprob, out.num_prompt_tokens,
                            out.num_output_tokens, out.times, out.num_cached_tokens)
        self.context, self.token_ids, self.has_text, self.logprobs, self.top = None, [], False, [], []
        return p


@dataclass(frozen=True)
class PerfMetrics:
    """TRT-LLM's perf fields of one response, each sent as its own output (return_perf_metrics)."""
    arrival_time_ns: int
    first_scheduled_time_ns: int
    first_token_time_ns: int
    last_token_time_ns: int
    kv_cache_alloc_new_blocks: int
    kv_cache_reused_blocks: int
    kv_cache_alloc_total_blocks: int

    @classmethod
    def of(cls, p: ResponsePayload, block_size: int) -> "PerfMetrics":
        """The payload's times, and its sequence's KV blocks so far (new, reused from the prefix cache, total)."""
        total = -(-(p.num_input_tokens + p.num_output_tokens) // block_size)
        reused = p.num_cached_tokens // block_size
        t = p.times
        return cls(t.arrival_ns, t.first_scheduled_ns, t.first_token_ns, t.last_token_ns, total - reused, reused,
                   total)

    def tensors(self) -> dict[str, np.ndarray]:
        return {name: np.array([[value]], dtype=np.int64 if name.endswith("_ns") else np.int32)
                for name, value in dataclasses.asdict(self).items()}


# Every output llm may send, in config.pbtxt order (tests/test_api.py checks). The shapes are the TRT-LLM
# ensemble's, so the ensemble maps them straight to its own outputs; context_ids and cut_chars are what its
# postprocess step needs besides token_ids to remake text_output (detokenizer.TokenRun).
PERF_OUTPUTS = [f.name for f in dataclasses.fields(PerfMetrics)]
LLM_OUTPUTS = ["text_output", "finish_reason", "token_ids", "context_ids", "cut_chars", "output_log_probs",
               "top_logprobs", "cum_log_probs", "num_input_tokens", "num_output_tokens", "batch_index",
               "sequence_index", *PERF_OUTPUTS]


def response_tensors(p: ResponsePayload, sequence_index: int, block_size: int,
                     outputs: OutputSwitches = OutputSwitches()) -> dict[str, np.ndarray]:
    """One llm response's tensors ([1, ...]: batch of one, beam of one): the fixed four and the switched-on rest."""
    out = {
        "finish_reason": np.array([[(p.finish_reason or "").encode()]], dtype=np.object_),
        "token_ids": np.array([p.run.token_ids], dtype=np.int32),
        "batch_index": np.zeros((1, 1), dtype=np.int32),     # one prompt per request
        "sequence_index": np.array([[sequence_index]], dtype=np.int32),
    }
    if p.text is not None:
        out["text_output"] = np.array([[p.text.encode("utf-8")]], dtype=np.object_)
    if outputs.token_run:
        out["context_ids"] = np.array([p.run.context_ids], dtype=np.int32)
        out["cut_chars"] = np.array([[p.run.cut_chars]], dtype=np.int32)
    if outputs.log_probs:
        out["output_log_probs"] = np.array([[p.logprobs]], dtype=np.float32)
        out["top_logprobs"] = np.array([[p.top_logprobs_json().encode()]], dtype=np.object_)
        out["cum_log_probs"] = np.array([[p.cumulative_logprob]], dtype=np.float32)
    if outputs.num_input_tokens:
        out["num_input_tokens"] = np.array([[p.num_input_tokens]], dtype=np.int32)
    if outputs.num_output_tokens:
        out["num_output_tokens"] = np.array([[p.num_output_tokens]], dtype=np.int32)
    if outputs.perf_metrics:
        out.update(PerfMetrics.of(p, block_size).tensors())
    return out


def apply_lora_control(registry, text: str, model_dir: str) -> dict:
    """A LoRA control request's JSON, {"load": {name: folder}, "unload": [name]} (either may be left out: `{}` only
    lists), applied to the engine's adapter registry (models/lora.AdapterRegistry); folders resolve like model_path.
    Returns {"adapters": [names]} after it; raises ValueError naming what is wrong, and then applies nothing."""
    from trellm_backend.models.lora import checked_table
    from trellm_backend.triton.parameters import resolve_model_path
    try:
        command = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"lora_control is not valid JSON: {e}") from None
    if not isinstance(command, dict) or set(command) - {"load", "unload"}:
        raise ValueError('lora_control must be a JSON object with "load": {"NAME": "folder"} and/or "unload": '
                         '["NAME"]')
    load, unload = checked_table(command.get("load", {}), "lora_control.load"), command.get("unload", [])
    if not isinstance(unload, list) or not all(isinstance(n, str) for n in unload):
        raise ValueError("lora_control.unload must be a list of adapter names")
    registry.apply({name: resolve_model_path(folder, model_dir) for name, folder in load.items()}, unload)
    return {"adapters": list(registry.names)}
