"""Structured output in the engine (``engine.structured`` + core/sampler hooks), on the tiny random
checkpoint with the real llguidance matchers: a constrained greedy request is the argmax of the
masked logits at every step (logprobs those of the raw logits), unconstrained requests sharing its
batches are unchanged, the constraint holds across prefill -> decode, and a broken grammar fails
its own request only."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from services.convert import params_from_proto, params_to_proto
from swaserve.config import EngineConfig
from swaserve.engine.grammar import grammar_of, validate
from swaserve.engine.ipc import AddRequest, Decoder, ToCore, encode
from swaserve.engine.llm_engine import LLMEngine
from swaserve.engine.sampler import Sampler
from swaserve.engine.sampling_state import SamplingState
from swaserve.engine.structured import StructuredDecoder
from swaserve.engine.types import FinishReason, SamplingParams, StructuredOutput
from tests.transfer.test_pd_inprocess import run_pd, run_single

CFG = EngineConfig(page_size=4, max_num_batched_tokens=64, kv_cache_memory=8 << 20, max_model_len=512)
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["cat", "dog", "fish"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
    },
    "required": ["name", "age", "kind", "tags"],
    "additionalProperties": False,
}
NESTED = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "owner": {
            "type": "object",
            "properties": {"first": {"type": "string", "maxLength": 5}, "ok": {"type": "boolean"}},
            "required": ["first", "ok"],
            "additionalProperties": False,
        },
    },
    "required": ["id", "owner"],
    "additionalProperties": False,
}


def schema_output(schema: dict) -> StructuredOutput:  # type: ignore[type-arg]
    return StructuredOutput("json_schema", json.dumps(schema))


@pytest.fixture(scope="module")
def eng(tiny_dir: Path) -> LLMEngine:
    return LLMEngine(tiny_dir, CFG)


def run(eng: LLMEngine, reqs: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, dict]:  # type: ignore[type-arg]
    """Run requests together; per id its tokens, text, logprobs, finish reason and error."""
    out: dict[str, dict] = {rid: {"ids": [], "text": "", "lps": []} for rid in reqs}  # type: ignore[type-arg]
    for rid, (prompt, params) in reqs.items():
        eng.add_request(rid, prompt, params)
    while eng.has_unfinished():
        for o in eng.step():
            r = out[o.request_id]
            r["ids"] += o.new_token_ids
            r["text"] += o.new_text
            r["lps"] += [lp.logprob for lp in o.new_logprobs]
            if o.finished:
                r["reason"], r["error"] = o.finish_reason, o.error
    return out


# ------------------------------------------------------------------------------ compile, validate


def test_each_kind_compiles_and_bad_specs_are_refused_with_a_message() -> None:
    for so in [
        StructuredOutput("json_object"),
        schema_output(PERSON),
        StructuredOutput("regex", r"[a-z]{2}\d"),
        StructuredOutput("choice", json.dumps(["yes", "no", 'a "quoted" one'])),
        StructuredOutput("grammar", 'start: "x" NUM\nNUM: /[0-9]{2}/'),
        StructuredOutput("grammar", 'root ::= "ab" [0-9]'),  # GBNF is taken too
    ]:
        validate(so)
        assert grammar_of(so)
    for so, message in [
        (StructuredOutput("json_schema", "{not json"), "not valid JSON"),
        (StructuredOutput("json_schema", "[1, 2]"), "object or a boolean"),
        (StructuredOutput("json_schema", '{"type": "foo"}'), "foo"),
        (StructuredOutput("json_schema", '{"type": "string", "format": "weird"}'), "weird"),
        (StructuredOutput("regex", "(("), "unclosed group"),
        (StructuredOutput("choice", "[]"), "non-empty list of strings"),
        (StructuredOutput("choice", "[1]"), "non-empty list of strings"),
        (StructuredOutput("grammar", "start: nothing_here"), "nothing_here"),
        (StructuredOutput("xml", ""), "kind"),  # type: ignore[arg-type]
    ]:
        with pytest.raises(ValueError, match=message):
            validate(so)


def test_eos_is_allowed_only_where_the_grammar_accepts(tiny_dir: Path) -> None:
    dec = StructuredDecoder(tiny_dir, 512, {0, 2})
    g = dec.new(StructuredOutput("regex", "[a-z]+"))
    logits = torch.zeros(1, 512)
    allowed = dec.mask(logits, [g])[0] > -math.inf  # type: ignore[index]
    assert not allowed[0] and not allowed[2] and 0 < int(allowed.sum()) < 512
    letter = dec.tokenizer.tokenize_str("a")[0]
    g.accept(letter)
    assert not g.done and not g.error
    allowed = dec.mask(logits, [g])[0] > -math.inf  # type: ignore[index]
    assert allowed[0] and allowed[2]
    assert dec.mask(logits, [None]) is None  # nothing constrained: nothing done


def test_parallel_and_serial_mask_fills_agree(tiny_dir: Path) -> None:
    serial, parallel = StructuredDecoder(tiny_dir, 512, {0, 2}), StructuredDecoder(tiny_dir, 512, {0, 2}, 2)
    specs = [
        schema_output(PERSON),
        StructuredOutput("regex", "[a-z]{2,5}"),
        StructuredOutput("choice", '["ab", "cd"]'),
    ]
    text = ['{"name": "', "abc", "a"]
    grammars = []
    for dec in (serial, parallel):
        gs = [dec.new(so, dec.tokenizer.tokenize_str(t)) for so, t in zip(specs, text, strict=True)]
        grammars.append([gs[0], None, gs[1], gs[2]])
    logits = torch.randn(4, 512)
    a, b = serial.mask(logits, grammars[0]), parallel.mask(logits, grammars[1])
    assert a is not None and b is not None and torch.equal(a, b) and torch.equal(a[1], logits[1])
    assert parallel._executor is not None and serial._executor is None


def test_sampler_picks_from_the_masked_logits_and_reports_raw_logprobs() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 64)
    allowed = torch.zeros(3, 64, dtype=torch.bool)
    allowed[:, [5, 9, 40]] = True
    masked = logits.masked_fill(~allowed, -math.inf)
    states = [
        SamplingState.create(SamplingParams(temperature=0.0, logprobs=2), [1], "cpu"),
        SamplingState.create(SamplingParams(temperature=1.0, seed=3, top_p=0.9, logprobs=0), [1], "cpu"),
        SamplingState.create(
            SamplingParams(temperature=0.7, top_k=2, repetition_penalty=1.3, seed=4), [5], "cpu"
        ),
    ]
    for _ in range(20):
        got = Sampler().sample(logits, states, masked)
        assert got[0].token_id == int(masked[0].argmax())
        assert all(s.token_id in (5, 9, 40) for s in got)
        raw = torch.log_softmax(logits, dim=-1)
        for i in (0, 1):
            lp = got[i].logprob
            assert lp is not None and lp.logprob == pytest.approx(float(raw[i, lp.token_id]), abs=1e-5)
        assert got[0].logprob is not None and got[0].logprob.top[0][0] == int(logits[0].argmax())


# ------------------------------------------------------------------------------ engine


def test_greedy_constrained_is_the_argmax_of_the_masked_logits(eng: LLMEngine, hf_tiny) -> None:  # type: ignore[no-untyped-def]
    prompt = eng.tokenizer.encode("Give me a JSON person:")
    for schema in (PERSON, NESTED):
        so = schema_output(schema)
        params = SamplingParams(max_tokens=200, temperature=0.0, logprobs=0, structured=so)
        (r,) = run(eng, {"a": (prompt, params)}).values()
        assert r["reason"] == FinishReason.STOP and r["error"] == ""
        jsonschema.validate(json.loads(r["text"]), schema)
        assert r["text"] == eng.tokenizer.decode(r["ids"])  # the last token is text, not a stop token
        with torch.no_grad():
            logits = hf_tiny(torch.tensor([prompt + r["ids"]])).logits[0, len(prompt) - 1 : -1].float()
        g = eng.core.structured.new(so)
        for i, token in enumerate(r["ids"]):
            masked = eng.core.structured.mask(logits[i : i + 1], [g])
            assert masked is not None and int(masked.argmax()) == token, i
            raw = float(torch.log_softmax(logits[i], dim=-1)[token])
            assert r["lps"][i] == pytest.approx(raw, abs=1e-4)  # logprobs of the raw logits
            g.accept(token)
        assert g.done and not g.error


def test_mixed_batches_leave_unconstrained_requests_unchanged(eng: LLMEngine, tiny_dir: Path) -> None:
    tok = eng.tokenizer
    plain = {
        "greedy": (tok.encode("The agent opened the file and"), SamplingParams(max_tokens=24, temperature=0.0, logprobs=1)),
        "seeded": (tok.encode("Once upon a time"), SamplingParams(max_tokens=24, temperature=0.9, seed=11, logprobs=1)),
    }  # fmt: skip
    alone = run(LLMEngine(tiny_dir, CFG), plain)
    constrained = {
        "json": (tok.encode("JSON:"), SamplingParams(max_tokens=120, temperature=0.0, structured=schema_output(NESTED))),
        "regex": (tok.encode("mail:"), SamplingParams(max_tokens=40, temperature=1.0, seed=5,
                                                      structured=StructuredOutput("regex", r"[a-z]{3,6}@[a-z]{2,4}\.com"))),
        "choice": (tok.encode("pick:"), SamplingParams(max_tokens=8, structured=StructuredOutput("choice", '["red", "green"]'))),
    }  # fmt: skip
    mixed = run(eng, {**plain, **constrained})
    for rid in plain:
        assert mixed[rid]["ids"] == alone[rid]["ids"], rid
        assert mixed[rid]["lps"] == pytest.approx(alone[rid]["lps"], abs=1e-5)
    jsonschema.validate(json.loads(mixed["json"]["text"]), NESTED)
    assert re.fullmatch(r"[a-z]{3,6}@[a-z]{2,4}\.com", mixed["regex"]["text"])
    assert mixed["choice"]["text"] in ("red", "green") and mixed["choice"]["reason"] == FinishReason.STOP


def test_sampled_constrained_output_validates(eng: LLMEngine) -> None:
    prompt = eng.tokenizer.encode("person:")
    so = schema_output(PERSON)
    reqs = {
        f"s{seed}": (prompt, SamplingParams(max_tokens=200, temperature=1.0, seed=seed, structured=so))
        for seed in range(4)
    }
    out = run(eng, reqs)
    for r in out.values():
        assert r["reason"] == FinishReason.STOP
        jsonschema.validate(json.loads(r["text"]), PERSON)
    again = run(eng, {"s0": reqs["s0"]})
    assert again["s0"]["ids"] == out["s0"]["ids"]  # seeded: reproducible


def test_a_broken_grammar_fails_its_request_only(eng: LLMEngine) -> None:
    tok = eng.tokenizer
    so = StructuredOutput("regex", "[a-z]+")
    eng.add_request("bad", tok.encode("x"), SamplingParams(max_tokens=20, temperature=0.0, structured=so))
    eng.add_request("fine", tok.encode("y"), SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    grammar = eng.requests["bad"].grammar
    assert grammar is not None
    grammar.matcher.consume_token(tok.encode("7")[0])  # a digit the regex refuses: the matcher breaks
    outs: dict[str, list] = {"bad": [], "fine": []}  # type: ignore[type-arg]
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id].append(o)
    (bad,) = outs["bad"]
    assert bad.finish_reason == FinishReason.ABORT and "structured output failed" in bad.error
    assert bad.new_token_ids == []
    assert (
        outs["fine"][-1].finish_reason == FinishReason.LENGTH
        and sum(len(o.new_token_ids) for o in outs["fine"]) == 10
    )
    assert eng.stats().pools["full"].request_pages == 0 and not eng.requests


def test_pd_keeps_the_constraint_and_equals_one_engine(tiny_dir: Path) -> None:
    single, pre = LLMEngine(tiny_dir, CFG), LLMEngine(tiny_dir, CFG)
    dec = LLMEngine(tiny_dir, dataclasses.replace(CFG, enable_prefix_caching=False))
    prompts = {
        f"r{i}": single.tokenizer.encode(p) for i, p in enumerate(["JSON:", "a person", "nested please"])
    }
    for params in (
        SamplingParams(max_tokens=150, temperature=0.0, logprobs=0, structured=schema_output(PERSON)),
        SamplingParams(max_tokens=150, temperature=1.0, seed=9, logprobs=0, structured=schema_output(NESTED)),
    ):
        want = run_single(single, prompts, params)
        got, _ = run_pd(pre, dec, prompts, params)
        schema = PERSON if params.structured == schema_output(PERSON) else NESTED
        for rid in prompts:
            assert got[rid][0] == want[rid][0], rid
            jsonschema.validate(json.loads(single.tokenizer.decode(got[rid][0])), schema)
    # the decode side feeds the first token to its own matcher: one the grammar refuses is refused
    pre.add_request("x", prompts["r0"], dataclasses.replace(params, max_tokens=5), export_kv=True)
    (o,) = [o for o in pre.step() if o.finished]
    with pytest.raises(ValueError, match="structured output failed"):
        dec.add_prefilled("x", prompts["r0"], single.tokenizer.encode("z")[0], params, o.kv_payload)


def test_structured_output_crosses_ipc_and_grpc() -> None:
    params = SamplingParams(max_tokens=7, structured=StructuredOutput("choice", '["a", "b"]'))
    msg = Decoder(ToCore).decode(encode(AddRequest("r", [1, 2], params, 0.0)))
    assert msg.params == params
    assert params_from_proto(params_to_proto(params)) == params
    assert params_from_proto(params_to_proto(SamplingParams())).structured is None
    m = params_to_proto(params)
    m.structured.kind = "xml"
    with pytest.raises(ValueError, match="kind"):
        params_from_proto(m)
