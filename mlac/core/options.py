"""Layered options built from field names: one frozen dataclass per layer, each holding the next.

A layer holds the one below it as a field whose default_factory is that layer's class
(`ServerConfig.engine: EngineOptions`, `EngineOptions.runtime: RuntimeOptions`, ...). `build`
takes the field names of any layer, flat, and puts each value in the layer that declares it, as
nano-vllm builds its Config from **kwargs; each layer's __post_init__ then validates its part:

    ServerConfig.of(artifact="out/", port=8001, max_running_requests=8, dtype="float32")
    # ServerConfig(artifact, port=8001, engine=EngineOptions(
    #     scheduler=SchedulerConfig(max_running_requests=8), runtime=RuntimeOptions(dtype=...)))

So an option is one field (on the layer that reads it) and one flag; nothing copies it between
layers. A field name must belong to one layer only (TypeError otherwise, when it is used).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")


def layers(cls: type) -> dict[str, type]:
    """The fields of dataclass `cls` that hold a layer below it: name -> that layer's class."""
    return {
        f.name: f.default_factory
        for f in dataclasses.fields(cls)
        if f.init and isinstance(f.default_factory, type) and dataclasses.is_dataclass(f.default_factory)
    }


def field_names(cls: type) -> frozenset[str]:
    """Every name `build` takes for `cls`: its own fields' and, recursively, its layers'."""
    own = {f.name for f in dataclasses.fields(cls) if f.init}
    return frozenset(own.union(*(field_names(layer) for layer in layers(cls).values())))


def build(cls: type[T], fields: Mapping[str, Any], base: T | None = None) -> T:
    """`cls` with `fields` (names of its own fields or of any layer below), each in the layer that
    declares it; the rest from `base` (default: the defaults). A layer given whole (`runtime=...`)
    is the base of that layer's other fields. TypeError for a name no layer declares."""
    own = {f.name for f in dataclasses.fields(cls) if f.init}
    below = layers(cls)
    top = {k: v for k, v in fields.items() if k in own}
    routed: dict[str, dict[str, Any]] = {}
    for key in fields.keys() - own:
        owners = [name for name, layer in below.items() if key in field_names(layer)]
        if len(owners) != 1:
            why = "no option" if not owners else f"option in several layers ({', '.join(owners)})"
            raise TypeError(f"{cls.__name__}: {why} {key!r}")
        routed.setdefault(owners[0], {})[key] = fields[key]
    for name, sub in routed.items():
        given = top.get(name, getattr(base, name) if base is not None else None)
        top[name] = build(below[name], sub, given)
    return cls(**top) if base is None else dataclasses.replace(base, **top)


class Options:
    """Base of the frozen options dataclasses: built, or copied, by field names of any layer."""

    @classmethod
    def of(cls: type[T], **fields: Any) -> T:
        """A fresh one: `fields` each in the layer that declares it, the rest defaults."""
        return build(cls, fields)

    def updated(self: T, **fields: Any) -> T:
        """A copy with `fields` changed, each in the layer that declares it."""
        return build(type(self), fields, self)
