"""Models where engines keep them (colifs.stores): the Hugging Face cache (snapshots of relative
symlinks into blobs, refs naming the snapshot), Ollama's blob store (a GGUF without a suffix), and
symlinks that lead out of the model's store. Each layout is built as its tool writes it."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from safetensors import safe_open

from colifs.errors import MountError
from colifs.synth import write_checkpoint, write_gguf
from tests.helpers import mounted, run_colifs

pytestmark = pytest.mark.mounts

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hf_repo(hub: Path, files: Path, commit: str = COMMIT, ref: str = "main") -> Path:
    """`hub/models--org--moe` as huggingface_hub writes it: each file a blob named by its hash
    (SHA-256 for weights, as for LFS files; SHA-1 for the rest, as git's), the snapshot of
    `commit` made of relative symlinks to them, `refs/<ref>` holding the commit."""
    repo = hub / "models--org--moe"
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    for src in sorted(files.iterdir()):
        data = src.read_bytes()
        algo = hashlib.sha256 if src.suffix == ".safetensors" else hashlib.sha1
        blob = repo / "blobs" / algo(data).hexdigest()
        blob.write_bytes(data)
        (snap / src.name).symlink_to(os.path.join("..", "..", "blobs", blob.name))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)  # no newline, as huggingface_hub writes it
    return repo


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    write_checkpoint(str(src), "deepseek", layers=2, experts=16, hidden=256, inter=256, shards=2)
    return src


def served_by_both(m) -> bool:
    return all(r["bytes_served"] > 0 for r in m.stats()["replicas"])


def read_every_file(mnt: Path, src: Path) -> None:
    for p in sorted(src.iterdir()):
        via = mnt / p.name
        assert via.is_file() and not via.is_symlink(), p.name
        assert via.read_bytes() == p.read_bytes(), p.name


def test_a_hugging_face_snapshot_is_served_with_its_symlinks_resolved(checkpoint, tmp_path: Path) -> None:
    """Shards that are symlinks into blobs/ are regular files of the mount, routed per expert on
    both drives (the mirror's own symlinks and blobs), and safe_open reads them by name."""
    primary = hf_repo(tmp_path / "fast" / "hub", checkpoint)
    mirror = hf_repo(tmp_path / "second" / "hub", checkpoint)
    snapshot = f"snapshots/{COMMIT}"
    with mounted(primary / snapshot, [mirror / snapshot], tmp_path / "mnt", "--weights", "1,1") as m:
        read_every_file(m.path, checkpoint)
        assert served_by_both(m)
        files = m.stats()["files"]
        assert len(files) == 2 and all(len(f["replicas"]) == 2 for f in files.values()), files
        shard = sorted(checkpoint.glob("*.safetensors"))[0]
        with safe_open(str(m.path / shard.name), "np") as got, safe_open(str(shard), "np") as want:
            for name in want.keys():  # noqa: SIM118 - safe_open is not iterable
                assert got.get_tensor(name).tobytes() == want.get_tensor(name).tobytes(), name


def test_a_repository_directory_serves_the_snapshot_its_ref_names(checkpoint, tmp_path: Path) -> None:
    primary = hf_repo(tmp_path / "fast" / "hub", checkpoint)
    mirror = hf_repo(tmp_path / "second" / "hub", checkpoint)
    other = "fedcba9876543210fedcba9876543210fedcba98"
    (primary / "snapshots" / other).mkdir()  # an older revision, with only its config
    shutil.copy(checkpoint / "config.json", primary / "snapshots" / other / "config.json")
    with mounted(primary, [mirror], tmp_path / "mnt", "--weights", "1,1") as m:
        read_every_file(m.path, checkpoint)
        assert served_by_both(m)
    with mounted(primary, [], tmp_path / "mnt", "--revision", other) as m:  # a revision the mirror lacks
        assert [n for n in os.listdir(m.path) if n != ".colifs"] == ["config.json"]
    done = run_colifs("mount", str(primary), str(mirror), str(tmp_path / "mnt"), "--revision", "v9")
    assert done.returncode == MountError.exit_code and done.stderr.count("\n") == 1, done.stderr
    assert "no snapshot for revision 'v9'" in done.stderr and COMMIT in done.stderr


def ollama_store(root: Path, model: Path) -> Path:
    """`root` as Ollama keeps models: blobs/sha256-HEX (the GGUF among them, no suffix) and a
    manifest naming them."""
    blobs = root / "blobs"
    blobs.mkdir(parents=True)
    layers = []
    for data, media in ((model.read_bytes(), "model"), (b"{{ .Prompt }}", "template")):
        digest = hashlib.sha256(data).hexdigest()
        (blobs / f"sha256-{digest}").write_bytes(data)
        layers.append({"mediaType": f"application/vnd.ollama.image.{media}", "digest": f"sha256:{digest}"})
    manifest = root / "manifests" / "registry.ollama.ai" / "library" / "moe" / "latest"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": layers}))
    return root


def test_an_ollama_blob_is_a_model_file_by_its_content(tmp_path: Path) -> None:
    model = tmp_path / "moe.gguf"
    write_gguf(str(model), "qwen3moe", layers=2, experts=4, hidden=1024, inter=1024, qtype="F16")
    primary = ollama_store(tmp_path / "fast" / "models", model)
    mirror = ollama_store(tmp_path / "second" / "models", model)
    blob = f"blobs/sha256-{hashlib.sha256(model.read_bytes()).hexdigest()}"
    with mounted(primary, [mirror], tmp_path / "mnt", "--weights", "1,1") as m:
        assert (m.path / blob).read_bytes() == model.read_bytes()
        assert served_by_both(m)
        assert list(m.stats()["files"]) == [blob]  # the template blob is plain bytes
        done = run_colifs("route", str(m.path / blob), str(model.stat().st_size // 2), "--json")
        assert done.returncode == 0, done.stderr
        answer = json.loads(done.stdout)
        assert answer["tensor"] is not None and isinstance(answer["key"], dict), answer  # an expert


@pytest.mark.daemon_warns(r"outside the model's store: shown as a symlink")
def test_a_symlink_out_of_the_store_stays_a_symlink_unless_its_root_is_named(
    checkpoint, tmp_path: Path
) -> None:
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(checkpoint, elsewhere)
    shard = sorted(checkpoint.glob("*.safetensors"))[0].name
    primary, mirror = tmp_path / "fast", tmp_path / "second"
    for root in (primary, mirror):
        root.mkdir()
        (root / shard).symlink_to(elsewhere / shard)
    with mounted(primary, [mirror], tmp_path / "mnt") as m:
        assert (m.path / shard).is_symlink()
        assert m.stats()["files"] == {}
    with mounted(
        primary, [mirror], tmp_path / "mnt", "--store-root", str(elsewhere), "--weights", "1,1"
    ) as m:
        via = m.path / shard
        assert not via.is_symlink() and via.read_bytes() == (checkpoint / shard).read_bytes()
        assert list(m.stats()["files"]) == [shard]


@pytest.mark.daemon_warns(r"starts like a gguf file but malformed header")
def test_a_file_that_only_starts_like_a_model_is_plain_bytes(tmp_path: Path) -> None:
    primary, mirror = tmp_path / "fast", tmp_path / "second"
    for root in (primary, mirror):
        root.mkdir()
        (root / "blob").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 100)
    with mounted(primary, [mirror], tmp_path / "mnt") as m:
        assert (m.path / "blob").read_bytes() == (primary / "blob").read_bytes()
        assert m.stats()["files"] == {}


def test_staging_a_hugging_face_snapshot_makes_a_mirror_the_mount_uses(checkpoint, tmp_path: Path) -> None:
    """The copy is plain files named as in the snapshot; verify and the mount accept it."""
    snapshot = hf_repo(tmp_path / "fast" / "hub", checkpoint) / "snapshots" / COMMIT
    mirror = tmp_path / "second"
    mirror.mkdir()
    done = run_colifs("stage", str(snapshot), str(mirror), "--budget", "1G", "-q")
    assert done.returncode == 0, done.stderr
    for p in checkpoint.glob("*.safetensors"):
        assert not (mirror / p.name).is_symlink() and (mirror / p.name).read_bytes() == p.read_bytes()
    assert run_colifs("verify", str(snapshot), str(mirror), "--deep", "-q").returncode == 0
    with mounted(snapshot, [mirror], tmp_path / "mnt", "--weights", "1,1") as m:
        read_every_file(m.path, checkpoint)
        assert served_by_both(m)
        assert all(f["vouched_by_receipt"] == [str(mirror)] for f in m.stats()["files"].values())
