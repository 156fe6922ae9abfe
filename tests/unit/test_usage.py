"""The usage file and Colibrì's .coli_usage (pure): round trips, merges, clear errors."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from colifs.formats.layout import ExpertKey
from colifs.usage import USAGE_NAME, BadUsageFile, Usage, load, read_coli_usage, save


def test_usage_round_trips_and_saves_add_up(tmp_path: Path) -> None:
    u = Usage(runs=1)
    u.count(ExpertKey("model.layers", 3, 7), 1000)
    u.count(ExpertKey("model.layers", 3, 7), 24)
    u.count("model.embed_tokens.weight", 4096)
    u.count_file("a.safetensors", 5120)
    path = str(tmp_path / USAGE_NAME)
    save(path, u)
    save(path, u)  # a second run (or a periodic save) adds to what the file holds
    back = load(path)
    assert back.keys[ExpertKey("model.layers", 3, 7)] == [2048, 4]
    assert back.keys["model.embed_tokens.weight"] == [8192, 2]
    assert back.files == {"a.safetensors": [10240, 2]} and back.runs == 2
    assert sorted(os.listdir(tmp_path)) == [USAGE_NAME]  # no temporary left behind


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ("{", "not valid JSON"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ('{"format": "colifs-usage", "version": 1, "runs": ' + "9" * 5000 + "}", "not valid JSON"),
        ("[]", "not a colifs usage file"),
        ('{"format": "colifs-usage", "version": 99}', "newer than this colifs reads"),
        ('{"format": "colifs-usage", "version": 1, "files": {"a": [1]}}', "malformed entry"),
        (
            '{"format": "colifs-usage", "version": 1, "experts": {"s": {"x": {"1": [1, 1]}}}}',
            "malformed entry",
        ),
    ],
)
def test_a_bad_usage_file_is_one_clear_error(tmp_path: Path, content: str, reason: str) -> None:
    path = tmp_path / USAGE_NAME
    path.write_text(content)
    with pytest.raises(BadUsageFile, match=reason):
        load(str(path))


def test_coli_usage_is_read_and_newer_versions_refused(tmp_path: Path) -> None:
    sizes = {ExpertKey("model.layers", 1, 2): 300, ExpertKey("model.layers", 0, 5): 100}
    path = tmp_path / ".coli_usage"
    path.write_text("-1 4 8\n-2 1 7\n1 2 10\n0 5 3\n3 7 4\n\n")
    u = read_coli_usage(str(path), sizes, "model.layers")
    assert u.keys == {ExpertKey("model.layers", 1, 2): [3000, 10], ExpertKey("model.layers", 0, 5): [300, 3]}
    for text, reason in [
        ("-2 2 7\n1 2 10\n", "version 2 is newer"),
        ("-1 4 8\n9 2 10\n", "outside 4 x 8"),
        ("1 2\n", "expected '<layer> <expert> <count>'"),
        ("a b c\n", "not numbers"),
        ("1 2 " + "9" * 5000 + "\n", "not numbers"),
    ]:
        path.write_text(text)
        with pytest.raises(BadUsageFile, match=reason):
            read_coli_usage(str(path), sizes, "model.layers")
