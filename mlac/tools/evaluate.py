"""`mlac eval`: the perplexity of an artifact over a text file, through the runtime that serves it.

The text is encoded with the artifact's tokenizer (bos prepended) and scored by
`mlac.runtime.engine.perplexity.perplexity` (windows, stride: that module's docstring).

    perplexity = exp(sum of NLL / scored tokens)        bits per byte = sum of NLL / ln 2 / bytes
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

import torch

from mlac.core.errors import MlacError
from mlac.runtime.engine.engine import Engine
from mlac.runtime.engine.perplexity import EvalResult


def read_text(path: Path) -> str:
    """The UTF-8 text of `path`; a missing, unreadable, non-UTF-8 or empty file is an MlacError."""
    if not path.is_file():
        raise MlacError(f"{path}: no such file")
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as e:
        raise MlacError(f"{path}: cannot read ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise MlacError(f"{path}: not UTF-8 text (byte {e.start})") from None
    if not text.strip():
        raise MlacError(f"{path}: the text is empty")
    return text


def encode_text(engine: Engine, text: str, max_tokens: int | None = None) -> tuple[list[int], int]:
    """(token ids with bos, UTF-8 bytes they cover): the first `max_tokens` ids when given, and then
    the bytes of their decoded text, else the bytes of the whole text."""
    if engine.tokenizer is None:
        raise MlacError("this artifact has no tokenizer: it cannot encode a text")
    ids = engine.tokenizer.encode(text)
    if max_tokens is None or max_tokens >= len(ids):
        return ids, len(text.encode("utf-8"))
    ids = ids[:max_tokens]
    return ids, len(engine.tokenizer.decode(ids).encode("utf-8"))


def bits_per_byte(result: EvalResult, n_bytes: int) -> float:
    """The scored tokens' NLL in bits over the bytes of the text they came from."""
    return result.nll / math.log(2) / n_bytes


def summary(result: EvalResult, n_bytes: int) -> str:
    return (
        f"perplexity {result.perplexity:.4f} over {result.tokens:,} tokens "
        f"({bits_per_byte(result, n_bytes):.4f} bits/byte), {result.windows} window(s) of "
        f"{result.context_len} tokens, stride {result.stride}; {result.seconds:.2f} s, "
        f"{result.tokens_per_s:,.0f} tok/s"
    )


def to_json(engine: Engine, identity: str, text: Path, n_bytes: int, result: EvalResult, dtype: str) -> str:
    """The JSON record of one evaluation: the artifact's identity, device, dtype, the numbers."""
    device = engine.device
    record = {
        "artifact_identity": identity,
        "text": str(text),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": dtype,
        "torch": torch.__version__,
        "model": engine.config.model_type,
        "quantization": engine.manifest.quantization.scheme if engine.manifest else None,
        "bytes": n_bytes,
        "bits_per_byte": bits_per_byte(result, n_bytes),
        **asdict(result),
    }
    return json.dumps(record, indent=2)
