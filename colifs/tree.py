"""A snapshot of the primary's tree, taken at mount: directories, regular files and symlinks.

Inode numbers are colifs' own, derived from the relative path, so they are stable across mounts
and never the backing files' (two drives would give two inodes for one file). A symlink to a
regular file inside the model's store (colifs.stores: the tree itself, the Hugging Face repository
holding a snapshot, --store-root) that the mount could not follow as a link (it leaves the tree,
or is absolute) is a regular file of the tree, read through the link: a Hugging Face snapshot's
shards are links into its blobs. Other symlinks stay symlinks.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from colifs.stores import inside_stores, same_or_inside, store_roots

log = logging.getLogger("colifs")

ROOT_INO = 1
FIRST_FREE_INO = 16  # 2..15 are kept for colifs' own control files


@dataclass(slots=True)
class Node:
    ino: int
    relpath: str  # "" for the root
    st: os.stat_result
    children: dict[bytes, int] = field(default_factory=dict)  # directories only
    target: bytes = b""  # symlinks only

    def add_child(self, name: bytes, ino: int) -> None:
        self.children[name] = ino

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.st.st_mode)

    @property
    def is_file(self) -> bool:
        return stat.S_ISREG(self.st.st_mode)


class Tree:
    """Nodes by inode; built once, read-only afterwards."""

    def __init__(
        self, root: str, hidden: Callable[[str], bool] = lambda _: False, stores: Sequence[str] = ()
    ) -> None:
        self.root = root
        self._hidden = hidden  # relpaths not shown (colifs' own usage file)
        self._stores = store_roots(root, stores)
        self.nodes: dict[int, Node] = {}
        self._walk("", ROOT_INO, os.lstat(root))

    def _ino_for(self, relpath: str) -> int:
        h = int.from_bytes(hashlib.blake2b(os.fsencode(relpath), digest_size=8).digest(), "big")
        ino = FIRST_FREE_INO + h % (2**62)
        while ino in self.nodes:  # a collision is astronomically rare, but stay correct
            ino += 1
        return ino

    def _walk(self, relpath: str, ino: int, st: os.stat_result) -> None:
        node = self.nodes[ino] = Node(ino, relpath, st)
        path = os.path.join(self.root, relpath)
        try:
            entries = sorted(os.scandir(path), key=lambda e: e.name)
        except OSError as e:
            log.warning("%s: cannot list directory (%s); shown empty", relpath or ".", e.strerror)
            return
        for entry in entries:
            child_rel = os.path.join(relpath, entry.name)
            if self._hidden(child_rel):
                continue
            try:
                child_st = entry.stat(follow_symlinks=False)
            except OSError as e:
                log.warning("%s: cannot stat (%s); not shown", child_rel, e.strerror)
                continue
            mode = child_st.st_mode
            if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
                log.info("%s: not a file, directory or symlink; not shown", child_rel)
                continue
            child_ino = self._ino_for(child_rel)
            node.add_child(os.fsencode(entry.name), child_ino)
            if stat.S_ISDIR(mode):
                self._walk(child_rel, child_ino, child_st)
                continue
            target = _link_target(entry.path, child_rel) if stat.S_ISLNK(mode) else b""
            stored = self._stored_file(entry.path, child_rel, target) if stat.S_ISLNK(mode) else None
            if stored is not None:
                self.nodes[child_ino] = Node(child_ino, child_rel, stored)
            else:
                self.nodes[child_ino] = Node(child_ino, child_rel, child_st, target=target)

    def _stored_file(self, path: str, relpath: str, text: bytes) -> os.stat_result | None:
        """The status of the regular file the symlink at `path` (reading `text`) leads to, if it
        lies in the model's store out of the tree's own reach; None otherwise (a warning when it
        leads out of the store). A relative link within the tree stays a link: it works through
        the mount as it is."""
        target = os.path.realpath(path)
        if same_or_inside(target, self.root) and not text.startswith(b"/"):
            return None
        if not inside_stores(target, self._stores):
            log.warning(
                "%s: a symlink to %s, outside the model's store: shown as a symlink (--store-root serves it)",
                relpath, target,
            )  # fmt: skip
            return None
        try:
            st = os.stat(target)
        except OSError:
            return None  # dangling: a symlink, as on the primary
        return st if stat.S_ISREG(st.st_mode) else None

    def files(self) -> Iterator[Node]:
        """Every regular file, in walk order."""
        return (n for n in self.nodes.values() if n.is_file)


def _link_target(path: str, relpath: str) -> bytes:
    try:
        return os.fsencode(os.readlink(path))
    except OSError as e:
        log.warning("%s: cannot read symlink (%s)", relpath, e.strerror)
        return b""
