"""Every environment variable mlac reads (`MLAC_*`): one typed registry, each read once.

A `Setting` has a name, a type (`KINDS`: bool, int, str, choice, list), a default and a one-line
doc. Its value is read from the environment at its first use and kept for the process (`reload`
forgets the values read: tests that change the environment). Unset or empty is the default; a
value of the wrong type is a one-line MlacError that names the variable. `mlac serve` logs the
settings not at their default in one line (`summary`), secrets masked.

The registry holds product settings (credentials, registries, escape hatches, the tests' Triton
switch, a tuner's override), not A/B switches: a choice that tests compare is a field of a frozen
options object given at construction (runtime/model/options.py), never a variable read here.
docs/development.md lists the registry as a table (tests/test_settings.py compares the two).
No other module of mlac reads an `MLAC_*` variable from os.environ (the same test scans them).
Other tools' variables (TRITON_*, torchrun's RANK, ...) are read where those tools are used.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mlac.core.errors import MlacError

TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _bool(text: str, setting: Setting) -> bool:
    if text.lower() in TRUE + FALSE:
        return text.lower() in TRUE
    raise ValueError("say 1 or 0")


def _int(text: str, setting: Setting) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError("not an integer") from None


def _choice(text: str, setting: Setting) -> str:
    if text in setting.choices:
        return text
    raise ValueError(f"say {' or '.join(setting.choices)}")


def _list(text: str, setting: Setting) -> tuple[str, ...]:
    return tuple(item.strip() for item in text.split(",") if item.strip())


# How each type reads its text (never empty: unset and empty are the default).
KINDS: dict[str, Callable[[str, Setting], Any]] = {
    "bool": _bool,  # 1/true/yes/on or 0/false/no/off, any case
    "int": _int,
    "str": lambda text, setting: text,
    "choice": _choice,  # one of `choices`
    "list": _list,  # comma-separated items, blanks dropped
}

_values: dict[str, Any] = {}  # name -> value, read at first use (`reload` empties it)


@dataclass(frozen=True)
class Setting:
    """One environment variable: `get()` is its value (the default when unset or empty)."""

    name: str
    kind: str  # a key of KINDS
    default: Any
    doc: str  # one line: what it does
    choices: tuple[str, ...] = ()  # kind "choice": the values it takes
    secret: bool = False  # its value is never printed

    def get(self) -> Any:
        """The value, read from the environment at the first call, the same afterwards."""
        if self.name not in _values:
            _values[self.name] = self.parse(os.environ.get(self.name, ""))
        return _values[self.name]

    def parse(self, text: str) -> Any:
        """`text` as this setting's type; MlacError (one line, naming the variable) if it is not."""
        if text == "":
            return self.default
        try:
            return KINDS[self.kind](text, self)
        except ValueError as e:
            shown = "***" if self.secret else repr(text)
            raise MlacError(f"{self.name}={shown}: {e}") from None

    def shown(self, value: Any) -> str:
        """`value` as the start-up line and the docs write it: secrets masked, unset as `unset`."""
        if self.secret and value not in (None, ""):
            return "***"
        if value is None or value == ():
            return "unset"
        if isinstance(value, bool):
            return "1" if value else "0"
        return ",".join(value) if isinstance(value, tuple) else str(value)


API_KEY = Setting(
    "MLAC_API_KEY",
    "str",
    None,
    "the key `mlac serve` requires on /v1 routes when --api-key is not given",
    secret=True,
)
REGISTRY_USERNAME = Setting(
    "MLAC_REGISTRY_USERNAME",
    "str",
    None,
    "the OCI registry user of push and pull (with MLAC_REGISTRY_PASSWORD)",
)
REGISTRY_PASSWORD = Setting(
    "MLAC_REGISTRY_PASSWORD",
    "str",
    None,
    "that user's password",
    secret=True,
)
INSECURE_REGISTRIES = Setting(
    "MLAC_INSECURE_REGISTRIES",
    "list",
    (),
    "registries (HOST:PORT, comma-separated) that push, pull and serve speak to over plain HTTP",
)
PDL = Setting(
    "MLAC_PDL",
    "bool",
    True,
    "programmatic dependent launch on sm90+ GPUs; 0 is an escape hatch, and selects other kernel "
    "variants: prepare under the same value",
)
FORCE_TRITON = Setting(
    "MLAC_FORCE_TRITON",
    "bool",
    False,
    "the Triton kernels on CPU tensors too (tests, under TRITON_INTERPRET=1)",
)
MOE_DECODE_CONFIG = Setting(
    "MLAC_MOE_DECODE_CONFIG",
    "str",
    None,
    'the MoE decode kernel\'s tiles in place of its table, JSON {"fp8": {...}, "bf16": {...}} '
    "(benchmarks/kernels/moe_tune.sh)",
)

REGISTRY: tuple[Setting, ...] = (
    API_KEY,
    REGISTRY_USERNAME,
    REGISTRY_PASSWORD,
    INSECURE_REGISTRIES,
    PDL,
    FORCE_TRITON,
    MOE_DECODE_CONFIG,
)


def reload() -> None:
    """Forget every value read: the next `get` reads the environment again (tests)."""
    _values.clear()


def summary() -> str | None:
    """One line naming the settings not at their default (`MLAC_PDL=0, MLAC_API_KEY=***`), None
    when all are; reads (and so checks) every setting."""
    changed = [f"{s.name}={s.shown(s.get())}" for s in REGISTRY if s.get() != s.default]
    return f"settings: {', '.join(changed)}" if changed else None
