"""The base of every recipe section: a frozen pydantic model that forbids unknown keys, so a typo is an error."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
