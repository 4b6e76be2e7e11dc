"""The base of every config section: typed, and an unknown field refused."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A section of the config tree."""

    # An unknown field is a typo the user wants to hear about, not silently ignore.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
