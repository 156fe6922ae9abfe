"""The text the commands print: a mount's stats, a plan, a verify report, a byte's route. Pure:
each takes what the command gathered (mostly the JSON it also prints with --json) and returns lines."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence

from colifs.units import human
from colifs.verify import Row


def stats_table(mountpoint: str, data: dict) -> list[str]:
    """`colifs stats`: one row per replica, then fallbacks, partial-mirror split, usage, notes."""
    balance = data["balance"]
    how = "adaptive: they follow each drive's measured MB/s" if balance["adaptive"] else "fixed"
    lines = [
        f"colifs {mountpoint}: up {data['uptime_s']:.0f} s, weights {data['weights_source']}, {how}",
        f"{'replica':<9} {'path':<32} {'weight':>7} {'measured':>8} {'GB':>9} {'share':>6} {'reads':>9}"
        f" {'errors':>6}  state",
    ]
    for r in data["replicas"]:
        lines.append(
            f"{r['name']:<9} {r['path']:<32} {r['weight_share']:>6.0%} {_rate(r):>8}"
            f" {r['bytes_served'] / 1e9:>9.2f} {r['byte_share']:>6.0%} {r['reads']:>9} {r['read_errors']:>6}"
            f"  {_state(r.get('health'))}"
        )
    lines += _weight_change(balance)
    lines += _last_reload(data)
    lines.append(f"fallbacks {data['fallbacks']}")
    lines += _partial(data)
    usage = data.get("usage") or {}
    if usage.get("file"):
        state = "kept" if usage.get("saving") else "not kept this run"
        lines.append(f"usage: {usage['file']} ({state}; last saved {usage.get('last_saved') or 'not yet'})")
    notes = {name: f["note"] for name, f in data["files"].items() if f["note"]}
    lines.extend(f"note: {name}: {note}" for name, note in sorted(notes.items()))
    return lines


def _weight_change(balance: dict) -> list[str]:
    last = balance["last_change"]
    if not last["at"]:
        return []
    before = " / ".join(f"{x:.0%}" for x in last["shares_before"])
    after = " / ".join(f"{x:.0%}" for x in last["shares_after"])
    return [f"weights changed {balance['changes']} times; last: {before} -> {after} ({last['why']})"]


def _partial(data: dict) -> list[str]:
    partial = data.get("partial_mirror")
    if not partial:
        return []
    split = " / ".join(f"{x:.1%}" for x in partial["predicted_byte_share"])
    plain = " / ".join(f"{x:.1%}" for x in partial["plain_byte_share"])
    actual = " / ".join(f"{r['byte_share']:.1%}" for r in data["replicas"])
    return [f"partial mirror(s), from the usage history: byte split expected {split} (plain "
            f"weights would give {plain}), actual {actual}"]  # fmt: skip


def _last_reload(data: dict) -> list[str]:
    reload = data.get("reload") or {}  # an older daemon's stats.json has none
    last = reload.get("last") or {}
    if not last:
        return []
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(last["at"]))
    if "error" in last:
        return [f"reloads {reload['count']}; the last, at {when}, failed: {last['error']}"]
    what = "; ".join(f"{m['path']} +{len(m['added'])} -{len(m['dropped'])}" for m in last["mirrors"])
    return [f"reloads {reload['count']}; last at {when} ({last['seconds']:g} s): {what}"]


def _rate(replica: dict) -> str:
    return "-" if replica["measured_mb_per_s"] is None else f"{replica['measured_mb_per_s']:.0f}MB/s"


def _state(health: dict | None) -> str:
    if health is None:
        return "primary"
    if health["state"] != "down":
        return health["state"]
    return f"down (next check in {health['next_check_in_s']:g} s; {health['last_error']})"


def plan_table(plan: dict, mirror: str) -> list[str]:
    """`colifs plan`: where the usage came from, one row per shard, the selection, the prediction."""
    rows = plan["shards"]
    width = max(len(r["shard"]) for r in rows)
    lines = [
        plan["usage"],
        f"{'shard':<{width}} {'size':>11} {'traffic':>8} {'cum. space':>11} {'coverage':>8}  action",
    ]
    for r in rows:
        cs = human(r["cumulative_space"]) if r["selected"] else ""
        cc = f"{r['cumulative_coverage']:.1%}" if r["selected"] else ""
        share = f"{r['traffic_share']:.1%}"
        lines.append(
            f"{r['shard']:<{width}} {human(r['size']):>11} {share:>8} {cs:>11} {cc:>8}  {r['action']}"
        )
    weights = ":".join(f"{w:g}" for w in plan["weights"])
    to_copy, there = human(plan["bytes_to_copy"]), human(plan["bytes_on_mirror"])
    lines += [
        f"selected {sum(r['selected'] for r in rows)} of {len(rows)} shards: {to_copy} to copy, {there} "
        f"already on {mirror}; they cover {plan['coverage']:.1%} of the traffic",
        f"predicted read speed {plan['predicted_speedup']:.2f}x the primary alone "
        f"(weights {weights}, {plan['weights_source']})",
    ]
    return lines


def verify_table(rows: Sequence[Row], deep: bool) -> list[str]:
    """`colifs verify`: one row per copy, then how many of each status and what was checked."""
    width = max([len(r.relpath) for r in rows] + [5])
    lines = [f"{'shard':<{width}} {'size':>11}  status"]
    lines += [f"{r.relpath:<{width}} {human(r.size):>11}  {r.status}" for r in rows]
    counts = Counter(r.status for r in rows)
    checked = "size, header and data" if deep else "size and header (--deep compares the data)"
    lines.append(f"{', '.join(f'{n} {s}' for s, n in sorted(counts.items()))}; checked {checked}")
    return lines


def route_text(answer: dict, offset: int) -> list[str]:
    """`colifs route`: the tensor, key, drive and copies of one byte."""
    key = answer["key"]
    if isinstance(key, dict):
        key = f"expert {key['expert']} of {key['stack']} layer {key['layer']}"
    lines = [f"{answer['file']} byte {offset}"]
    if key is None:
        return [*lines, "  not a model file: served from the primary as plain bytes"]
    keyed = ", ".join(f"{n} {why}" for why, n in answer.get("tensors_keyed", {}).items())
    return [
        *lines,
        f"  tensor  {answer['tensor'] or '(header)'}",
        f"  key     {key}",
        f"  drive   {answer['drive']} ({answer['path']})",
        f"  copies  {', '.join(answer['valid_copies'])}",
        f"  file    tensors keyed: {keyed or 'none'}",
    ]
