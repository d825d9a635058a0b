"""A JSON schema with a keyword the output would not obey is refused in one line, nothing queued:
an unknown keyword (a typo xgrammar would skip without a word) or one xgrammar does not enforce.

`UNENFORCED` is a measured fact about xgrammar, so it is checked against xgrammar's own matcher
here: each keyword listed lets a violating value through (if a newer xgrammar enforces one, this
test says so and it can leave the list), and the keywords a pydantic model emits pass."""
from __future__ import annotations

import json
from typing import Literal

import pytest

xgr = pytest.importorskip("xgrammar")
from pydantic import BaseModel, Field  # noqa: E402

from jupyter_pagedkv import SamplingParams, StructuredOutputsParams  # noqa: E402
from jupyter_pagedkv.decoding.schema_keywords import UNENFORCED, check_schema_keywords  # noqa: E402
from test_structured_outputs import MODEL, TOKENIZER, VOCAB  # noqa: E402

# Each keyword xgrammar leaves unenforced, in a schema for "a", and a value of "a" that breaks it.
VIOLATIONS = {
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]"),
    "contains": ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, "[1]"),
    "maxContains": ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}, "maxContains": 1},
                    "[5, 5]"),
    "dependentRequired": ({"type": "object", "properties": {"b": {"type": "integer"}, "c": {"type": "integer"}},
                           "dependentRequired": {"b": ["c"]}}, '{"b": 1}'),
    "dependentSchemas": ({"type": "object", "properties": {"b": {"type": "integer"}, "c": {"type": "integer"}},
                          "dependentSchemas": {"b": {"required": ["c"]}}}, '{"b": 1}'),
    "not": ({"type": "integer", "not": {"const": 1}}, "1"),
    "if": ({"type": "string", "if": {"const": "x"}, "then": {"minLength": 3}}, '"x"'),
    "multipleOf on a number": ({"type": "number", "multipleOf": 0.5}, "0.3"),
    "allOf of two": ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "1"),
    "maxLength beside a pattern": ({"type": "string", "pattern": "^a+$", "maxLength": 2}, '"aaaa"'),
}


def xgrammar_accepts(schema: dict, text: str) -> bool:
    """Whether xgrammar's own matcher takes `text` as a complete output of `schema`."""
    info = xgr.TokenizerInfo.from_huggingface(TOKENIZER, vocab_size=VOCAB)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(schema), any_whitespace=False)
    matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_completed()


def wrap(sub: dict) -> dict:
    return {"type": "object", "properties": {"a": sub}, "required": ["a"]}


@pytest.mark.parametrize("name", list(VIOLATIONS))
def test_what_we_refuse_xgrammar_really_does_not_enforce(name):
    sub, bad = VIOLATIONS[name]
    assert xgrammar_accepts(wrap(sub), '{"a": ' + bad + "}"), (
        f"xgrammar now enforces {name}: it can leave schema_keywords.UNENFORCED")
    named = "contains" if name == "maxContains" else name.split()[0]   # the first in the schema is named
    with pytest.raises(ValueError, match=f"JSON-schema keyword '{named}'.* at #/properties/a is not "
                                         f"enforced by xgrammar"):
        check_schema_keywords(wrap(sub))


def test_every_unenforced_keyword_has_its_violation_measured():
    measured = {name.split()[0] for name in VIOLATIONS}
    # `then`/`else` go with `if`; `minContains` with `contains`; `dependencies` is the old name of
    # dependentRequired / dependentSchemas.
    assert UNENFORCED - measured == {"then", "else", "minContains", "dependencies"}


def test_what_xgrammar_enforces_passes_and_is_enforced():
    """The other side: keywords a pydantic model emits pass the check, and xgrammar enforces them."""
    class Pet(BaseModel):
        kind: Literal["cat", "dog"]
        age: int = Field(ge=0, le=30, multiple_of=2, description="years")

    class Owner(BaseModel):
        name: str = Field(pattern="^[A-Z][a-z]{0,7}$", title="Name")
        city: str = Field(min_length=1, max_length=8)
        pets: list[Pet] = Field(max_length=2)
        home: tuple[str, int]
        nickname: str | None = None
        scores: dict[str, int] = {}

    schema = Owner.model_json_schema()
    check_schema_keywords(schema)
    check_schema_keywords(json.dumps(schema))
    good = ('{"name": "Ann", "city": "Oslo", "pets": [{"kind": "cat", "age": 4}], "home": ["Oslo", 3], '
            '"nickname": null, "scores": {}}')
    assert xgrammar_accepts(schema, good)
    for bad in [good.replace('"age": 4', '"age": 5'), good.replace('"cat"', '"cow"'), good.replace("Ann", "ann"),
                good.replace('"Oslo", "pets"', '"Amsterdam", "pets"'), good.replace("Ann", "Annabella")]:
        assert not xgrammar_accepts(schema, bad), bad


@pytest.mark.parametrize("schema, says", [
    (wrap({"type": "string", "maxLenght": 3}), "unknown JSON-schema keyword 'maxLenght' at #/properties/a: fix its"),
    ({"type": "object", "requried": ["a"]}, "unknown JSON-schema keyword 'requried' at #:"),
    ({"$defs": {"P": {"type": "object", "propertys": {}}}, "$ref": "#/$defs/P"},
     "unknown JSON-schema keyword 'propertys' at #/$defs/P"),
    (json.dumps(wrap({"type": "array", "items": {"not": {"type": "string"}}})),
     "JSON-schema keyword 'not' at #/properties/a/items is not enforced by xgrammar: remove it"),
    (wrap({"anyOf": [{"multipleOf": 0.5}, {"type": "null"}]}),
     "'multipleOf' on type 'any' at #/properties/a/anyOf/0"),
])
def test_an_unknown_or_unenforced_keyword_is_one_line_and_nothing_is_queued(make_engine, schema, says):
    engine = make_engine(MODEL, TOKENIZER)
    with pytest.raises(ValueError) as err:
        engine.add_request("Answer:", SamplingParams(structured_outputs=StructuredOutputsParams(json=schema)))
    message = str(err.value)
    assert message.startswith("structured_outputs.json: ") and says in message and "\n" not in message
    assert not engine._scheduler.has_work()
    assert engine._pool.num_free == engine._pool.num_blocks   # nothing leaked
