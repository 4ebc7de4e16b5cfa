"""synthesize(): a Hugging Face DeepSeek checkpoint directory with real structure, random weights.

Output: config.json, model.safetensors (or model-0000i-of-0000N.safetensors shards plus
model.safetensors.index.json), tokenizer.json, tokenizer_config.json, generation_config.json.
Same inputs and seed give byte-identical files. The directory is built under a hidden temporary
sibling and renamed into place at the end, so an interrupted run leaves nothing that looks valid.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from mlac.core.config import ModelConfig
from mlac.core.errors import MlacError
from mlac.synth.presets import PRESETS
from mlac.synth.safetensors_writer import Progress, plan_shards, write_shard
from mlac.synth.tokenizer import MIN_VOCAB, write_tokenizer
from mlac.synth.weights import Param, checkpoint_params

DEFAULT_MAX_SHARD_BYTES = 1 << 30  # shard above 1 GiB of weights
WORKERS = max(1, min(4, os.cpu_count() or 1))  # torch.randn is single-threaded: draw in parallel
INDEX = "model.safetensors.index.json"


def synthesize(
    out_dir: str | os.PathLike,
    preset: str | None = None,
    config_path: str | os.PathLike | None = None,
    seed: int = 0,
    num_layers: int | None = None,
    progress: Progress | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write a random-weight checkpoint of `preset` (a PRESETS name) or of `config_path`.

    num_layers, if given, replaces num_hidden_layers (MTP layers follow the new last layer).
    progress, if given, is called with the number of weight bytes just written (the calls sum
    to weight_bytes(...) for the same arguments). Returns the checkpoint directory. Raises
    MlacError for bad input: both or neither of preset/config_path, an unknown preset, an
    unreadable or unsupported config, an out_dir that exists and is not an empty directory.
    """
    raw = resolve_config(preset, config_path, num_layers)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise MlacError(f"seed must be an integer (got {seed!r})")
    if max_shard_bytes < 1:
        raise MlacError(f"max_shard_bytes must be positive (got {max_shard_bytes})")
    out = Path(out_dir)
    _check_out_dir(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        ids = write_tokenizer(tmp, raw["vocab_size"], raw.get("max_position_embeddings") or 4096)
        raw.update(ids)
        cfg = _parse(raw, "config")
        (tmp / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
        _write_weights(tmp, checkpoint_params(cfg), seed, max_shard_bytes, progress)
        tmp.chmod(0o755)  # mkdtemp made it 0700
        if out.exists():
            out.rmdir()  # checked empty above
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def weight_bytes(
    preset: str | None = None, config_path: str | os.PathLike | None = None, num_layers: int | None = None
) -> int:
    """Total bytes of weights synthesize() would write (the sum of its progress calls)."""
    raw = resolve_config(preset, config_path, num_layers)
    return sum(p.nbytes for p in checkpoint_params(_parse(raw, "config")))


def resolve_config(
    preset: str | None, config_path: str | os.PathLike | None, num_layers: int | None
) -> dict[str, Any]:
    """The config.json dict to write: the preset or file, with num_layers applied and validated."""
    if (preset is None) == (config_path is None):
        raise MlacError("give exactly one of a preset or a config path")
    if preset is not None:
        if preset not in PRESETS:
            raise MlacError(f"unknown preset {preset!r}; valid presets: {', '.join(PRESETS)}")
        raw, source = copy.deepcopy(PRESETS[preset]), f"preset {preset}"
    else:
        raw, source = _read_config(Path(config_path))  # type: ignore[arg-type]
    if num_layers is not None:
        _set_num_layers(raw, num_layers)
    _parse(raw, source)
    return raw


def _read_config(path: Path) -> tuple[dict[str, Any], str]:
    if path.is_dir():
        path = path / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise MlacError(f"{path}: config file not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise MlacError(f"{path}: cannot read config ({e})") from None
    except json.JSONDecodeError as e:
        raise MlacError(f"{path}: invalid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise MlacError(f"{path}: expected a JSON object")
    return raw, str(path)


def _set_num_layers(raw: dict[str, Any], num_layers: int) -> None:
    """Cut the model to num_layers, keeping at least one MoE layer when it has experts.

    first_k_dense_replace shrinks only as far as needed, and stays >= 1 where it was and
    num_layers >= 2, so a cut V2/V3 keeps its dense-then-MoE shape.
    """
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise MlacError(f"num_layers must be a positive integer (got {num_layers!r})")
    raw["num_hidden_layers"] = num_layers
    if raw.get("n_routed_experts") is None:
        return
    freq = raw.get("moe_layer_freq", 1) or 1
    k = raw.get("first_k_dense_replace", 0)
    while k > 0 and not any(i >= k and i % freq == 0 for i in range(num_layers)):
        k -= 1
    raw["first_k_dense_replace"] = k


def _parse(raw: dict[str, Any], source: str) -> ModelConfig:
    vocab = raw.get("vocab_size")
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < MIN_VOCAB:
        raise MlacError(f"{source}: vocab_size must be an integer >= {MIN_VOCAB} (got {vocab!r})")
    return ModelConfig.from_hf(raw, source=source)


def _check_out_dir(out: Path) -> None:
    if out.is_dir():
        if any(out.iterdir()):
            raise MlacError(f"{out}: output directory exists and is not empty; remove it or pick another")
    elif out.exists():
        raise MlacError(f"{out}: exists and is not a directory")


def _write_weights(
    out: Path, params: list[Param], seed: int, max_shard_bytes: int, progress: Progress | None
) -> None:
    total = sum(p.nbytes for p in params)
    shards = plan_shards(params, max_shard_bytes) if total > max_shard_bytes else [params]
    n = len(shards)
    names = (
        [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)] if n > 1 else ["model.safetensors"]
    )
    with ThreadPoolExecutor(WORKERS, thread_name_prefix="mlac-synth") as pool:
        for name, shard in zip(names, shards, strict=True):
            write_shard(out / name, shard, seed, pool, 2 * WORKERS, progress)
    if n > 1:
        weight_map = {
            t: f for f, shard in zip(names, shards, strict=True) for p in shard for t, _, _ in p.stored()
        }
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
