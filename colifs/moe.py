"""What a model's own config says about its routed experts: how many, and in which layers.

A fused expert tensor is cut into one slice per expert only when its shape agrees with this count
(colifs.layout); without a config the count is taken from the shapes, more carefully. GGUF files
carry the count in their own metadata (`<arch>.expert_count`, colifs.gguf).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping

from colifs import jsonin
from colifs.layout import ExpertConfig

log = logging.getLogger("colifs")

CONFIG_NAME = "config.json"
MAX_CONFIG = 16 << 20  # bytes: a config is a few KB
# The routed-expert count, by the name each family's config gives it.
COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
# Where a family nests the language model's settings (DBRX's ffn_config, multimodal text_config).
NESTED = ("ffn_config", "text_config", "language_config", "llm_config")


def _count(config: Mapping) -> int | None:
    """The routed-expert count this mapping itself states (not a nested one)."""
    for key in COUNT_KEYS:
        value = config.get(key)
        if type(value) is int and value > 0:
            return value
    return None


def _moe_section(config: object) -> Mapping | None:
    """The part of a config that states the routed-expert count (top level, or nested)."""
    if not isinstance(config, Mapping):
        return None
    if _count(config) is not None:
        return config
    for key in NESTED:
        inner = _moe_section(config.get(key))
        if inner is not None:
            return inner if key != "ffn_config" else config  # DBRX: the layer count is outside
    return None


def expert_count(config: object) -> int | None:
    """The number of routed experts a config.json states; None when it states none (a dense
    model, or a count that is not a positive integer)."""
    section = _moe_section(config)
    if section is None:
        return None
    return _count(section) or _count(section["ffn_config"])  # DBRX: its section holds ffn_config


def _int(section: Mapping, key: str, default: int | None = None) -> int | None:
    value = section.get(key, default)
    return value if type(value) is int else default


def moe_layers(config: object) -> frozenset[int] | None:
    """The layers with routed experts, as each family's modeling code derives them from its config
    (None: the config does not say, or every layer is MoE)."""
    section = _moe_section(config)
    if section is None:
        return None
    n = _int(section, "num_hidden_layers") or _int(section, "n_layers")
    if not n or n < 1:
        return None
    listed = section.get("moe_layers")
    if isinstance(listed, list) and all(type(x) is int for x in listed):  # Llama-4
        return frozenset(listed)
    rules: list[Callable[[int], bool]] = []
    if (k := _int(section, "first_k_dense_replace")) is not None:  # DeepSeek, GLM-4-MoE, Kimi
        freq = max(_int(section, "moe_layer_freq", 1) or 1, 1)
        rules.append(lambda i, k=k, freq=freq: i >= k and i % freq == 0)
    if (sparse := _int(section, "decoder_sparse_step")) is not None and sparse > 0:  # Qwen-MoE
        dense = frozenset(x for x in section.get("mlp_only_layers") or [] if type(x) is int)
        rules.append(lambda i, s=sparse, dense=dense: i not in dense and (i + 1) % s == 0)
    if (period := _int(section, "expert_layer_period")) is not None and period > 0:  # Jamba
        offset = _int(section, "expert_layer_offset", 0)
        rules.append(lambda i, p=period, o=offset: i % p == o)
    if (inter := _int(section, "interleave_moe_layer_step")) is not None and inter > 0:  # Llama-4
        rules.append(lambda i, s=inter: (i + 1) % s == 0)
    if (interval := _int(section, "moe_layer_interval")) is not None and interval > 0:  # Ernie-4.5
        lo, hi = _int(section, "moe_layer_start_index", 0) or 0, _int(section, "moe_layer_end_index", n - 1)
        rules.append(lambda i, s=interval, lo=lo, hi=hi: (i + 1) % s == 0 and lo <= i <= hi)
    if not rules:
        return None
    return frozenset(i for i in range(n) if all(rule(i) for rule in rules))


def expert_config(config: object) -> ExpertConfig | None:
    """What a config.json says about routed experts: their count and, if it says, their layers."""
    count = expert_count(config)
    return None if count is None else ExpertConfig(count, moe_layers(config))


class Configs:
    """The expert count that applies to each model file: from the nearest config.json at or above
    its directory, up to the root. Each config is read once; a bad one is one warning."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._by_dir: dict[str, ExpertConfig | None] = {}

    def experts_for(self, relpath: str) -> ExpertConfig | None:
        return self._dir(os.path.dirname(relpath))

    def _dir(self, reldir: str) -> ExpertConfig | None:
        if reldir not in self._by_dir:
            path = os.path.join(self.root, reldir, CONFIG_NAME)
            if os.path.isfile(path):  # the nearest config decides, even when it states no experts
                self._by_dir[reldir] = self._read(path, os.path.join(reldir, CONFIG_NAME))
            else:
                self._by_dir[reldir] = self._dir(os.path.dirname(reldir)) if reldir else None
        return self._by_dir[reldir]

    @staticmethod
    def _read(path: str, shown: str) -> ExpertConfig | None:
        try:
            return expert_config(jsonin.load_file(path, MAX_CONFIG))
        except (OSError, jsonin.BadJSON) as e:
            reason = e.strerror if isinstance(e, OSError) else str(e)
            log.warning("%s: unusable (%s); experts are keyed from tensor shapes alone", shown, reason)
            return None
