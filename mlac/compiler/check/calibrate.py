"""Calibrated FP8 KV-cache scales: one static scale per layer, measured at compile time.

    scales, record = calibrate_kv_scales(cfg, tensors, tokenizer, text, "fp8_e4m3")

The compiled model (the artifact's own weights, 1 rank, float32 on CPU, an unquantized KV cache)
scores the calibration text in windows of WINDOW tokens, each window its own sequence from
position 0 (the first one starts with bos). After each window the cache pools are read back: per
layer, amax_l = max |value| over every entry [latent ‖ roped key] written so far (the pools start
at zero, so unwritten slots never raise it). Then

    scale_l = amax_l / finfo(fp8 dtype).max        (value = stored * scale, paged.PagedKVCache)

so that the largest calibrated value maps to the format's largest finite value (448 for e4m3,
57344 for e5m2). No margin: FP8 is floating point, so headroom buys no precision at the top and
pushes small values into the subnormals; a value beyond amax at serve time is clamped to ±max by
PagedKVCache.write (saturation, never NaN). A layer whose entries are all zero keeps 1.0.

Like accuracy.py, this module sits above the runtime and beside the compiler: the compiler hands
it the tensors, so it imports nothing from `mlac.compiler`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import torch

from mlac.core.artifact import KVCalibration
from mlac.core.config import ModelConfig
from mlac.core.errors import MlacError

WINDOW = 256  # tokens scored as one sequence (capped by max_position_embeddings)
MAX_TOKENS = 8192  # the text's first tokens that are used: a bounded compile-time cost
BLOCK_SIZE = 16
FP8_KV_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def read_text(path: str | Path) -> str:
    """The calibration text of `path`: an MlacError if it is missing, unreadable or blank."""
    p = Path(path)
    if not p.is_file():
        raise MlacError(f"--calibration-text {path}: file not found")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise MlacError(f"--calibration-text {path}: cannot read it as UTF-8 text ({e})") from None
    if not text.strip():
        raise MlacError(f"--calibration-text {path}: the file is empty")
    return text


def check_inputs(text_path: str | Path, tokenizer_dir: Path) -> None:
    """Before any heavy work: the text is readable and not blank, and the checkpoint has a tokenizer."""
    read_text(text_path)
    if not (tokenizer_dir / "tokenizer.json").is_file():
        raise MlacError(f"{tokenizer_dir}: no tokenizer.json to tokenize the calibration text with")


def text_tokens(tokenizer_dir: Path, text_path: str | Path) -> list[int]:
    """The calibration tokens: the first MAX_TOKENS ids of the text of `text_path` encoded by the
    checkpoint's tokenizer (`tokenizer_dir`, bos prepended); MlacError if the text has none."""
    from mlac.runtime.engine.tokenizer import Tokenizer  # here: a compile without calibration never loads it

    check_inputs(text_path, tokenizer_dir)
    ids = Tokenizer(tokenizer_dir).encode(read_text(text_path))
    if not ids:
        raise MlacError(f"--calibration-text {text_path}: the text has no tokens")
    return ids[:MAX_TOKENS]


def windows(ids: list[int], window: int) -> list[list[int]]:
    """Consecutive windows of at most `window` tokens over the first MAX_TOKENS of `ids`."""
    ids = ids[:MAX_TOKENS]
    return [ids[s : s + window] for s in range(0, len(ids), window)]


def measure_amax(
    config: ModelConfig, tensors: dict[str, torch.Tensor], chunks: list[list[int]]
) -> list[float]:
    """Per layer, max |value| of the KV-cache entries the model writes while scoring `chunks`
    (float32, CPU, unquantized cache). `tensors`: one rank's compiled tensors of a 1-rank model."""
    from mlac.runtime.engine.engine import Engine  # here: a compile without calibration never loads it

    blocks = -(-max(len(c) for c in chunks) // BLOCK_SIZE)
    engine = Engine.from_tensors(
        config, tensors, dtype=torch.float32, num_blocks=blocks, block_size=BLOCK_SIZE
    )
    amax = torch.zeros(config.num_hidden_layers, dtype=torch.float64)
    for chunk in chunks:
        engine.score(chunk)
        written = torch.stack([pool.abs().amax().double() for pool in engine.cache.layers])  # [L]
        amax = torch.maximum(amax, written)
    return amax.tolist()


def scales_of(amax: list[float], kv_dtype: str) -> list[float]:
    """scale_l = amax_l / finfo(kv_dtype).max; 1.0 where amax_l is 0 (or not finite)."""
    fmax = torch.finfo(FP8_KV_DTYPES[kv_dtype]).max
    return [a / fmax if 0 < a < float("inf") else 1.0 for a in amax]


def calibrate_kv_scales(
    config: ModelConfig,
    tensors: dict[str, torch.Tensor],
    tokenizer_dir: Path,
    text_path: str | Path,
    kv_dtype: str,
    log: Callable[[str], None] = lambda msg: None,
) -> tuple[list[float], KVCalibration]:
    """Per-layer scales of an FP8 KV cache of `kv_dtype` ("fp8_e4m3" / "fp8_e5m2") for the model
    of `tensors` (1 rank), from the text of `text_path` tokenized by the checkpoint's tokenizer
    (`tokenizer_dir`, bos prepended); and the record of what they were measured on (the manifest's)."""
    if kv_dtype not in FP8_KV_DTYPES:
        raise MlacError(f"KV calibration needs an FP8 KV cache dtype, not {kv_dtype!r}")
    ids = text_tokens(tokenizer_dir, text_path)
    window = min(WINDOW, config.max_position_embeddings)
    chunks = windows(ids, window)
    used = sum(len(c) for c in chunks)
    log(f"kv calibration: {used} tokens in {len(chunks)} window(s) of <= {window}, float32 on CPU")
    amax = measure_amax(config, tensors, chunks)
    scales = scales_of(amax, kv_dtype)
    log(f"kv calibration: {kv_dtype} scales {min(scales):.3e} .. {max(scales):.3e} over {len(scales)} layers")
    digest = hashlib.sha256(Path(text_path).read_bytes()).hexdigest()
    return scales, KVCalibration(text_sha256=digest, tokens=used, window=window, amax=amax)
