"""A config field that takes one of a few words, checked when the config is composed.

OmegaConf validates an ``Enum``-typed field of a structured config at composition (``trainer.nonfinite=sikp``
fails with "Invalid value 'sikp', expected one of [stop, skip]" before any work); a ``Choice`` member also
compares, hashes, prints and serialises as its plain word, so code and reports read it as the string it was.
"""

from __future__ import annotations

from enum import Enum


class Choice(str, Enum):
    """Base of every choice field's enum; member names equal their values (YAML and the command line give
    names)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    def __repr__(self) -> str:
        return repr(self.value)

