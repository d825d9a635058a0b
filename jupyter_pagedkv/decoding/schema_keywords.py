"""Refuse a JSON schema whose keywords the output would not obey.

xgrammar compiles a schema with a keyword it does not know (a typo such as `maxLenght`) or does
not enforce (`uniqueItems`, `not`, ...) without a word, and the model's output may then break it.
So before compiling, every keyword of every subschema is checked: an unknown one, or one that
xgrammar 0.2.9 ignores (measured: a violating value was accepted by its matcher; the list is
`UNENFORCED`), is one ValueError line that names it and where it is. Annotations (`title`,
`description`, `default`, ...) constrain nothing and pass.
"""
from __future__ import annotations

import json
from typing import Any

# Keywords whose value is a schema, a list of schemas, or a map from names to schemas.
SCHEMA_VALUED = {"items", "additionalProperties", "additionalItems", "unevaluatedItems",
                 "unevaluatedProperties", "propertyNames", "contains", "not", "if", "then", "else"}
SCHEMA_LISTS = {"prefixItems", "anyOf", "oneOf", "allOf"}
SCHEMA_MAPS = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
# Keywords whose value is data (or a reference), not a schema.
VALUE_KEYWORDS = {"type", "enum", "const", "required", "minLength", "maxLength", "pattern", "format",
                  "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
                  "minItems", "maxItems", "uniqueItems", "minContains", "maxContains",
                  "minProperties", "maxProperties", "dependentRequired", "dependencies", "$ref",
                  "nullable", "discriminator"}
ANNOTATIONS = {"title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
               "writeOnly", "$schema", "$id", "$anchor", "$dynamicAnchor", "$vocabulary",
               "contentEncoding", "contentMediaType", "contentSchema"}
KNOWN = SCHEMA_VALUED | SCHEMA_LISTS | SCHEMA_MAPS | VALUE_KEYWORDS | ANNOTATIONS
# Known keywords xgrammar 0.2.9 compiles but does not enforce (its matcher accepts a violation).
UNENFORCED = {"uniqueItems", "contains", "minContains", "maxContains", "dependentRequired",
              "dependentSchemas", "dependencies", "not", "if", "then", "else"}


def check_schema_keywords(schema: dict | str) -> None:
    """A one-line ValueError for the first keyword the output would not obey; nothing otherwise.
    A string that is not JSON is left to xgrammar (which refuses it in its own words)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            return
    _walk(schema, "#")


def _walk(node: Any, where: str) -> None:
    if not isinstance(node, dict):   # true / false schemas
        return
    for key, value in node.items():
        at = f"{where}/{key}"
        if key not in KNOWN:
            raise ValueError(f"unknown JSON-schema keyword {key!r} at {where}: fix its spelling or remove it "
                             f"(it would be ignored, and the output could break what it meant)")
        form = _unenforced_form(node, key, value)
        if key in UNENFORCED or form:
            raise ValueError(f"JSON-schema keyword {key!r}{form} at {where} is not enforced by xgrammar: remove "
                             f"it (the output could break it) or check it after generation")
        if key in SCHEMA_VALUED:
            _walk(value, at)
        elif key in SCHEMA_LISTS and isinstance(value, list):
            for i, sub in enumerate(value):
                _walk(sub, f"{at}/{i}")
        elif key in SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                _walk(sub, f"{at}/{name}")


def _unenforced_form(node: dict, key: str, value: Any) -> str:
    """The form of a keyword xgrammar enforces only in some forms ("" where it does):
    `multipleOf` on integers only, `allOf` with one subschema only, a string's length bounds only
    without a `pattern` (beside one, xgrammar drops them)."""
    if key == "multipleOf" and node.get("type") != "integer":
        return f" on type {node.get('type', 'any')!r}"
    if key in ("minLength", "maxLength") and "pattern" in node:
        return " beside 'pattern' (put the length in the pattern)"
    if key == "allOf" and isinstance(value, list) and len(value) > 1:
        return f" with {len(value)} subschemas"
    return ""
