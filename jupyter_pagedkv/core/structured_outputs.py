"""What a request asks its output to match: a JSON schema, a regex, an EBNF grammar or a choice
(vLLM's `StructuredOutputsParams` names). Exactly one kind per request.

Only the request's own shape is checked here (one kind, the right types, a non-empty choice);
whether xgrammar can compile it (an unsupported schema type, an invalid regex or grammar) is
checked when the request is added, with the engine's tokenizer (`decoding/grammar.py`)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "regex", "grammar", "choice")


def is_model_class(value: Any) -> bool:
    """A pydantic model class (not an instance): its JSON schema is the spec."""
    return isinstance(value, type) and callable(getattr(value, "model_json_schema", None))


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One of: `json` (a JSON-schema dict or string, or a pydantic model class), `regex`,
    `grammar` (xgrammar's EBNF, with a `root` rule) or `choice` (a list of strings)."""

    json: dict | str | type | None = None
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """One kind, of the right type; a one-line ValueError that says what to pass otherwise."""
        given = [k for k in KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"structured_outputs takes exactly one of json, regex, grammar or choice, got "
                             f"{', '.join(given) if given else 'none'}: pass one")
        j, c = self.json, self.choice
        if j is not None and not (isinstance(j, dict) or (isinstance(j, str) and j.strip()) or is_model_class(j)):
            raise ValueError(f"structured_outputs.json must be a JSON-schema dict or string, or a pydantic "
                             f"model class, got {type(j).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r:.40}")
        if c is not None and not (isinstance(c, (list, tuple)) and c and all(isinstance(s, str) and s for s in c)):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, "
                             f"got {c!r:.60}")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) is not None)

    def schema(self) -> dict | str | None:
        """The JSON schema as a dict (a model class's own schema) or the string given."""
        return self.json.model_json_schema() if is_model_class(self.json) else self.json

    def key(self) -> tuple[str, str]:
        """What identifies the compiled grammar: (kind, canonical text). Two requests with equal
        keys share one compilation."""
        kind = self.kind
        if kind == "json":
            schema = self.schema()
            return kind, schema if isinstance(schema, str) else json.dumps(schema, sort_keys=True)
        if kind == "choice":
            return kind, json.dumps(list(self.choice))
        return kind, getattr(self, kind)
