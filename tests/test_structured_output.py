"""Structured output (backend/engine/structured_output.py): guides that are refused by name, sampled output at
temperature 1 that always parses and validates, exactness (a guide the free answer already satisfies changes
nothing; speculation on or off changes nothing), and the three entry points through a real tritonserver."""
from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from test_engine import run
from test_spec_decode import REPETITIVE, engine
from trellm_backend.engine.request import SamplingParams
from trellm_backend.engine.structured_output import Guide, GuideError

# Every string and list is bounded, so a random model's samples end inside max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": -1, "maximum": 1},
        "role": {"enum": ["admin", "user", "guest"]},
        "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1, "maxItems": 3},
        "address": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                                                     "ok": {"type": "boolean"}},
                    "required": ["zip", "ok"], "additionalProperties": False},
    },
    "required": ["name", "age", "score", "role", "code", "tags", "address"],
    "additionalProperties": False,
}
REGEX = r"(\+|-)?[0-9]{1,4}\.[0-9]{2} [a-z]{2,6}"
CHOICES = ["red", "green", "blue and yellow"]
ARITHMETIC = ('root ::= term (op term){0,3}\nterm ::= num | "(" num op num ")"\nop ::= "+" | "-" | "*"\n'
              'num ::= [0-9]{1,2}')


def check(guide: Guide, text: str) -> None:
    """Raise if `text` does not satisfy `guide`."""
    if guide.type == "json_schema":
        jsonschema.validate(json.loads(text), json.loads(guide.text))
    elif guide.type == "json":
        assert isinstance(json.loads(text), dict), text
    elif guide.type == "regex":
        assert re.fullmatch(guide.text, text), text
    elif guide.type == "choice":
        assert text in json.loads(guide.text), text
    else:
        term = r"([0-9]{1,2}|\([0-9]{1,2}[-+*][0-9]{1,2}\))"       # ARITHMETIC, written as a regex
        assert re.fullmatch(f"{term}([-+*]{term}){{0,3}}", text), text


# Bounded guides: every sample must end (finish_reason stop) inside max_tokens and satisfy its guide.
GUIDES = [Guide("json_schema", json.dumps(SCHEMA)), Guide("regex", REGEX), Guide("choice", json.dumps(CHOICES)),
          Guide("ebnf_grammar", ARITHMETIC)]


@pytest.mark.unit
@pytest.mark.parametrize("schema, named", [
    ({"type": "array", "uniqueItems": True}, "'uniqueItems' (at #/uniqueItems)"),
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "'not' (at #/properties/a/not)"),
    ({"type": "string", "format": "credit-card"}, "format 'credit-card'"),
    ({"type": "number", "multipleOf": 0.5}, "'multipleOf'"),
    ({"anyOf": [{"type": "string"}, {"if": {"type": "string"}}]}, "'if' (at #/anyOf/1/if)"),
])
def test_a_schema_keyword_that_would_not_be_enforced_is_refused_by_name(schema, named):
    with pytest.raises(GuideError, match=re.escape(named)):
        SamplingParams(guide=Guide("json_schema", json.dumps(schema))).validate()


# Schemas check_schema accepts, of every keyword family and the combinations xgrammar handles specially: compiling
# any of them must not make xgrammar log that it ignores or does not support a part.
CORPUS = [
    SCHEMA,
    {"type": "string", "pattern": "^[a-z]+$", "minLength": 3, "maxLength": 5},
    {"type": "string", "pattern": "[0-9]*", "maxLength": 4},
    {"type": "string", "pattern": "^x+$", "minLength": 2},
    {"type": "string", "minLength": 3, "maxLength": 5},
    {"type": ["string", "null"], "maxLength": 3},
    {"type": "string", "format": "email"},
    {"type": "string", "enum": ["a", "b"], "maxLength": 1},
    {"type": "integer", "multipleOf": 3, "minimum": 0, "maximum": 100},
    {"type": "number", "exclusiveMinimum": 0, "maximum": 2.5},
    {"type": "object", "patternProperties": {"^a[0-9]+$": {"type": "integer"}}},
    {"type": "object", "propertyNames": {"pattern": "^[a-z]+$", "maxLength": 3}},
    {"type": "object", "additionalProperties": {"type": "string", "pattern": "^[0-9]+$", "minLength": 2}},
    {"type": "object", "unevaluatedProperties": False, "properties": {"a": {"type": "integer"}}},
    {"type": "array", "prefixItems": [{"type": "integer"}], "items": False, "minItems": 1},
    {"anyOf": [{"type": "string", "pattern": "^x+$", "maxLength": 2}, {"type": "integer"}]},
    {"$defs": {"d": {"type": "string", "pattern": "\\d+", "maxLength": 3}}, "type": "array", "items": {"$ref": "#/$defs/d"}},
]


@pytest.fixture(scope="module")
def grammars(tokenizer):
    from trellm_backend.engine.structured_output import GrammarCompiler
    return GrammarCompiler(tokenizer, len(tokenizer), {tokenizer.eos_token_id})


@pytest.mark.parametrize("schema", CORPUS, ids=range(len(CORPUS)))
def test_no_accepted_schema_has_a_part_xgrammar_drops(grammars, capfd, schema):
    """xgrammar logs (to stderr, from C++) a part it ignores and compiles the rest: a 200 whose output breaks the
    schema. Every schema the check accepts compiles without such a line."""
    guide = Guide("json_schema", json.dumps(schema))
    guide.validate()
    grammars.compile(guide).result()
    logged = capfd.readouterr().err
    assert not re.search(r"(?i)ignor|not supported", logged), logged


@pytest.mark.parametrize("schema, valid, invalid", [
    ({"type": "string", "pattern": "^[a-z]+$", "minLength": 3, "maxLength": 5}, ["abc", "abcde"], ["ab", "abcdef"]),
    ({"type": "string", "pattern": "[0-9]*", "maxLength": 2}, ["", "12"], ["123"]),
    ({"type": "string", "pattern": "^x{1,9}$", "minLength": 4}, ["xxxx"], ["xxx", "x" * 10]),
])
def test_lengths_beside_a_pattern_are_enforced(grammars, schema, valid, invalid):
    """The lengths are folded into the pattern, so the grammar takes exactly the strings of those lengths (xgrammar
    alone dropped them: 5-7 of 20 samples broke the schema)."""
    compiled = grammars.compile(Guide("json_schema", json.dumps(schema))).result()
    for text in valid + invalid:
        matcher = grammars.matcher(compiled)
        taken = matcher.accept_string(json.dumps(text)) and matcher.is_completed()
        assert taken == (text in valid), (schema, text)


@pytest.mark.unit
@pytest.mark.parametrize("guide, named", [
    (Guide("json_schema", json.dumps({"type": "string", "pattern": "^.$|^ab$", "maxLength": 1})),
     "'pattern' with 'maxLength' (at #)"),
    (Guide("json_schema", json.dumps({"type": "string", "pattern": "^[a-z]{2}$", "minLength": 3})),
     "'pattern' with 'minLength' (at #)"),
    (Guide("json_schema", json.dumps({"properties": {"d": {"type": "string", "format": "date", "maxLength": 9}}})),
     "'format' with 'maxLength' (at #/properties/d)"),
    (Guide("json_schema", json.dumps({"type": "string", "pattern": "^(?!admin)[a-z]+$"})),
     "pattern at #/pattern uses a lookaround assertion ((?!a... at position 1)"),
    (Guide("json_schema", json.dumps({"type": "object", "patternProperties": {"(?<=x)y": {}}})),
     "patternProperties name at #/patternProperties uses a lookaround"),
    (Guide("regex", "[a-z]+(?=[0-9])"), "the regex guide uses a lookaround assertion ((?=[... at position 6)"),
])
def test_a_combination_xgrammar_would_drop_is_refused_by_name(guide, named):
    with pytest.raises(GuideError, match=re.escape(named)):
        SamplingParams(guide=guide).validate()


@pytest.mark.unit
def test_escaped_and_bracketed_parentheses_are_not_lookarounds():
    for regex in [r"\(?=", r"[(?=]+", r"a\\(b)"]:
        Guide("regex", regex).validate()


@pytest.mark.unit
def test_guides_are_bounded_and_typed():
    for guide, message in [(Guide("xml", "<a/>"), "guided_decoding_guide_type must be one of"),
                           (Guide("regex", "a" * 70000), "at most 65536"),
                           (Guide("choice", "[]"), "non-empty JSON list"),
                           (Guide("json_schema", "{not json"), "not valid JSON"),
                           (Guide("regex", ""), "empty")]:
        with pytest.raises(GuideError, match=message):
            guide.validate()
    deep = {"type": "string"}
    for _ in range(40):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(GuideError, match="deeper than 32"):
        Guide("json_schema", json.dumps(deep)).validate()


@pytest.mark.parametrize("guide", GUIDES, ids=lambda g: g.type)
def test_sampled_output_at_temperature_one_always_satisfies_the_guide(default_model_path, tokenizer, guide):
    eng = engine(default_model_path, tokenizer, method="none")
    prompts = [tokenizer(p)["input_ids"] for p in ["Hello", "The answer is", "A list:", "def f(x):"]]
    outs = run(eng, prompts * 3, None, params_of=lambda i: SamplingParams(
        max_tokens=400, temperature=1.0, seed=i, guide=guide))
    for o in outs:
        assert o["reason"] == "stop", o
        check(guide, o["text"])


def test_any_json_object_is_an_object_wherever_it_ends(default_model_path, tokenizer):
    """`json` (OpenAI's json_object) bounds nothing, so a random model's sample may reach max_tokens inside it; what
    ends by itself parses as an object, and every sample is one from its first character."""
    eng = engine(default_model_path, tokenizer, method="none")
    prompts = [tokenizer(p)["input_ids"] for p in ["Hello", "The answer is", "A list:"]]
    outs = run(eng, prompts * 4, None, params_of=lambda i: SamplingParams(
        max_tokens=64, temperature=1.0, seed=i, guide=Guide("json")))
    assert all(o["text"].startswith("{") for o in outs)
    for o in outs:
        if o["reason"] == "stop":
            check(Guide("json"), o["text"])


def test_a_guide_the_free_answer_satisfies_changes_nothing(default_model_path, tokenizer):
    eng = engine(default_model_path, tokenizer, method="none")
    prompts = [tokenizer(p)["input_ids"] for p in REPETITIVE]
    free = run(eng, prompts, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    guided = run(eng, prompts, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                              guide=Guide("regex", r"[\s\S]*")))
    assert [o["tokens"] for o in guided] == [o["tokens"] for o in free]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_guided_output_is_the_same_with_speculation_on_or_off(default_model_path, tokenizer, temperature):
    prompts = [tokenizer(p)["input_ids"] for p in REPETITIVE]
    guide = Guide("regex", r"[a-z ,.():+=\n]{0,120}")
    params = dict(max_tokens=60, temperature=temperature, logprobs=2)
    outs = {}
    for method in ("none", "ngram"):
        eng = engine(default_model_path, tokenizer, method=method, num_speculative_tokens=3)
        outs[method] = run(eng, prompts, None, params_of=lambda i: SamplingParams(**params, seed=i, guide=guide))
        if method == "ngram":
            assert eng.scheduler.spec.num_draft_tokens > 0, "no step carried guesses"
    for off, on in zip(outs["none"], outs["ngram"]):
        assert on["tokens"] == off["tokens"] and on["reason"] == off["reason"]
        assert on["logprobs"] == pytest.approx(off["logprobs"], abs=1e-4)
        check(guide, on["text"])


def test_a_grammar_that_does_not_compile_fails_its_request_only(default_model_path, tokenizer):
    eng = engine(default_model_path, tokenizer, method="none")
    prompt = tokenizer("Hello")["input_ids"]
    bad = eng.make_request("bad", prompt, SamplingParams(guide=Guide("ebnf_grammar", "root ::= missing_rule")))
    with pytest.raises(GuideError, match="missing_rule"):
        eng.add(bad)
    good = run(eng, [prompt], SamplingParams(max_tokens=5, guide=Guide("choice", '["yes", "no"]')))
    assert good[0]["text"] in ("yes", "no")
    assert eng.grammars.stats.requests == 2


# -- through a real tritonserver ------------------------------------------------------------------------------
@pytest.mark.server
def test_every_entry_point_takes_a_guide(triton_server):
    from trellm_client.client import LLMClient, http_generate
    schema = json.dumps(SCHEMA)
    with LLMClient(triton_server.grpc_url) as c:
        text = c.generate("Hello", max_tokens=300, temperature=1.0, seed=3, exclude_input_in_output=True,
                          guided_decoding_guide_type="json_schema",
                          guided_decoding_guide=schema)
        check(Guide("json_schema", schema), text)
        # n = 2: each sample has its own matcher (and seed); a stop string still ends a guided answer.
        texts = {0: "", 1: ""}
        for chunk in c.stream_chunks("Hello", stream=True, max_tokens=300, temperature=1.0, seed=5,
                                     num_return_sequences=2, guided_decoding_guide_type="json_schema",
                                     guided_decoding_guide=schema):
            texts[chunk.sequence_index] += chunk.text
        for sample in texts.values():
            check(Guide("json_schema", schema), sample)
        assert texts[0] != texts[1]
        cut = c.generate("Hello", max_tokens=300, temperature=1.0, seed=3, exclude_input_in_output=True,
                         stop_words=['"age"'], guided_decoding_guide_type="json_schema", guided_decoding_guide=schema)
        assert text[:text.index('"age"')] == cut, "the stop string cuts the same guided answer"
        with pytest.raises(Exception, match="'uniqueItems'"):
            c.generate("Hello", guided_decoding_guide_type="json_schema",
                       guided_decoding_guide='{"type": "array", "uniqueItems": true}')
    answer = http_generate(triton_server.http_url, "Pick one", "vllm_model", timeout=60, sampling_parameters=json.dumps(
        {"temperature": 1.0, "seed": 1, "max_tokens": 20, "guided_choice": CHOICES}))[0]["text_output"]
    assert answer.removeprefix("Pick one") in CHOICES, answer


@pytest.mark.unit
def test_every_contract_spells_a_guide_its_own_way_and_means_the_same():
    from trellm_backend.triton import fields
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    want = Guide("json_schema", json.dumps(schema))
    for sampling in ({"guided_json": schema}, {"guided_json": json.dumps(schema)},
                     {"structured_outputs": {"json": schema}}):
        assert fields.sampling_params(fields.values_from_sampling_json(json.dumps(sampling))).guide == want
    tensors = {"guided_decoding_guide_type": np.array([[b"json_schema"]], dtype=np.object_),
               "guided_decoding_guide": np.array([[json.dumps(schema).encode()]], dtype=np.object_)}
    assert fields.sampling_params(fields.values_from_tensors(tensors)).guide == want
    # vllm_model hands its values to llm as tensors: the guide survives the trip.
    values = fields.values_from_sampling_json('{"guided_choice": ["a", "b"]}')
    assert fields.sampling_params(fields.values_from_tensors(fields.tensors_from_values(values))).guide == \
        Guide("choice", '["a", "b"]')
    assert fields.sampling_params(fields.values_from_json({"guided_json_object": True})).guide == Guide("json")
    for sampling, message in [({"guided_regex": "a", "guided_choice": ["b"]}, "give one structured-output key"),
                              ({"structured_outputs": {"xml": "<a/>"}}, "exactly one of"),
                              ({"guided_choice": "a"}, "must be a list"),
                              ({"guided_json_object": False}, "must be true")]:
        with pytest.raises(ValueError, match=message):
            fields.sampling_params(fields.values_from_sampling_json(json.dumps(sampling)))
    with pytest.raises(ValueError, match="needs guided_decoding_guide_type"):
        fields.sampling_params(fields.values_from_tensors({"guided_decoding_guide": tensors["guided_decoding_guide"]}))


def test_preemption_prefix_caching_and_logprobs_keep_guided_output_right(default_model_path, tokenizer):
    """Guided sequences preempted for lack of blocks (and recomputed, partly from the prefix cache) give the same
    tokens as with room for all; logprobs are those of the masked distribution (no forbidden alternative)."""
    prompts = [tokenizer(p)["input_ids"] for p in REPETITIVE] * 2
    guide = Guide("json_schema", json.dumps(SCHEMA))
    params = dict(max_tokens=200, temperature=1.0, logprobs=3, min_tokens=500)

    def outputs(**kw):
        eng = engine(default_model_path, tokenizer, method="none", block_size=16, max_num_batched_tokens=64, **kw)
        outs = run(eng, prompts, None, params_of=lambda i: SamplingParams(**params, seed=i, guide=guide))
        return eng, outs
    roomy, free = outputs()
    tight, squeezed = outputs(num_kv_blocks=20)
    assert tight.num_preemptions > 0 and roomy.num_preemptions == 0
    assert [o["tokens"] for o in squeezed] == [o["tokens"] for o in free]
    for o in squeezed:
        assert o["reason"] == "stop", "the grammar ends the answer even below min_tokens"
        check(guide, o["text"])
        for rank, top in o["top"]:
            assert all(logprob > float("-inf") for _, logprob in top)
    first = squeezed[0]["top"][0][1]     # the first token of a compact JSON object can only be "{"
    assert len(first) == 1 and tokenizer.decode([first[0][0]]).strip() == "{"
