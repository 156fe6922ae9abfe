"""Route lookups and control files cost the daemon little whoever asks, however often: each
file's tensor table is built once (colifs.tensors), other users share one recent rendering of a
control file (colifs.namespace). Without a mount."""

from __future__ import annotations

import os
from pathlib import Path

import trio

from colifs.formats import tensor_at
from colifs.namespace import STATS_JSON_INO
from colifs.synth import write_checkpoint
from colifs.tensors import TensorTables
from tests.helpers import assembled, ops_of, run_ops, shards


def test_a_files_tensor_table_is_built_once_and_answers_as_its_header(tmp_path: Path) -> None:
    write_checkpoint(str(tmp_path / "p"), "deepseek", layers=2, experts=8, hidden=64, inter=32, shards=1)
    path = shards(tmp_path / "p")[0]
    st = path.stat()
    mounted = (st.st_ino, st.st_size, st.st_mtime_ns)
    tables = TensorTables()
    for off in range(0, st.st_size, 997):
        assert tables.name_at(7, str(path), mounted, off) == tensor_at(str(path), off)
    assert tables.builds == 1
    tables.forget()
    tables.name_at(7, str(path), mounted, 0)
    assert tables.builds == 2
    assert tables.name_at(8, str(path), (st.st_ino, st.st_size, st.st_mtime_ns + 1), 5000) is None  # not it
    tiny = TensorTables(limit=1)
    for ino in (1, 2, 1):
        tiny.name_at(ino, str(path), mounted, 5000)
    assert tiny.builds == 3  # bounded: only the last file's table is kept


def test_other_users_share_one_recent_rendering_of_a_control_file(tmp_path: Path) -> None:
    write_checkpoint(str(tmp_path / "p"), "deepseek", layers=1, experts=4, hidden=64, inter=32, shards=1)
    asm = assembled(tmp_path, tmp_path / "p", [], [1.0])
    ns = ops_of(asm).ns
    rendered = []
    render = ns.render
    ns.render = lambda ino: rendered.append(ino) or render(ino)  # type: ignore[method-assign]

    async def go() -> None:
        first = ns.snapshot(STATS_JSON_INO, 65534)
        for _ in range(200):
            assert ns.snapshot(STATS_JSON_INO, 65534) == first  # the same, shared
        assert len(rendered) == 1
        for _ in range(5):
            ns.snapshot(STATS_JSON_INO, os.geteuid())  # the daemon's own user: fresh each time
        assert len(rendered) == 6
        await trio.sleep(0.6)
        ns.snapshot(STATS_JSON_INO, 65534)
        assert len(rendered) == 7  # and renewed once it is old

    run_ops(asm, go)
