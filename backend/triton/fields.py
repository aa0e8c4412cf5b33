"""The request fields of both contracts in one table, and their parsing and validation.

`FIELDS` is the single source: the `ensemble` (TRT-LLM tensor names), `llm` and `vllm_model` config.pbtxt input
lists, the `sampling_parameters` JSON keys of the vLLM contract, the client's input types, the allowed ranges and
the field table of docs/requests.md are all checked against it (tests/test_api.py).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import numpy as np

from trellm_backend.engine.request import (I32_MAX, LIST_LIMITS, LOGIT_BIAS_BOUNDS, LOGIT_BIAS_MOST, Bounds,
                                           SamplingParams, parse_bool, parse_logit_bias)
from trellm_backend.engine.structured_output import GUIDE_TYPES, Guide
from trellm_backend.triton.tokenization import decode_utf8

TRITON_TYPES = {"int": "TYPE_INT32", "uint": "TYPE_UINT64", "float": "TYPE_FP32", "bool": "TYPE_BOOL",
                "str": "TYPE_STRING", "str_list": "TYPE_STRING", "int_list": "TYPE_INT32", "json": "TYPE_STRING"}
# The vLLM contract's structured-output keys -> the guide type each one means (`structured_outputs` holds one of
# json, regex, choice, grammar, json_object).
VLLM_GUIDES = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
               "guided_grammar": "ebnf_grammar", "guided_json_object": "json"}
STRUCTURED_OUTPUTS_KEYS = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice",
                           "grammar": "guided_grammar", "json_object": "guided_json_object"}
_SAMPLING = {f.name: f for f in dataclasses.fields(SamplingParams)}


@dataclass(frozen=True)
class Field:
    name: str                      # SamplingParams attribute, or a request-level setting
    kind: str                      # int, uint, float, bool, str, str_list, int_list, json (an object, as text)
    default: object
    bounds: Bounds | None = None   # allowed range (numbers only)
    tensors: tuple[str, ...] = ()  # ensemble/llm tensor names, aliases after the first; () = llm only, as `name`
    in_ensemble: bool = True       # declared by the TRT-LLM-shaped ensemble
    json: tuple[str, ...] = ()     # keys of the vLLM contract's sampling_parameters
    doc: str = ""
    parse: object = None           # json fields: text -> the engine's value, raising ValueError naming the field

    @property
    def tensor_names(self) -> tuple[str, ...]:
        return self.tensors or (self.name,)

    @property
    def dims(self) -> str:
        return "-1" if self.kind.endswith("_list") else "1"

    def range_text(self) -> str:
        text = "" if self.bounds is None else self.bounds.text()
        if self.name in LIST_LIMITS:
            _, most, chars = LIST_LIMITS[self.name]
            text += (" each; " if text else "") + f"at most {most}" + (f" of {chars} characters" if chars else "")
        return text

    def check(self, value, shown: str):
        """Raise ValueError naming `shown` (the name the caller used) and the allowed range."""
        if self.bounds is not None:
            self.bounds.check(value, shown)
        if self.parse is not None:
            self.parse(value)


def _sampling(name: str, kind: str, **kw) -> Field:
    """A field that is a SamplingParams attribute: its default and range are the engine's."""
    f = _SAMPLING[name]
    default = f.default_factory() if f.default is dataclasses.MISSING else f.default
    return Field(name, kind, default, f.metadata.get("bounds"), **kw)


# Request-level settings (not SamplingParams attributes) are marked in `doc` by where they act.
FIELDS: list[Field] = [
    _sampling("max_tokens", "int", tensors=("max_tokens",), json=("max_tokens",),
              doc="most tokens to generate"),
    _sampling("min_tokens", "int", tensors=("min_tokens", "min_length"), json=("min_tokens",),
              doc="EOS and stop token ids are masked (and stop strings not matched) until this many tokens are out"),
    _sampling("temperature", "float", tensors=("temperature",), json=("temperature",),
              doc="0 = greedy. The ensemble is greedy unless temperature, top_k, top_p or min_p is given (then 1.0)"),
    _sampling("top_k", "int", tensors=("top_k",), json=("top_k",),
              doc="sample among the k most likely tokens; 0 or -1 = off"),
    _sampling("top_p", "float", tensors=("top_p",), json=("top_p",),
              doc="sample in the smallest set holding this much probability"),
    _sampling("min_p", "float", tensors=("min_p",), json=("min_p",),
              doc="drop tokens less likely than min_p times the most likely one"),
    _sampling("repetition_penalty", "float", tensors=("repetition_penalty",),
              json=("repetition_penalty",), doc="prompt and output tokens: positive logits divided, negative multiplied"),
    _sampling("presence_penalty", "float", tensors=("presence_penalty",), json=("presence_penalty",),
              doc="subtracted from the logit of every token already generated"),
    _sampling("frequency_penalty", "float", tensors=("frequency_penalty",), json=("frequency_penalty",),
              doc="subtracted once per earlier occurrence in the output"),
    _sampling("seed", "uint", tensors=("seed", "random_seed"), json=("seed",),
              doc="same seed, same text whatever shares the batch; sample i of n uses seed + i"),
    Field("end_id", "int", None, Bounds(0, I32_MAX), tensors=("end_id",),
          doc="an extra stop token id (every EOS id of generation_config.json stops anyway)"),
    Field("pad_id", "int", None, Bounds(0, I32_MAX), tensors=("pad_id",),
          doc="accepted for compatibility; outputs are never padded"),
    _sampling("stop_token_ids", "int_list", json=("stop_token_ids",),
              doc="token ids that end the answer (kept in the output tokens)"),
    _sampling("ignore_eos", "bool", json=("ignore_eos",),
              doc="keep generating past EOS tokens"),
    _sampling("stop", "str_list", tensors=("stop_words",), json=("stop",),
              doc="stop strings, matched on the text across tokens; cut from the output (finish_reason stop)"),
    _sampling("bad_words", "str_list", tensors=("bad_words",), json=("bad_words",),
              doc="words never generated (each as tokenized alone and after a space)"),
    Field("logit_bias", "json", None, None, tensors=("logit_bias",), json=("logit_bias",), parse=parse_logit_bias,
          doc=f"added to the logits of those token ids before sampling: {{\"id\": bias}}, each bias in "
              f"[{LOGIT_BIAS_BOUNDS[0]}, {LOGIT_BIAS_BOUNDS[1]}], at most {LOGIT_BIAS_MOST} ids"),
    _sampling("n", "int", tensors=("num_return_sequences",), json=("n",),
              doc="parallel samples; responses carry sequence_index"),
    _sampling("speculative_decoding", "bool", in_ensemble=False, json=("speculative_decoding",),
              doc="false: no speculative guesses for this request (the model's speculative_method; same output)"),
    _sampling("logprobs", "int", json=("logprobs",),
              doc="logprob of each sampled token plus this many top alternatives"),
    Field("guided_decoding_guide_type", "str", None, None, tensors=("guided_decoding_guide_type",),
          doc=f"structured output (TRT-LLM's names): {', '.join(GUIDE_TYPES)}; json = any JSON object"),
    Field("guided_decoding_guide", "str", None, None, tensors=("guided_decoding_guide",),
          json=(*VLLM_GUIDES, "structured_outputs"),
          doc="the schema, regex, choices (JSON list) or EBNF grammar; vLLM's keys set type and guide at once"),
    _sampling("lora_name", "str", tensors=("lora_name",), json=("lora_name",),
              doc="a LoRA adapter of the model (the llm parameter lora_adapters); none: the base model"),
    Field("return_log_probs", "bool", False, None, tensors=("return_log_probs",),
          doc="fill cum_log_probs and output_log_probs"),
    Field("beam_width", "int", 1, Bounds(1, 1), tensors=("beam_width",), doc="beam search is not supported: 1 only"),
    Field("length_penalty", "float", 1.0, Bounds(None, None), tensors=("length_penalty",),
          doc="accepted for compatibility; applies to beam search only"),
    Field("stream", "bool", False, None, tensors=("stream",),
          doc="one response per new text (deltas) or one at the end"),
    Field("exclude_input_in_output", "bool", False, None, tensors=("exclude_input_in_output",),
          doc="non-streaming: without it the prompt is echoed before the answer"),
    Field("return_num_input_tokens", "bool", False, None, tensors=("return_num_input_tokens",),
          doc="add the num_input_tokens output"),
    Field("return_num_output_tokens", "bool", False, None, tensors=("return_num_output_tokens",),
          doc="add the num_output_tokens output (tokens so far)"),
    Field("return_perf_metrics", "bool", False, None, tensors=("return_perf_metrics",),
          doc="add TRT-LLM's timing and KV-cache outputs"),
]
BY_NAME = {f.name: f for f in FIELDS}
BY_TENSOR = {t: f for f in FIELDS for t in f.tensor_names}
BY_JSON = {k: f for f in FIELDS for k in f.json}
SAMPLING_FIELDS = [f for f in FIELDS if f.name in SamplingParams.__dataclass_fields__]

# Inputs of the llm step besides FIELDS: the prompt's token ids (from preprocess or vllm_model).
LLM_PROMPT_INPUTS = ["input_ids", "input_lengths"]
# Inputs of the ensemble besides FIELDS: the prompt as text, or chat messages (JSON list of {role, content}) and
# the tools the chat template shows (JSON list of function tools).
ENSEMBLE_PROMPT_INPUTS = ["text_input", "messages", "tools"]
# The vLLM-shaped contract: its tensors (besides text_input) and the output each return_* switch adds.
VLLM_INPUTS = {"stream": "bool", "sampling_parameters": "str", "exclude_input_in_output": "bool",
               "return_finish_reason": "bool", "return_cumulative_logprob": "bool", "return_logprobs": "bool",
               "return_num_input_tokens": "bool", "return_num_output_tokens": "bool"}


def llm_tensor_names() -> list[str]:
    return [*LLM_PROMPT_INPUTS, *(t for f in FIELDS for t in f.tensor_names)]


def llm_field_inputs() -> list[dict]:
    """The llm model's input declarations of every field tensor, as Triton's auto-complete takes them."""
    return [{"name": t, "data_type": TRITON_TYPES[f.kind], "dims": [int(f.dims)], "optional": True}
            for f in FIELDS for t in f.tensor_names]


def auto_complete_llm_inputs(auto_complete_model_config):
    """The llm model's `auto_complete_config`: declare every field's tensors (config.pbtxt lists only the prompt
    and `stop`), so the inputs are typed once, here, as vllm_backend declares its own."""
    declared = {i["name"] for i in auto_complete_model_config.as_dict().get("input", [])}
    for spec in llm_field_inputs():
        if spec["name"] not in declared:
            auto_complete_model_config.add_input(spec)
    return auto_complete_model_config


def ensemble_tensor_names() -> list[str]:
    return [*ENSEMBLE_PROMPT_INPUTS, *(t for f in FIELDS if f.in_ensemble for t in f.tensor_names)]


# -- values from tensors ---------------------------------------------------------------------------------------
def _tensor_value(f: Field, shown: str, arr: np.ndarray):
    a = np.asarray(arr)
    if f.kind in ("str", "json"):
        if (a.dtype != np.object_ and a.dtype.kind not in "SU") or a.size != 1:
            raise ValueError(f"{shown} must be one STRING value, got {a.dtype} of shape {list(a.shape)}")
        return decode_utf8(a.reshape(-1)[0], shown)
    if f.kind == "str_list":
        if a.dtype != np.object_ and a.dtype.kind not in "SU":
            raise ValueError(f"{shown} must be a STRING tensor, got {a.dtype}")
        words = [decode_utf8(w, shown) for w in a.reshape(-1)]
        return [w for w in words if w]
    ok = {"int": np.issubdtype(a.dtype, np.integer), "uint": np.issubdtype(a.dtype, np.integer),
          "int_list": np.issubdtype(a.dtype, np.integer), "float": np.issubdtype(a.dtype, np.floating),
          "bool": a.dtype == np.bool_}[f.kind]
    if not ok:
        raise ValueError(f"{shown} has dtype {a.dtype}; expected {TRITON_TYPES[f.kind].removeprefix('TYPE_')}")
    if f.kind == "int_list":
        return [int(x) for x in a.reshape(-1)]
    if a.size != 1:
        raise ValueError(f"{shown} must hold exactly one value per request, got shape {list(a.shape)}")
    return a.reshape(-1)[0].item()


def values_from_tensors(tensors: dict[str, np.ndarray]) -> dict[str, object]:
    """{field name: value} from the tensors present (any of each field's tensor names; the first one given wins
    over its aliases only if they agree). Raises ValueError naming the tensor at fault."""
    values: dict[str, object] = {}
    for name, arr in tensors.items():
        f = BY_TENSOR.get(name)
        if f is None:
            continue
        v = _tensor_value(f, name, arr)
        f.check(v, name)
        if f.name in values and values[f.name] != v:
            raise ValueError(f"{' and '.join(f.tensor_names)} are aliases: give one, or the same value in each")
        values[f.name] = v
    return values


# -- values from the vLLM contract's sampling_parameters JSON ----------------------------------------------
def _coerce(f: Field, shown: str, v):
    """A JSON value converted by the field's type; numbers given as strings are accepted ("256", "0.5")."""
    try:
        if f.kind == "bool":
            return parse_bool(v)
        if f.kind in ("int", "uint"):
            if isinstance(v, bool):
                raise ValueError
            x = float(v) if isinstance(v, (str, float)) else v
            if not isinstance(x, int) and not (isinstance(x, float) and x.is_integer()):
                raise ValueError
            return int(x)
        if f.kind == "float":
            if isinstance(v, bool):
                raise ValueError
            return float(v)
        if f.kind == "str":
            if not isinstance(v, str):
                raise ValueError
            return v
        if f.kind == "json":
            if not isinstance(v, (str, dict)):
                raise ValueError
            return v if isinstance(v, str) else json.dumps(v)
        if f.kind == "str_list":
            v = [v] if isinstance(v, str) else v
            if not isinstance(v, list) or not all(isinstance(w, str) for w in v):
                raise ValueError
            return [w for w in v if w]
        if f.kind == "int_list":
            v = [v] if not isinstance(v, list) else v
            return [_coerce(Field(f.name, "int", None), shown, x) for x in v]
    except (ValueError, TypeError):
        pass
    expected = {"bool": "true or false", "int": "an integer", "uint": "a non-negative integer",
                "float": "a number", "str": "a string", "str_list": "a string or a list of strings",
                "json": "a JSON object",
                "int_list": "an integer or a list of integers"}[f.kind]
    raise ValueError(f"{shown} must be {expected}, got {json.dumps(v)}")


def values_from_sampling_json(text: str) -> dict[str, object]:
    """{field name: value} from the vLLM contract's `sampling_parameters` (a JSON object); unknown keys and bad
    values raise ValueError naming them."""
    try:
        obj = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"sampling_parameters is not valid JSON: {e}") from None
    except RecursionError:   # json's parser recurses once per nesting level
        raise ValueError("sampling_parameters is nested too deeply: it must be a flat JSON object of sampling "
                         "fields") from None
    if not isinstance(obj, dict):
        raise ValueError("sampling_parameters must be a JSON object of sampling fields")
    unknown = sorted(k for k in obj if k not in BY_JSON)
    if unknown:
        raise ValueError(f"sampling_parameters has unknown field(s) {', '.join(unknown)}; "
                         f"known: {', '.join(sorted(BY_JSON))}")
    return values_from_json(obj, "sampling_parameters.")


def values_from_json(obj: dict, shown_prefix: str = "") -> dict[str, object]:
    """{field name: value} from JSON keys of the vLLM contract (`BY_JSON`; other keys are the caller's), each
    coerced by its field's type and checked against its range; None means not given. Raises ValueError naming
    `shown_prefix` + the key."""
    values = {}
    for key, raw in obj.items():
        f = BY_JSON.get(key)
        if f is None or raw is None:
            continue
        shown = shown_prefix + key
        if f.name == "guided_decoding_guide":
            if "guided_decoding_guide_type" in values:
                raise ValueError(f"{shown}: give one structured-output key ({', '.join(f.json)})")
            values["guided_decoding_guide_type"], values[f.name] = _vllm_guide(key, raw, shown)
            continue
        v = _coerce(f, shown, raw)
        f.check(v, shown)
        values[f.name] = v
    return values


def _vllm_guide(key: str, raw, shown: str) -> tuple[str, str]:
    """(guide type, guide text) of one of the vLLM contract's structured-output keys."""
    if key == "structured_outputs":
        given = {k: v for k, v in raw.items() if v not in (None, False)} if isinstance(raw, dict) else None
        if not given or len(given) != 1 or next(iter(given)) not in STRUCTURED_OUTPUTS_KEYS:
            raise ValueError(f"{shown} must be an object with exactly one of {', '.join(STRUCTURED_OUTPUTS_KEYS)}")
        (sub, value), = given.items()
        return _vllm_guide(STRUCTURED_OUTPUTS_KEYS[sub], value, f"{shown}.{sub}")
    kind = VLLM_GUIDES[key]
    if kind == "json":
        if parse_bool(raw) is not True:
            raise ValueError(f"{shown} must be true (or left out)")
        return kind, ""
    if kind == "json_schema":
        return kind, raw if isinstance(raw, str) else json.dumps(raw)
    if kind == "choice":
        if not isinstance(raw, list):
            raise ValueError(f"{shown} must be a list of strings")
        return kind, json.dumps(raw)
    if not isinstance(raw, str):
        raise ValueError(f"{shown} must be a string")
    return kind, raw


def ensemble_inputs_from_values(values: dict[str, object]) -> dict[str, object]:
    """{ensemble input name: value} for field values (the client's `build_inputs` turns them into tensors)."""
    return {BY_NAME[name].tensor_names[0]: v for name, v in values.items()}


def tensors_from_values(values: dict[str, object]) -> dict[str, np.ndarray]:
    """The llm step's tensors ([1, ...] batched) for field values (what vllm_model sends over BLS)."""
    out = {}
    for name, v in values.items():
        f = BY_NAME[name]
        t = f.tensor_names[0]
        if f.kind in ("str", "json"):
            out[t] = np.array([[v.encode("utf-8")]], dtype=np.object_)
        elif f.kind == "str_list":
            out[t] = np.array([[w.encode("utf-8") for w in v]], dtype=np.object_)
        elif f.kind == "int_list":
            out[t] = np.array([v], dtype=np.int32)
        else:
            dtype = {"int": np.int32, "uint": np.uint64, "float": np.float32, "bool": np.bool_}[f.kind]
            out[t] = np.array([[v]], dtype=dtype)
    return out


# -- values -> engine settings ---------------------------------------------------------------------------
def sampling_params(values: dict[str, object]) -> SamplingParams:
    """SamplingParams from field values. With none of temperature, top_k, top_p, min_p given, decoding is greedy
    (TRT-LLM's default; the vLLM-shaped entry point always sends a temperature, vLLM's default being 1)."""
    kwargs = {f.name: values[f.name] for f in SAMPLING_FIELDS if f.name in values}
    if not any(k in values for k in ("temperature", "top_k", "top_p", "min_p")):
        kwargs["temperature"] = 0.0
    if values.get("end_id") is not None:
        kwargs["stop_token_ids"] = [*kwargs.get("stop_token_ids", []), values["end_id"]]
    if values.get("return_log_probs") and kwargs.get("logprobs") is None:
        kwargs["logprobs"] = 0
    for f in SAMPLING_FIELDS:
        if f.parse is not None and values.get(f.name) is not None:
            kwargs[f.name] = f.parse(values[f.name])
    if values.get("guided_decoding_guide_type") is not None:
        kwargs["guide"] = Guide(values["guided_decoding_guide_type"], values.get("guided_decoding_guide") or "")
    elif values.get("guided_decoding_guide"):
        raise ValueError("guided_decoding_guide needs guided_decoding_guide_type "
                         f"({', '.join(GUIDE_TYPES)})")
    params = SamplingParams(**kwargs)
    params.validate()
    return params


def request_parameters_error(parameters_json: str) -> str | None:
    """A message naming unknown Triton request parameters (HTTP generate turns unknown top-level JSON keys into
    parameters), or None. Triton's own `triton_*` parameters are fine."""
    try:
        params = json.loads(parameters_json or "{}")
    except json.JSONDecodeError:
        return None
    unknown = sorted(k for k in params if not k.startswith("triton_"))
    if not unknown:
        return None
    return (f"unknown request field(s) {', '.join(unknown)}; this model's inputs are listed by "
            "GET /v2/models/<model>/config (see docs/requests.md's field tables)")


def fields_markdown() -> str:
    """The table of request fields in docs/requests.md (tests/test_api.py checks it holds exactly this)."""
    rows = ["| field | `ensemble` input(s) | `sampling_parameters` key | type | default | allowed | meaning |",
            "|---|---|---|---|---|---|---|"]
    for f in FIELDS:
        ens = " / ".join(f"`{t}`" for t in f.tensor_names) if f.in_ensemble else "-"
        js = " / ".join(f"`{k}`" for k in f.json) or "-"
        kind = TRITON_TYPES[f.kind].removeprefix("TYPE_") + (" list" if f.kind.endswith("_list") else "")
        default = "none" if f.default is None else str(f.default).lower() if isinstance(f.default, bool) \
            else "[]" if isinstance(f.default, list) else str(f.default)
        rows.append(f"| {f.name} | {ens} | {js} | {kind} | {default} | {f.range_text() or '-'} | {f.doc} |")
    return "\n".join(rows)
