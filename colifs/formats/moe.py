"""What a model's own config says about its routed experts: how many, and in which layers.

A fused expert tensor is cut into one slice per expert only when its shape agrees with this count
(colifs.formats.experts); without a config the count is taken from the shapes, more carefully. GGUF files
carry the count in their own metadata (`<arch>.expert_count`, colifs.formats.gguf).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping

from colifs import jsonin
from colifs.formats.layout import ExpertConfig

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


LayerRule = Callable[[int], bool]  # True: layer i has routed experts


def _deepseek(section: Mapping, n: int) -> LayerRule | None:
    """DeepSeek, GLM-4-MoE, Kimi: dense before first_k_dense_replace, then every moe_layer_freq."""
    if (k := _int(section, "first_k_dense_replace")) is None:
        return None
    freq = max(_int(section, "moe_layer_freq", 1) or 1, 1)
    return lambda i: i >= k and i % freq == 0


def _qwen(section: Mapping, n: int) -> LayerRule | None:
    """Qwen-MoE: every decoder_sparse_step-th layer, except mlp_only_layers."""
    if (step := _int(section, "decoder_sparse_step")) is None or step <= 0:
        return None
    dense = frozenset(x for x in section.get("mlp_only_layers") or [] if type(x) is int)
    return lambda i: i not in dense and (i + 1) % step == 0


def _jamba(section: Mapping, n: int) -> LayerRule | None:
    """Jamba: layers expert_layer_offset + k * expert_layer_period."""
    if (period := _int(section, "expert_layer_period")) is None or period <= 0:
        return None
    offset = _int(section, "expert_layer_offset", 0)
    return lambda i: i % period == offset


def _llama4(section: Mapping, n: int) -> LayerRule | None:
    """Llama-4 (without an explicit moe_layers list): every interleave_moe_layer_step-th layer."""
    if (step := _int(section, "interleave_moe_layer_step")) is None or step <= 0:
        return None
    return lambda i: (i + 1) % step == 0


def _ernie(section: Mapping, n: int) -> LayerRule | None:
    """Ernie-4.5: every moe_layer_interval-th layer between the start and end indices."""
    if (interval := _int(section, "moe_layer_interval")) is None or interval <= 0:
        return None
    lo, hi = _int(section, "moe_layer_start_index", 0) or 0, _int(section, "moe_layer_end_index", n - 1)
    return lambda i: (i + 1) % interval == 0 and lo <= i <= hi  # type: ignore[operator]


# Each family's placement rule, as its modeling code in transformers derives it; a config that
# states several keys obeys all of them.
LAYER_RULES = (_deepseek, _qwen, _jamba, _llama4, _ernie)


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
    rules = [r for rule in LAYER_RULES if (r := rule(section, n)) is not None]
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
