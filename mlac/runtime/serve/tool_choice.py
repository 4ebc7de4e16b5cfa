"""A chat request's `tools` and `tool_choice`, resolved once: whether the answer is parsed for tool
calls (tools.py), and for `required` or a named function, the Lark grammar (llguidance syntax) that
forces DeepSeek's tool-call block, in the server's format (V3's, or V3.1's with
--tool-call-parser deepseek_v31).

    tool_choice    tools offered      output parsed    output forced
    none           yes (vLLM's way)   no               no
    auto           yes                yes              no      needs --enable-auto-tool-choice
    required       yes                yes              one or more calls of the tools
    {function}     yes                yes              one call of that function
    left out       auto when the server has --enable-auto-tool-choice, else none

Forcing is constrained decoding (mlac.runtime.engine.constrain): the request's grammar is the Lark text
of `tool_choice_grammar`, and response_format cannot be given with it. The arguments follow each
function's parameters schema in the one JSON layout of response_format's schemas (constrain.JSON_OPTIONS:
no free whitespace), unless the schema asks for another with its own "x-guidance".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from mlac.runtime.engine.constrain import JSON_OPTIONS
from mlac.runtime.serve.guided import lark_string
from mlac.runtime.serve.protocol import ApiError
from mlac.runtime.serve.tools import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP, V3, ToolFormat


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools mean for its answer: parse it for calls; force it with `grammar` (Lark)."""

    parse: bool = False
    grammar: str | None = None


def _names(tools: list[dict[str, Any]]) -> list[str]:
    """The function names of `tools`; 400 for a tool that is not {"type": "function", "function": {"name"}}."""
    names = []
    for k, tool in enumerate(tools):
        function = tool.get("function")
        if tool.get("type") != "function" or not isinstance(function, dict):
            raise ApiError(
                400, f'tools.{k}: must be {{"type": "function", "function": {{...}}}}', param="tools"
            )
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise ApiError(400, f"tools.{k}.function.name: must be a non-empty string", param="tools")
        names.append(function["name"])
    return names


def _named(tool_choice: dict[str, Any], names: list[str]) -> str:
    """The function a named tool_choice asks for; 400 when it is not one of the tools."""
    function = tool_choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if tool_choice.get("type") != "function" or not isinstance(name, str):
        raise ApiError(400, 'tool_choice: must be "none", "auto", "required" or '
                       '{"type": "function", "function": {"name": ...}}', param="tool_choice")  # fmt: skip
    if name not in names:
        raise ApiError(400, f"tool_choice: function {name!r} is not one of the tools", param="tool_choice")
    return name


def plan_tools(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None,
               auto_enabled: bool, parallel: bool = True, fmt: ToolFormat = V3) -> ToolPlan:  # fmt: skip
    """The ToolPlan of a request (see the module's table); 400 for a choice it cannot have.
    `auto_enabled`: the server runs with --enable-auto-tool-choice (and a tool-call parser);
    `fmt`: the tool-call format a forced answer is written in."""
    names = _names(tools or [])
    if tool_choice is None:
        tool_choice = "auto" if names and auto_enabled else "none"
    if tool_choice == "none":
        return ToolPlan()
    if not names:
        raise ApiError(400, f"tool_choice: {json.dumps(tool_choice)} needs tools", param="tool_choice")
    if tool_choice == "auto":
        if not auto_enabled:
            raise ApiError(400, '"auto" tool choice needs the server started with --enable-auto-tool-choice '
                           "and --tool-call-parser", param="tool_choice")  # fmt: skip
        return ToolPlan(parse=True)
    if tool_choice == "required":
        return ToolPlan(parse=True, grammar=tool_choice_grammar(tools or [], "required", parallel, fmt))
    if isinstance(tool_choice, dict):
        _named(tool_choice, names)
        return ToolPlan(parse=True, grammar=tool_choice_grammar(tools or [], tool_choice, parallel, fmt))
    raise ApiError(400, f"tool_choice: {json.dumps(tool_choice)} is not one of none, auto, required or "
                   "a function", param="tool_choice")  # fmt: skip


def _schema(tool: dict[str, Any]) -> str:
    """A tool's parameters schema as JSON (an object of any fields when it gives none), in
    response_format's JSON layout unless it names its own ("x-guidance")."""
    params = tool["function"].get("parameters")
    schema = params if isinstance(params, dict) and params else {"type": "object"}
    return json.dumps({"x-guidance": JSON_OPTIONS, **schema}, sort_keys=True)


def tool_choice_grammar(tools: list[dict[str, Any]], tool_choice: str | dict[str, Any],
                        parallel: bool = True, fmt: ToolFormat = V3) -> str:  # fmt: skip
    """Lark text (llguidance: `<token>` is a special token, `%json {...}` a JSON schema) that forces
    DeepSeek's tool-call block in `fmt`: for "required", one call (or several, `parallel`) of any of
    `tools`; for {"type": "function", "function": {"name"}}, one call of that function. Each call's
    arguments follow its function's parameters schema."""
    names = _names(tools)
    chosen = range(len(tools))
    if isinstance(tool_choice, dict):
        chosen = [names.index(_named(tool_choice, names))]
        parallel = False
    between = '"\\n"? ' if fmt.typed else ""  # V3 may put a newline between two calls
    lines = [f"start: {CALLS_BEGIN} calls {CALLS_END}",
             f"calls: call ({between}call)*" if parallel else "calls: call",
             "call: " + " | ".join(f"call_{k}" for k in chosen)]  # fmt: skip
    for k in chosen:
        if fmt.typed:  # V3: function<sep>NAME, the arguments in a json fence
            head = lark_string(f"{names[k]}\n```json\n")
            lines.append(f'call_{k}: {CALL_BEGIN} "function" {SEP} {head} args_{k} "\\n```" {CALL_END}')
        else:  # V3.1: NAME<sep>, the arguments
            lines.append(f"call_{k}: {CALL_BEGIN} {lark_string(names[k])} {SEP} args_{k} {CALL_END}")
        lines.append(f"args_{k}: %json {_schema(tools[k])}")
    return "\n".join(lines) + "\n"
