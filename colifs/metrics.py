"""stats.json in the Prometheus text exposition format (for node_exporter's textfile collector or
a scrape job running `colifs stats MOUNT --prometheus`). Pure: a stats dict in, text out."""

from __future__ import annotations

from collections.abc import Iterable


def _label(value: object) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(**kv: object) -> str:
    return "{" + ",".join(f'{k}="{_label(v)}"' for k, v in kv.items()) + "}" if kv else ""


def _family(name: str, kind: str, help_: str, samples: Iterable[tuple[dict, float]]) -> list[str]:
    # The classic text format names a counter's family as its samples: with the _total suffix.
    full = f"colifs_{name}_total" if kind == "counter" else f"colifs_{name}"
    lines = [f"# HELP {full} {help_}", f"# TYPE {full} {kind}"]
    lines += [f"{full}{_labels(**labels)} {value:.17g}" for labels, value in samples]
    return lines


def prometheus(st: dict) -> str:
    """Every counter and gauge of one mount, labelled by mountpoint and replica."""
    m = st["mountpoint"]
    reps = st["replicas"]

    def per_replica(field: str) -> list[tuple[dict, float]]:
        """One sample per replica (a field that an older daemon's stats.json lacks reads 0)."""
        return [({"mountpoint": m, "replica": r["name"], "path": r["path"]}, r.get(field, 0)) for r in reps]

    def bytes_per_s(field: str) -> list[tuple[dict, float]]:
        """A per-replica figure in MB/s, as bytes/s; replicas not measured yet have no sample."""
        return [(labels, v * 1e6) for labels, v in per_replica(field) if v is not None]

    def health(field: str) -> list[tuple[dict, float]]:
        return [
            ({"mountpoint": m, "replica": r["name"], "path": r["path"]}, r["health"][field])
            for r in reps
            if "health" in r
        ]

    lines: list[str] = []
    info = {
        "mountpoint": m,
        "version": st["version"],
        "routing": st["routing"],
        "weights": st["weights_source"],
    }
    lines += _family("info", "gauge", "Mount facts (always 1).", [(info, 1)])
    lines += _family(
        "uptime_seconds", "gauge", "Seconds since the mount started.", [({"mountpoint": m}, st["uptime_s"])]
    )
    cpu = st.get("cpu")  # an older daemon's stats.json has none
    lines += _family(
        "cpu_seconds",
        "counter",
        "CPU the daemon took (user and system, every thread).",
        [({"mountpoint": m}, cpu["seconds"])] if cpu else [],
    )
    lines += _family(
        "served_bytes", "counter", "Bytes each drive delivered to the mount.", per_replica("bytes_served")
    )
    lines += _family("reads", "counter", "Reads each drive served.", per_replica("reads"))
    lines += _family(
        "read_errors",
        "counter",
        "Failed reads per drive (mirror ones fell back).",
        per_replica("read_errors"),
    )
    lines += _family(
        "in_flight_reads", "gauge", "Reads queued or running per drive now.", per_replica("in_flight")
    )
    lines += _family(
        "spilled_bytes",
        "counter",
        "Bytes the routes gave each drive that went to another: the drive had a backlog.",
        per_replica("bytes_spilled"),
    )
    lines += _family(
        "weight_share",
        "gauge",
        "Share of the traffic the weights in force give each drive.",
        per_replica("weight_share"),
    )
    lines += _family(
        "drive_rate_bytes_per_second",
        "gauge",
        "What each drive delivers per second busy, as measured while serving (the weights follow it).",
        bytes_per_s("measured_mb_per_s"),
    )
    lines += _family(
        "drive_saturated_rate_bytes_per_second",
        "gauge",
        "What each drive delivers per second busy in windows it was saturated (the readahead follows it).",
        bytes_per_s("saturated_mb_per_s"),
    )
    lines += _family(
        "drive_waited_alone_ratio",
        "gauge",
        "Share of the last second in which O_DIRECT readers waited on this drive alone, the others idle.",
        per_replica("waited_alone"),
    )
    lines += _family(
        "weight_changes",
        "counter",
        "Times the weights in force changed while serving.",
        [({"mountpoint": m}, st["balance"]["changes"])],
    )
    reload = st.get("reload") or {}  # an older daemon's stats.json has none
    lines += _family(
        "reloads",
        "counter",
        "Reloads (colifs reload, SIGHUP) the mount ran: its mirrors checked again while serving.",
        [({"mountpoint": m}, reload.get("count", 0))],
    )
    served = [
        ({"mountpoint": m, "replica": r["name"], "path": r["path"]},
         sum(1 for f in st["files"].values() if r["path"] in f["replicas"]))
        for r in reps
    ]  # fmt: skip
    lines += _family("model_files", "gauge", "Model files each replica's copies serve now.", served)
    lines += _family(
        "fallbacks",
        "counter",
        "Mirror reads re-read from the primary.",
        [({"mountpoint": m}, st["fallbacks"])],
    )
    up = [(labels, 1.0 if v == "up" else 0.0) for labels, v in health("state")]
    lines += _family("mirror_up", "gauge", "1 while the mirror is in the routing, else 0.", up)
    removed = [(labels, 1.0 if v == "removed" else 0.0) for labels, v in health("state")]
    lines += _family("mirror_removed", "gauge", "1 once colifs mirror remove took the mirror away.", removed)
    lines += _family(
        "mirror_timeouts", "counter", "Mirror reads given up after the timeout.", health("timeouts")
    )
    lines += _family(
        "mirror_times_down", "counter", "Times the mirror was taken out of the routing.", health("times_down")
    )
    layers = [
        ({"mountpoint": m, "layer": layer, "replica": reps[i]["name"]}, b)
        for layer, row in st["layers_routed_bytes"].items()
        for i, b in enumerate(row)
    ]
    lines += _family("layer_routed_bytes", "counter", "Bytes of each MoE layer routed to each drive.", layers)
    return "\n".join(lines) + "\n"
