"""What a client uploads for a jailed user's job (plexctl/inputs.py) and what the daemon's store
keeps of it (daemon/blobs.py): the files behind the spec's paths, content-addressed; chunks that
resume; content that must match its hash; a job's copy that names only its own files."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from daemon.blobs import BlobError, BlobStore
from plexctl import inputs
from plexctl.common import protocol as P
from plexctl.common.errors import UsageError


def job_spec(tmp_path: Path) -> dict:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "train.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    code = tmp_path / "code"
    (code / "pkg").mkdir(parents=True)
    (code / "loop.py").write_text("def run(job):\n    pass\n")
    (code / "pkg" / "util.py").write_text("X = 1\n")
    for skipped in (".git", "__pycache__"):
        (code / skipped).mkdir()
        (code / skipped / "junk").write_text("not sent")
    return {
        "model": {"path": "/the/cluster/model"},
        "data": {"path": str(tmp_path / "train.jsonl")},
        "algo": {"loop": "loop:run", "path": str(code)},
    }


def test_the_files_behind_the_spec_paths_are_collected_and_the_models_is_not(tmp_path: Path) -> None:
    files, local = inputs.collect(job_spec(tmp_path))
    assert {(f.field, f.kind, f.relpath) for f in files} == {
        ("data.path", "file", "train.jsonl"),
        ("algo.path", "dir", "loop.py"),
        ("algo.path", "dir", "pkg/util.py"),
    }
    for f in files:
        assert hashlib.sha256(local[f.sha256].read_bytes()).hexdigest() == f.sha256


def test_a_file_its_user_cannot_read_stops_the_submit_naming_the_field(tmp_path: Path, monkeypatch) -> None:
    spec = job_spec(tmp_path)

    def refused(path: Path) -> str:  # as the kernel answers a user without the right (root is never refused)
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(inputs, "_sha256", refused)
    with pytest.raises(UsageError, match="^data.path: cannot read .*train.jsonl: Permission denied$"):
        inputs.collect(spec)
    spec["data"]["path"] = str(tmp_path / "missing.jsonl")
    with pytest.raises(UsageError, match="^data.path: .*missing.jsonl is neither a file nor a directory"):
        inputs.collect(spec)


class StoreClient:
    """A client whose daemon is a store in this process (what ``on_blob`` does with a request)."""

    def __init__(self, store: BlobStore, user: str) -> None:
        self.store, self.user, self.requests = store, user, 0

    def blob(self, req: P.BlobReq) -> P.BlobRep:
        self.requests += 1
        return P.BlobRep(self.store.put(self.user, req))


def test_uploads_are_checked_resumed_deduplicated_and_kept_per_user(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(inputs, "CHUNK", 7)  # several chunks for a small file
    files, local = inputs.collect(job_spec(tmp_path / "src"))
    store = BlobStore(tmp_path / "blobs")
    alice = StoreClient(store, "alice")
    assert inputs.upload(alice, files, local) == sum(f.size for f in {f.sha256: f for f in files}.values())
    assert store.check("alice", files) == ""
    assert inputs.upload(alice, files, local) == 0  # held: one question per file, nothing sent
    assert store.check("bob", files).startswith("data.path: train.jsonl was not uploaded")  # alice's, not his

    f = files[0]
    content = local[f.sha256].read_bytes()
    assert store.put("bob", P.BlobReq(f.sha256, f.size, 0, content[:5])) == 5
    assert store.put("bob", P.BlobReq(f.sha256, f.size, 0, content[:5])) == 5  # a resent chunk: no change
    assert store.put("bob", P.BlobReq(f.sha256, f.size, 5, content[5:])) == f.size
    with pytest.raises(BlobError, match="does not match"):
        store.put("bob", P.BlobReq("0" * 64, 3, 0, b"abc"))
    assert store.have("bob", "0" * 64, 3) == 0  # nothing of it kept
    with pytest.raises(BlobError):
        store.put("bob", P.BlobReq("../../etc", 3, 0, b"abc"))

    staged = store.stage("alice", files, tmp_path / "job" / "inputs")
    assert Path(staged["data.path"]).read_bytes() == (tmp_path / "src" / "train.jsonl").read_bytes()
    assert (Path(staged["algo.path"]) / "pkg" / "util.py").read_text() == "X = 1\n"
    escape = P.InputFile("algo.path", "dir", "../../outside.py", files[0].sha256, files[0].size)
    assert "not a file name" in store.check("alice", [escape])
    for field in ("/tmp/x", "../../x", "data", "model.path"):  # a field names a spec path that takes files
        forged = P.InputFile(field, "file", "train.jsonl", files[0].sha256, files[0].size)
        assert "not a spec path" in store.check("alice", [forged])
        with pytest.raises(BlobError, match="not a spec path"):
            store.stage("alice", [forged], tmp_path / "job" / "inputs")
    assert not (tmp_path / "x").exists()
