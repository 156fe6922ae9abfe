"""Names never leave the primary: checked on the operations, without a mount."""

from __future__ import annotations

from pathlib import Path

import pytest


def test_names_never_leave_the_primary(tmp_path: Path) -> None:
    """Symlinks (to a directory outside, upwards) are shown as links, never walked by the daemon;
    `..` or a path with a slash is not a name the daemon resolves."""
    import errno

    import pyfuse3

    from colifs.tree import ROOT_INO, Tree
    from tests.helpers import assembled, ops_of, run_ops

    primary = tmp_path / "p"
    primary.mkdir()
    (primary / "a.txt").write_text("a")
    (primary / "etc").symlink_to("/etc")
    (primary / "up").symlink_to("..")
    (tmp_path / "outside.txt").write_text("outside")
    tree = Tree(str(primary))
    assert sorted(n.relpath for n in tree.nodes.values()) == ["", "a.txt", "etc", "up"]
    asm = assembled(tmp_path, primary, [], [1.0])
    ops = ops_of(asm)

    async def go() -> None:
        for name in (b"..", b".", b"../outside.txt", b"up/outside.txt", b"etc/passwd", b"/etc"):
            with pytest.raises(pyfuse3.FUSEError) as e:
                await ops.lookup(ROOT_INO, name, None)
            assert e.value.errno == errno.ENOENT, name
        link = await ops.lookup(ROOT_INO, b"etc", None)
        assert await ops.readlink(link.st_ino, None) == b"/etc"

    run_ops(asm, go)
