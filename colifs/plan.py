"""Which shards belong on a smaller mirror: most traffic per byte of space, within a budget.

`survey` reads only headers (of the primary's model files and of any copies on the mirror);
`choose` is pure. Shards already valid on the mirror cost nothing; a different file already at a
shard's name on the mirror is never replaced (colifs does not delete what it did not write).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass

from colifs.catalogue import ServedFile, mirror_problem
from colifs.checks import check_roots
from colifs.config import given_weights
from colifs.devices import one_drive
from colifs.errors import UsageError
from colifs.formats import format_for
from colifs.formats.layout import Layout, LayoutError
from colifs.formats.moe import Configs
from colifs.probe import probe, weights_from
from colifs.replicas import Replica
from colifs.tree import Tree
from colifs.units import parse_size
from colifs.usage import (
    COLI_USAGE_NAME,
    USAGE_NAME,
    Usage,
    key_sizes,
    load,
    main_stack,
    read_coli_usage,
    traffic,
)


@dataclass(frozen=True)
class Shard:
    """A model file of the primary and what the mirror holds under its name."""

    relpath: str
    size: int
    layout: Layout | None  # None: its header is malformed (never mirrored usefully)
    on_mirror: str  # "present" (valid copy), "missing", or why the copy there cannot serve
    traffic: float = 0.0  # expected bytes read from it (usage history, or its size)

    @property
    def present(self) -> bool:
        return self.on_mirror == "present"

    @property
    def blocked(self) -> bool:
        """A different file sits at its name on the mirror: staging would have to replace it."""
        return self.on_mirror not in ("present", "missing")


def survey(primary: str, mirror: str) -> list[Shard]:
    """Every model file of the primary, with its layout and the state of its copy on the mirror."""
    shards = []
    configs = Configs(primary)
    for node in Tree(primary).files():
        path = os.path.join(primary, node.relpath)
        fmt = format_for(path)
        if fmt is None:
            continue
        try:
            size, header, layout = fmt.read(path, configs.experts_for(node.relpath))
        except (LayoutError, OSError):
            shards.append(Shard(node.relpath, node.st.st_size, None, "primary header unreadable"))
            continue
        problem, _ = mirror_problem(os.path.join(mirror, node.relpath), size, header)
        shards.append(Shard(node.relpath, size, layout, problem or "present"))
    return shards


def find_usage(primary: str, given: str | None, shards: Sequence[Shard]) -> tuple[Usage, str]:
    """The usage history to plan from, and a phrase saying where it came from."""
    candidates = (
        [given] if given else [os.path.join(primary, USAGE_NAME), os.path.join(primary, COLI_USAGE_NAME)]
    )
    for path in candidates:
        if path is None or (not given and not os.path.exists(path)):
            continue
        if not os.path.isfile(path):
            raise UsageError(f"usage file {path} does not exist")
        with open(path, "rb") as f:
            first = f.read(64).lstrip()
        if first.startswith(b"{"):
            usage = load(path)
        else:
            layouts = [s.layout for s in shards if s.layout is not None]
            sizes = key_sizes(layouts)
            usage = read_coli_usage(path, sizes, main_stack(sizes))
        if usage:
            return usage, f"usage history {path} ({usage.runs} run{'s' * (usage.runs != 1)})"
        return usage, f"usage history {path} is empty: assuming every byte is read equally"
    return Usage(), "no usage history: assuming every byte is read equally (mount the model and use it first)"


def estimate(shards: Sequence[Shard], usage: Usage) -> list[Shard]:
    """The shards with their expected traffic, from the usage (or their size without usage)."""
    layouts = {s.relpath: s.layout for s in shards if s.layout is not None}
    expected = traffic(layouts, usage)
    return [dataclasses.replace(s, traffic=expected.get(s.relpath, 0.0)) for s in shards]


@dataclass(frozen=True)
class Choice:
    shard: Shard
    selected: bool
    reason: str  # "on mirror", "copy", "over budget", "mirror has a different file", ...


def choose(shards: Sequence[Shard], budget: int, free: int) -> list[Choice]:
    """Shards ordered by traffic per byte: those already on the mirror are kept (they cost no free
    space, but count in the budget, so a re-run with the same budget selects the same set), then
    the rest greedily while the budget and the free space (already less the reserve) allow.

    Greedy by density is the classic knapsack approximation: optimal whenever the chosen shards
    fill the space exactly, and shards are small next to a drive.
    """
    order = sorted(shards, key=lambda s: (-(s.traffic / s.size if s.size else 0.0), s.relpath))
    space = min(budget - sum(s.size for s in shards if s.present), free)
    used = 0
    out = []
    for s in order:
        if s.present:
            out.append(Choice(s, True, "on mirror"))
        elif s.layout is None:
            out.append(Choice(s, False, s.on_mirror))
        elif s.blocked:
            out.append(Choice(s, False, f"mirror has another file ({s.on_mirror})"))
        elif used + s.size <= space:
            used += s.size
            out.append(Choice(s, True, "copy"))
        else:
            out.append(Choice(s, False, "over budget"))
    return out


def coverage(choices: Sequence[Choice]) -> float:
    total = sum(c.shard.traffic for c in choices)
    return sum(c.shard.traffic for c in choices if c.selected) / total if total else 0.0


def speedup(cov: float, weights: Sequence[float]) -> float:
    """Expected read speed with the mirror over the primary alone.

    The mount can give the mirror up to min(coverage, its weight share) of the bytes (partial-
    mirror routing); the slower drive to finish its part sets the time.
    """
    w0, w1 = weights
    share = min(cov, w1 / (w0 + w1))
    time_with = max((1 - share) / w0, share / w1)
    return (1 / w0) / time_with if time_with > 0 else 1.0


@dataclass(frozen=True)
class Plan:
    """What `colifs plan` shows and `colifs stage` copies."""

    replicas: list[Replica]
    choices: list[Choice]
    usage_source: str  # where the usage history came from, as a phrase
    reserve: int

    @property
    def mirror(self) -> str:
        return self.replicas[1].root


def make_plan(primary: str, mirror: str, budget: str, reserve: str, usage: str | None) -> Plan:
    """Survey both directories, weigh each shard by its expected traffic, choose within the budget
    and the mirror's free space minus the reserve. UsageError with one line for bad input."""
    replicas = check_roots([primary, mirror], error=UsageError)
    budget_bytes, reserve_bytes = parse_size(budget), parse_size(reserve)
    shards = survey(replicas[0].root, replicas[1].root)
    if not shards:
        raise UsageError(f"{primary} holds no model file (*.safetensors, *.gguf)")
    history, source = find_usage(replicas[0].root, usage, shards)
    st = os.statvfs(replicas[1].root)
    free = st.f_bavail * st.f_frsize
    choices = choose(estimate(shards, history), budget_bytes, max(0, free - reserve_bytes))
    return Plan(replicas, choices, source, reserve_bytes)


def prediction_weights(flag: str | None, plan: Plan) -> tuple[list[float], str]:
    """The drive speeds the prediction uses: given, else probed on what the mirror holds, else equal."""
    weights, source = given_weights(flag, 2)
    if weights is not None:
        return weights, source
    files = [
        ServedFile(c.shard.relpath, c.shard.size, c.shard.layout, (0, 1) if c.shard.present else (0,))
        for c in plan.choices
        if c.shard.layout is not None
    ]
    if any(f.copies == (0, 1) for f in files):
        results = probe(plan.replicas, files, 2.0, one_drive([r.root for r in plan.replicas]))
        if all(r.mb_per_s for r in results):
            return weights_from(results), "probed"
    return [1.0, 1.0], "assumed equal: nothing on the mirror to probe yet; pass --weights"


def summary(plan: Plan, weights: list[float], weights_source: str) -> dict:
    """The plan as `colifs plan --json` prints it (and the table renders it)."""
    choices = plan.choices
    total = sum(c.shard.traffic for c in choices) or 1.0
    cov = coverage(choices)
    rows, space, cum = [], 0, 0.0
    for c in choices:
        if c.selected:
            space += c.shard.size
            cum += c.shard.traffic
        rows.append({
            "shard": c.shard.relpath,
            "size": c.shard.size,
            "traffic_share": c.shard.traffic / total,
            "action": c.reason,
            "selected": c.selected,
            "cumulative_space": space if c.selected else None,
            "cumulative_coverage": cum / total if c.selected else None,
        })  # fmt: skip
    return {
        "usage": plan.usage_source,
        "weights": weights,
        "weights_source": weights_source,
        "coverage": cov,
        "bytes_to_copy": sum(c.shard.size for c in choices if c.selected and not c.shard.present),
        "bytes_on_mirror": sum(c.shard.size for c in choices if c.selected and c.shard.present),
        "predicted_speedup": speedup(cov, weights),
        "shards": rows,
    }
