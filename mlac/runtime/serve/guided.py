"""A request's structured-output fields, resolved to one grammar (runtime/engine/constrain.py):
OpenAI's `response_format`, vLLM's `guided_json`, `guided_regex`, `guided_choice`,
`guided_grammar`, and vLLM's newer `structured_outputs` object holding one of `json`, `regex`,
`choice`, `grammar`. At most one of them may constrain a request (a 400 names the second).

    field                                          the output is
    response_format {"type": "json_object"}        one JSON object
    response_format json_schema, guided_json,      one JSON value valid under the schema
      structured_outputs.json
    guided_regex, structured_outputs.regex         a whole match of the regular expression
    guided_choice, structured_outputs.choice       exactly one of the strings
    guided_grammar, structured_outputs.grammar     a sentence of the Lark grammar (llguidance's syntax)
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from mlac.runtime.engine.params import GrammarSpec


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: one of its fields."""

    model_config = ConfigDict(extra="ignore", strict=True)

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(default=None, min_length=1)
    grammar: str | None = None


class GuidedError(ValueError):
    """A request whose structured-output fields contradict each other; `param` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def lark_string(text: str) -> str:
    """`text` as a Lark (llguidance) string literal."""
    return json.dumps(text, ensure_ascii=False)


def choice_grammar(choices: list[str]) -> str:
    """Lark text whose sentences are exactly `choices`."""
    return "start: " + " | ".join(lark_string(c) for c in choices) + "\n"


def _json_spec(schema: dict[str, Any] | str) -> GrammarSpec:
    return GrammarSpec("json_schema", schema if isinstance(schema, str) else json.dumps(schema))


def _specs(body) -> list[tuple[str, GrammarSpec]]:
    """(field, grammar) of every structured-output field `body` sets, in the module table's order."""
    out: list[tuple[str, GrammarSpec]] = []
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        out.append(("response_format", GrammarSpec("json_object", "")))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise GuidedError(
                "response_format: type json_schema needs a json_schema object", "response_format"
            )
        out.append(("response_format", _json_spec(fmt.json_schema.schema_)))
    if body.guided_json is not None:
        out.append(("guided_json", _json_spec(body.guided_json)))
    if body.guided_regex is not None:
        out.append(("guided_regex", GrammarSpec("regex", body.guided_regex)))
    if body.guided_choice is not None:
        out.append(("guided_choice", GrammarSpec("lark", choice_grammar(body.guided_choice))))
    if body.guided_grammar is not None:
        out.append(("guided_grammar", GrammarSpec("lark", body.guided_grammar)))
    so = body.structured_outputs
    if so is not None:
        given = [(k, v) for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                     ("grammar", so.grammar)) if v is not None]  # fmt: skip
        if len(given) != 1:
            raise GuidedError("structured_outputs: give exactly one of json, regex, choice, grammar",
                              "structured_outputs")  # fmt: skip
        kind, value = given[0]
        spec = {"json": _json_spec, "regex": lambda v: GrammarSpec("regex", v),
                "choice": lambda v: GrammarSpec("lark", choice_grammar(v)),
                "grammar": lambda v: GrammarSpec("lark", v)}[kind](value)  # fmt: skip
        out.append(("structured_outputs", spec))
    return out


def grammar_of(body) -> tuple[str, GrammarSpec] | None:
    """(the field, its grammar) of the one structured-output field `body` sets; None: free text.
    GuidedError when two are set, or one is incomplete."""
    specs = _specs(body)
    if len(specs) > 1:
        (first, _), (second, _) = specs[:2]
        raise GuidedError(f"give one of {first} and {second}, not both", second)
    return specs[0] if specs else None
