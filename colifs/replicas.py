"""The replicas of a model directory (the primary and its mirrors) and what identifies a copy
validated at mount (colifs.catalogue decides which copies may serve each file)."""

from __future__ import annotations

import os
from dataclasses import dataclass

Identity = tuple[int, int, int, int, int]  # st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns


def identity(st: os.stat_result) -> Identity:
    """What must not change for a validated copy to stay usable. The ctime because user space
    cannot set it: a copy rewritten in place with its mtime put back (`rsync --inplace -t`,
    `cp -p`, `touch -r`) still shows a new ctime. A chmod or a new link moves it too: such a copy
    is dropped, which costs bandwidth, never a byte."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@dataclass(frozen=True, slots=True)
class Replica:
    """One copy of the model directory. Index 0 is the primary, the source of truth."""

    index: int
    root: str
    weight: float

    @property
    def role(self) -> str:
        return "primary" if self.index == 0 else "mirror"
