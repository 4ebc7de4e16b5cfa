"""The base of every on-disk model: frozen, and refusing fields it does not know."""

from pydantic import BaseModel, ConfigDict


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
