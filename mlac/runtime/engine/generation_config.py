"""The default sampling of requests that do not say: the checkpoint's generation_config.json, or mlac's.

`--generation-config` takes vLLM's values: `auto` reads the artifact's tokenizer/generation_config.json
(DeepSeek ships temperature 0.6, top_p 0.95), `vllm` (and its alias `none`) uses mlac's own defaults,
and any other value is a folder holding a generation_config.json. Only the sampling fields are read
(temperature, top_p, top_k, min_p), as vLLM does; a field the file does not set keeps mlac's default.
A value that SamplingParams refuses (temperature -1, top_p 0) is refused with the file's name when
read: at start, not as a 400 to every request that leaves the field out.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path

from mlac.core.artifact import TOKENIZER_DIR
from mlac.core.errors import MlacError
from mlac.core.jsonio import load_json
from mlac.runtime.engine.params import InvalidSamplingParams, SamplingParams

GENERATION_CONFIG = "generation_config.json"
OWN_DEFAULTS = ("vllm", "none")


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request that leaves a field out samples with (mlac's own: plain sampling, no filter)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0


def sampling_defaults(artifact: str | Path, mode: str = "auto") -> SamplingDefaults:
    """The defaults `mode` (auto | vllm | none | a folder) names for the artifact at `artifact`.
    auto without a generation_config.json: mlac's. A folder without one: MlacError."""
    if mode in OWN_DEFAULTS:
        return SamplingDefaults()
    if mode == "auto":
        file = Path(artifact) / TOKENIZER_DIR / GENERATION_CONFIG
        return _from_file(file) if file.is_file() else SamplingDefaults()
    file = Path(mode) / GENERATION_CONFIG
    if not file.is_file():
        raise MlacError(
            f"--generation-config {mode}: no {GENERATION_CONFIG} there (or give auto, vllm, none)"
        )
    return _from_file(file)


def _from_file(file: Path) -> SamplingDefaults:
    """The sampling fields of one generation_config.json; a value of the wrong type, or one that
    SamplingParams refuses, is an MlacError naming the file and the field."""
    data = load_json(file.read_bytes(), str(file))
    given = {}
    for f in fields(SamplingDefaults):
        value = data.get(f.name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise MlacError(f"{file}: {f.name}={value!r} is not a number")
        given[f.name] = int(value) if f.type == "int" else float(value)
    if "top_k" in given:
        given["top_k"] = max(0, given["top_k"])  # -1 (vLLM) and 0 both mean off
    defaults = replace(SamplingDefaults(), **given)
    try:
        SamplingParams(**{f.name: getattr(defaults, f.name) for f in fields(SamplingDefaults)})
    except InvalidSamplingParams as e:
        raise MlacError(f"{file}: {e.param}={data[e.param]!r}: {str(e).split(': ', 1)[1]}") from None
    return defaults
