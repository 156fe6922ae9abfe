"""Where engines keep models, and what a mount needs to know of each place.

- A plain directory (`--local-dir` downloads, LM Studio's `PUBLISHER/REPO/`): served as it is.
- The Hugging Face cache: `models--ORG--NAME/snapshots/REV/<file>` are relative symlinks into
  `models--ORG--NAME/blobs/`. A snapshot directory is served with its symlinks resolved into that
  repository directory; the repository directory itself serves the snapshot a ref names
  (`refs/main`, or `--revision`).
- Ollama's store (`~/.ollama/models`: `manifests/`, `blobs/sha256-HEX`): plain files whose names
  have no suffix; colifs.formats recognises a GGUF blob by its content.

A symlink that the mount could not follow as a link (it leaves the served directory, or is
absolute) is served as the file it leads to when that lies inside one of the store roots: the
served directory, the HF repository holding it, or a root the user names (`--store-root`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

HF_REPO_PREFIXES = ("models--", "datasets--", "spaces--")


def same_or_inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def is_hf_repo(path: str) -> bool:
    """A Hugging Face cache repository directory (`models--ORG--NAME` with its `snapshots/`)."""
    named = os.path.basename(path).startswith(HF_REPO_PREFIXES)
    return named and os.path.isdir(os.path.join(path, "snapshots"))


def hf_repo_of(snapshot: str) -> str | None:
    """The HF cache repository directory that holds the snapshot directory `snapshot`, or None."""
    parent = os.path.dirname(snapshot)
    repo = os.path.dirname(parent)
    return repo if os.path.basename(parent) == "snapshots" and is_hf_repo(repo) else None


def hf_snapshot(repo: str, revision: str) -> str:
    """The snapshot directory of `repo` that `revision` names: a ref (`main`, `pr/1`: the commit
    in `refs/`) or a commit hash. ValueError with one line when there is none."""
    if not revision or revision.startswith("/") or ".." in revision.split("/"):
        raise ValueError(f"--revision {revision!r}: a ref name or a commit hash")
    try:
        with open(os.path.join(repo, "refs", revision)) as f:
            commit = f.read().strip()
    except FileNotFoundError:
        commit = revision
    except OSError as e:
        raise ValueError(f"{repo}: cannot read refs/{revision} ({e.strerror})") from None
    snapshot = os.path.join(repo, "snapshots", commit)
    if not commit or "/" in commit or not os.path.isdir(snapshot):
        known = sorted(os.listdir(os.path.join(repo, "snapshots")))
        raise ValueError(
            f"{repo}: no snapshot for revision {revision!r} (snapshots: {', '.join(known) or 'none'})"
        )
    return snapshot


def served_dir(path: str, revision: str = "main") -> str:
    """The directory a replica argument serves, resolved: an HF repository directory serves the
    snapshot its `revision` names, anything else itself."""
    real = os.path.realpath(path)
    return hf_snapshot(real, revision) if is_hf_repo(real) else real


def store_roots(root: str, extra: Sequence[str] = ()) -> list[str]:
    """The directories a symlink under `root` (resolved) may lead into and still be served as a
    file: `root`, the HF repository holding it, and `extra` (--store-root)."""
    roots = [root]
    repo = hf_repo_of(root)
    if repo is not None:
        roots.append(repo)
    roots.extend(os.path.realpath(r) for r in extra)
    return roots


def inside_stores(target: str, roots: Sequence[str]) -> bool:
    """Whether the resolved path `target` lies inside one of the store roots."""
    return any(same_or_inside(target, r) for r in roots)
