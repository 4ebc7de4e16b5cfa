"""Reading a request body into its pydantic model, within limits a hostile client cannot stretch:

    size        at most `limit` bytes (413)
    time        the whole body within `timeout` seconds of the handler asking for it (408): a
                client that drips its body holds a connection no longer than that
    cost        at most MAX_JSON_CONTAINERS arrays and objects and MAX_JSON_ITEMS items (400),
                counted in the raw bytes before anything is parsed: a `[`, `{` or `,` inside a
                string counts too (the limits are far above what a request within the context holds)
    nesting     at most MAX_JSON_DEPTH levels of arrays and objects (400)
    text        UTF-8, UTF-16 or UTF-32 (as json.loads detects it), strictly decoded, and no string
                holding a lone surrogate, encoded or escaped as "\\ud800" (400)

408 and 413 close the connection (`Connection: close`): the rest of the body is never read.

Other clients wait while a body is parsed: json.loads and pydantic hold the GIL for the whole of
their C call, wherever they run. The cost limits bound that hold: 3.9 MB of 1.3 million empty
arrays held it 0.75 s in json.loads and 0.9 s in pydantic (and walking it took 0.75 s more); within
the limits json.loads takes at most about 30 ms (16,384 objects of 16 members), 16 ms for a prompt
of MAX_JSON_ITEMS token ids. A body over INLINE_BODY_BYTES is counted, decoded, parsed and
validated in a worker thread, so that the event loop serves other clients between those steps.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from mlac.runtime.serve.protocol import ApiError, parse_body

MAX_JSON_DEPTH = 64
MAX_JSON_CONTAINERS = 16_384  # `[` and `{`: 2,048 messages of 2 content parts hold 8,192
MAX_JSON_ITEMS = 262_144  # `,`: a prompt of token ids as long as DeepSeek's context (163,840) fits
INLINE_BODY_BYTES = 16_384  # parsed on the event loop (well under 1 ms); larger: in a worker thread
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # how JSON text holds a lone surrogate


async def read_body(request, model: type, limit: int, timeout: float) -> Any:
    """The request body as `model` (a pydantic model of protocol.py): ApiError (400, 408 or 413)
    past a limit above, or where protocol.parse_body refuses it."""
    raw = await read_bytes(request, limit, timeout)
    if len(raw) <= INLINE_BODY_BYTES:
        return parse_body(model, parse_json(raw))
    return await asyncio.to_thread(lambda: parse_body(model, parse_json(raw)))


async def read_bytes(request, limit: int, timeout: float) -> bytes:
    """The raw body: 413 past `limit` bytes (announced or received), 408 past `timeout` seconds."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise _closing(413, f"request body of {length} bytes exceeds the limit of {limit}")
    try:
        return await asyncio.wait_for(_read(request, limit), timeout)
    except asyncio.TimeoutError:
        raise _closing(408, f"request body not received within {timeout:g} s") from None


async def _read(request, limit: int) -> bytes:
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise _closing(413, f"request body exceeds the limit of {limit} bytes")
    return bytes(body)


def _closing(status: int, message: str) -> ApiError:
    return ApiError(status, message, headers={"Connection": "close"})


def parse_json(raw: bytes) -> dict[str, Any]:
    """`raw` as a JSON object, within the cost, text and nesting limits (ApiError 400)."""
    containers = check_cost(raw)
    text = decode(raw)
    try:
        data = json.loads(text)
    except RecursionError:
        raise ApiError(400, f"request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as e:
        raise ApiError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object")
    # the walk costs a Python step per value: skip it when the text shows it cannot fail
    if containers > MAX_JSON_DEPTH or SURROGATE_ESCAPE.search(text):
        check_tree(data, MAX_JSON_DEPTH)
    return data


def check_cost(raw: bytes) -> int:
    """ApiError 400 when the raw bytes hold more `[` and `{` than MAX_JSON_CONTAINERS or more `,`
    than MAX_JSON_ITEMS (what parsing costs: a Python object per value). Returns the `[` and `{`.
    Each count is one pass of memchr speed (about 1 ms over 4 MB)."""
    containers = raw.count(b"[") + raw.count(b"{")
    if containers > MAX_JSON_CONTAINERS:
        raise ApiError(400, f"request body holds {containers} '[' and '{{' (arrays and objects); at most "
                       f"{MAX_JSON_CONTAINERS} are allowed")  # fmt: skip
    items = raw.count(b",")
    if items > MAX_JSON_ITEMS:
        raise ApiError(400, f"request body holds {items} ',' (items of arrays and objects); at most "
                       f"{MAX_JSON_ITEMS} are allowed")  # fmt: skip
    return containers


def decode(raw: bytes) -> str:
    """The body's text, in the encoding json.loads would detect (UTF-8, a BOM's, or UTF-16/32 by
    its zero bytes), decoded strictly: a lone surrogate, which json.loads lets through from any
    encoding, or a malformed byte is a 400."""
    encoding = json.detect_encoding(raw)
    try:
        return raw.decode(encoding)
    except UnicodeDecodeError as e:
        name = encoding.upper().removesuffix("-SIG")
        raise ApiError(400, f"request body is not valid {name}: {e.reason} at byte {e.start}") from None


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
