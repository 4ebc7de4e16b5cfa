"""JSON from a user's file, parsed with a one-line error for anything malformed."""

from __future__ import annotations

import json
from typing import Any

from mlac.core.errors import MlacError


def load_json(text: str | bytes, source: str, kind: type | None = dict, object_pairs_hook=None) -> Any:
    """Parse `text` (from `source`, a path or name used in the message) as JSON.

    Refuses, as an MlacError naming `source`: invalid JSON, invalid UTF-8, nesting too deep for the
    parser (a RecursionError), and a top-level value that is not a `kind` (None: any value). `object_pairs_hook` is json.loads's; an
    MlacError it raises goes through.
    """
    try:
        value = json.loads(text, object_pairs_hook=object_pairs_hook)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MlacError(f"{source}: invalid JSON ({e})") from None
    except RecursionError:
        raise MlacError(f"{source}: invalid JSON (nested too deeply)") from None
    if kind is not None and not isinstance(value, kind):
        raise MlacError(f"{source}: expected a JSON {_KIND_NAMES.get(kind, kind.__name__)}")
    return value


_KIND_NAMES = {dict: "object", list: "array", str: "string"}
