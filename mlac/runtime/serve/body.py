"""Reading a request body as a JSON object, within limits a hostile client cannot stretch:

    size        at most `limit` bytes (413)
    time        the whole body within `timeout` seconds of the handler asking for it (408): a
                client that drips its body holds a connection no longer than that
    nesting     at most MAX_JSON_DEPTH levels of arrays and objects (400)
    text        every string valid Unicode: no lone surrogate such as "\\ud800" (400)

408 and 413 close the connection (`Connection: close`): the rest of the body is never read.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from mlac.runtime.serve.protocol import ApiError

MAX_JSON_DEPTH = 64
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # the only way JSON text can hold a surrogate


async def read_json(request, limit: int, timeout: float) -> dict[str, Any]:
    """The request body as a JSON object; ApiError (400, 408 or 413) past a limit above."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise _closing(413, f"request body of {length} bytes exceeds the limit of {limit}")
    try:
        raw = await asyncio.wait_for(_read(request, limit), timeout)
    except asyncio.TimeoutError:
        raise _closing(408, f"request body not received within {timeout:g} s") from None
    try:
        data = json.loads(raw)
    except RecursionError:
        raise ApiError(400, f"request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object")
    # the walk costs a Python step per value: skip it when the raw bytes show it cannot fail
    deep = raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH
    if deep or SURROGATE_ESCAPE.search(raw):
        check_tree(data, MAX_JSON_DEPTH)
    return data


async def _read(request, limit: int) -> bytes:
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise _closing(413, f"request body exceeds the limit of {limit} bytes")
    return bytes(body)


def _closing(status: int, message: str) -> ApiError:
    return ApiError(status, message, headers={"Connection": "close"})


def check_tree(data: dict | list, max_depth: int) -> None:
    """ApiError 400 if `data` nests deeper than `max_depth` or holds a string with a lone
    surrogate (JSON's "\\ud800" escape parses, but no tokenizer or encoder takes it)."""
    stack: list[tuple[dict | list, int]] = [(data, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > max_depth:
            raise ApiError(400, f"request body nests deeper than {max_depth} levels")
        for item in (*node.keys(), *node.values()) if isinstance(node, dict) else node:
            if isinstance(item, str):
                _check_text(item)
            elif isinstance(item, (dict, list)):
                stack.append((item, depth + 1))


def _check_text(s: str) -> None:
    if s.isascii():
        return
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = s[e.start]
        raise ApiError(400, f"request body holds a lone surrogate \\u{ord(bad):04x} in a string") from None
