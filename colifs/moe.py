"""What a model's own config says about its routed experts: how many there are.

A fused expert tensor is cut into one slice per expert only when its shape agrees with this count
(colifs.layout); without a config the count is taken from the shapes, more carefully. GGUF files
carry the count in their own metadata (`<arch>.expert_count`, colifs.gguf).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from colifs import jsonin

log = logging.getLogger("colifs")

CONFIG_NAME = "config.json"
MAX_CONFIG = 16 << 20  # bytes: a config is a few KB
# The routed-expert count, by the name each family's config gives it.
COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
# Where a family nests the language model's settings (DBRX's ffn_config, multimodal text_config).
NESTED = ("ffn_config", "text_config", "language_config", "llm_config")


def expert_count(config: object) -> int | None:
    """The number of routed experts a config.json states; None when it states none (a dense
    model, or a count that is not a positive integer)."""
    if not isinstance(config, Mapping):
        return None
    for key in COUNT_KEYS:
        value = config.get(key)
        if type(value) is int and value > 0:
            return value
    for key in NESTED:
        inner = expert_count(config.get(key))
        if inner is not None:
            return inner
    return None


class Configs:
    """The expert count that applies to each model file: from the nearest config.json at or above
    its directory, up to the root. Each config is read once; a bad one is one warning."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._by_dir: dict[str, int | None] = {}

    def experts_for(self, relpath: str) -> int | None:
        return self._dir(os.path.dirname(relpath))

    def _dir(self, reldir: str) -> int | None:
        if reldir not in self._by_dir:
            path = os.path.join(self.root, reldir, CONFIG_NAME)
            if os.path.isfile(path):  # the nearest config decides, even when it states no experts
                self._by_dir[reldir] = self._read(path, os.path.join(reldir, CONFIG_NAME))
            else:
                self._by_dir[reldir] = self._dir(os.path.dirname(reldir)) if reldir else None
        return self._by_dir[reldir]

    @staticmethod
    def _read(path: str, shown: str) -> int | None:
        try:
            return expert_count(jsonin.load_file(path, MAX_CONFIG))
        except (OSError, jsonin.BadJSON) as e:
            reason = e.strerror if isinstance(e, OSError) else str(e)
            log.warning("%s: unusable (%s); experts are keyed from tensor shapes alone", shown, reason)
            return None
