"""save_checkpoint / load_checkpoint: atomic JSON files, refusals of bad files, keep=k."""

from __future__ import annotations

import io
import itertools
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
from conftest import S3Bucket

from infinibatch_like import load_checkpoint, save_checkpoint
from infinibatch_like.checkpoint_files import FORMAT, CheckpointFileError
from infinibatch_like.iterators import (
    BlockwiseShuffleIterator,
    ChunkedSourceIterator,
    FixedBatchIterator,
)


def pipeline() -> Any:
    items = ChunkedSourceIterator(list(range(500)))
    return FixedBatchIterator(BlockwiseShuffleIterator(items, 37, seed=5), 4)


def advanced(count: int) -> Any:
    it = pipeline()
    for _ in range(count):
        next(it)
    return it


def test_round_trip_continues_the_stream_exactly(tmp_path: Path) -> None:
    it = advanced(13)
    path = save_checkpoint(tmp_path / "data.json", {**it.getstate(), "epoch": 2})
    expected = list(itertools.islice(it, 20))
    state = load_checkpoint(path)
    assert state["epoch"] == 2
    fresh = pipeline()
    fresh.setstate(state)
    assert list(itertools.islice(fresh, 20)) == expected
    document = json.loads(Path(path).read_text())
    assert document["format"] == FORMAT
    assert document["version"] == 1
    assert document["fingerprint"]
    assert isinstance(document["fingerprint"], str)
    assert sorted(os.listdir(tmp_path)) == ["data.json"]  # no temporary file left


def test_fingerprint_tells_pipelines_apart(tmp_path: Path) -> None:
    from infinibatch_like.checkpoint_files import pipeline_fingerprint

    other = FixedBatchIterator(
        BlockwiseShuffleIterator(ChunkedSourceIterator(list(range(500))), 38, seed=5), 4
    )
    assert pipeline_fingerprint(pipeline().getstate()) == pipeline_fingerprint(
        advanced(9).getstate()
    )
    assert pipeline_fingerprint(pipeline().getstate()) != pipeline_fingerprint(other.getstate())


def test_local_write_is_atomic_and_synced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "data.json"
    save_checkpoint(target, {"position": 1})
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(descriptor: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{descriptor}"))
        real_fsync(descriptor)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    save_checkpoint(target, {"position": 2})
    assert str(tmp_path) in synced, "the directory was not fsync'd after the rename"
    assert any(path.endswith(".tmp") for path in synced), "the temporary file was not fsync'd"

    def failing_replace(*args: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(target, {"position": 3})
    assert load_checkpoint(target) == {"position": 2}
    assert sorted(os.listdir(tmp_path)) == ["data.json"]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "the checkpoint file is empty"),
        (b"  \n", "the checkpoint file is empty"),
        (b"\x80\x02}q\x00.", "not a complete JSON document"),
        (b'{"a": 1}', "not a checkpoint file of infinibatch_like"),
        (b"[1, 2]", "not a checkpoint file of infinibatch_like .* found 'list'"),
        (
            b'{"format": "infinibatch_like.checkpoint", "version": 99, "state": {}}',
            "format version 99 is not supported",
        ),
        (
            b'{"format": "infinibatch_like.checkpoint", "version": 1, "state": [1]}',
            '"state" must be a dict, got list',
        ),
    ],
)
def test_bad_files_are_refused_naming_the_path(
    tmp_path: Path, content: bytes, message: str
) -> None:
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    with pytest.raises(CheckpointFileError, match=message) as caught:
        load_checkpoint(path)
    assert str(path) in str(caught.value)


def test_truncated_file_is_refused(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path / "data.json", advanced(5).getstate())
    whole = Path(path).read_bytes()
    for length in (1, len(whole) // 2, len(whole) - 1):
        Path(path).write_bytes(whole[:length])
        with pytest.raises(CheckpointFileError, match="truncated") as caught:
            load_checkpoint(path)
        assert path in str(caught.value)
        assert f"{length} bytes" in str(caught.value)


def test_edited_state_is_refused_by_its_fingerprint(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path / "data.json", advanced(5).getstate())
    document = json.loads(Path(path).read_text())
    document["state"]["source"]["fingerprint"]["block_size"] = 38
    Path(path).write_text(json.dumps(document))
    with pytest.raises(CheckpointFileError, match="differ from the pipeline fingerprint"):
        load_checkpoint(path)


def test_missing_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointFileError, match="no such checkpoint file") as caught:
        load_checkpoint(tmp_path / "absent.json")
    assert "absent.json" in str(caught.value)
    with pytest.raises(CheckpointFileError, match="no checkpoint file matches"):
        load_checkpoint(tmp_path / "data-{step}.json")
    with pytest.raises(ValueError, match=r"load_checkpoint: \{step\} must be in the file name"):
        load_checkpoint(tmp_path / "{step}" / "data.json")


@pytest.mark.parametrize(
    ("path", "kwargs", "error", "message"),
    [
        ("data.json", {"step": 3}, ValueError, "step= needs a path with \\{step\\}"),
        ("data.json", {"keep": 3}, ValueError, "keep= needs a path with \\{step\\}"),
        ("data-{step}.json", {}, ValueError, "has \\{step\\}; give step="),
        ("data-{step}.json", {"step": -1}, ValueError, "step must be >= 0, got -1"),
        ("data-{step}.json", {"step": 1, "keep": 0}, ValueError, "keep must be >= 1, got 0"),
        ("data-{step}.json", {"step": 1.0}, TypeError, "step must be an int, got 1.0"),
        ("{step}/data.json", {"step": 1}, ValueError, "must be in the file name"),
    ],
)
def test_argument_errors(
    tmp_path: Path, path: str, kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        save_checkpoint(str(tmp_path / path), {"a": 1}, **kwargs)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ([1, 2], "state must be a dict, got list"),
        ({"a": object()}, "not plain data"),
        ({"a": float("nan")}, "not plain data"),
    ],
)
def test_state_that_is_not_plain_data_is_refused(tmp_path: Path, state: Any, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        save_checkpoint(tmp_path / "data.json", state)
    assert os.listdir(tmp_path) == []


def test_keep_the_last_k_and_load_the_latest(tmp_path: Path) -> None:
    pattern = str(tmp_path / "data-{step}.json")
    for step in (8, 9, 10, 11):
        save_checkpoint(pattern, {"step": step}, step=step, keep=2)
    (tmp_path / "data-x.json").write_text("not mine")
    (tmp_path / "other-3.json").write_text("not mine")
    assert sorted(os.listdir(tmp_path)) == [
        "data-10.json",
        "data-11.json",
        "data-x.json",
        "other-3.json",
    ]
    assert load_checkpoint(pattern) == {"step": 11}  # 11 > 9 as numbers, not as text
    save_checkpoint(pattern, {"step": 100}, step=100)  # keep=None keeps everything
    assert load_checkpoint(pattern) == {"step": 100}
    assert load_checkpoint(tmp_path / "data-10.json") == {"step": 10}
    save_checkpoint(pattern, {"step": 3}, step=3, keep=2)  # a rewound run: 3 is kept
    assert sorted(p.name for p in tmp_path.glob("data-*[0-9].json")) == [
        "data-100.json",
        "data-3.json",
    ]


def test_memory_url_round_trip_and_keep() -> None:
    fsspec = pytest.importorskip("fsspec")
    pattern = "memory://ckpt-test/run/data-{step}.json"
    state = advanced(7).getstate()
    for step in range(4):
        save_checkpoint(pattern, {**state, "step": step}, step=step, keep=2)
    fs = fsspec.filesystem("memory")
    assert sorted(fs.ls("/ckpt-test/run", detail=False)) == [
        "/ckpt-test/run/data-2.json",
        "/ckpt-test/run/data-3.json",
    ]
    loaded = load_checkpoint(pattern)
    assert loaded == {**state, "step": 3}
    fs.pipe_file("/ckpt-test/run/data-4.json", b'{"format": "infinibatch_like.checkpoint"')
    with pytest.raises(CheckpointFileError, match=re.escape("memory://ckpt-test/run/data-4.json")):
        load_checkpoint(pattern)
    fs.rm("/ckpt-test", recursive=True)


def test_state_inside_a_torch_checkpoint_loads_with_weights_only(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    it = advanced(11)
    path = save_checkpoint(tmp_path / "data.json", it.getstate())
    expected = list(itertools.islice(it, 10))
    buffer = io.BytesIO()
    model = torch.nn.Linear(2, 1)
    torch.save({"model": model.state_dict(), "data": load_checkpoint(path)}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    fresh = pipeline()
    fresh.setstate(loaded["data"])
    assert list(itertools.islice(fresh, 10)) == expected


def test_s3_round_trip_keep_and_refusal(s3: S3Bucket) -> None:
    pattern = s3.url("run/data-{step}.json")
    state = advanced(7).getstate()
    for step in (5, 10, 15):
        save_checkpoint(pattern, {**state, "step": step}, step=step, keep=2)
    listed = s3.client.list_objects_v2(Bucket=s3.name, Prefix="run/")
    assert sorted(item["Key"] for item in listed["Contents"]) == [
        "run/data-10.json",
        "run/data-15.json",
    ]
    assert load_checkpoint(pattern) == {**state, "step": 15}
    s3.put("run/data-20.json", b"")
    with pytest.raises(CheckpointFileError, match=r"data-20\.json: the checkpoint file is empty"):
        load_checkpoint(pattern)


def test_a_gz_name_compresses_the_file(tmp_path: Path) -> None:
    import gzip

    state = advanced(3).getstate()
    path = save_checkpoint(tmp_path / "data-{step}.json.gz", state, step=4, keep=1)
    assert json.loads(gzip.decompress(Path(path).read_bytes()))["state"] == state
    assert load_checkpoint(tmp_path / "data-{step}.json.gz") == state
