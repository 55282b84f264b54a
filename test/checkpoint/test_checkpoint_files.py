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
from _s3 import FaultyProxy
from conftest import S3Bucket

from infinibatch_like import (
    CheckpointNotFoundError,
    DamagedCheckpointWarning,
    load_checkpoint,
    load_checkpoint_info,
    save_checkpoint,
)
from infinibatch_like.checkpoint.files import FORMAT, CheckpointFileError, pipeline_fingerprint
from infinibatch_like.io import ChunkReadError, RetryPolicy, reset_retry_counts, retry_counts
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
    assert list(document) == ["format", "version", "fingerprint", "checksum", "state"]
    assert document["format"] == FORMAT
    assert document["version"] == 2
    assert re.fullmatch("[0-9a-f]{16}", document["fingerprint"])
    assert re.fullmatch("sha256:[0-9a-f]{64}", document["checksum"])
    assert sorted(os.listdir(tmp_path)) == ["data.json"]  # no temporary file left


def test_fingerprint_tells_pipelines_apart(tmp_path: Path) -> None:
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


def test_edited_fingerprint_of_a_version_1_file_is_refused(tmp_path: Path) -> None:
    state = advanced(5).getstate()
    document = {"format": FORMAT, "version": 1, "fingerprint": pipeline_fingerprint(state)}
    path = tmp_path / "data.json"
    path.write_text(json.dumps({**document, "state": state}))
    assert load_checkpoint(path) == state  # files of version 1 (no checksum) still load
    state["source"]["fingerprint"]["block_size"] = 38
    path.write_text(json.dumps({**document, "state": state}))
    with pytest.raises(CheckpointFileError, match="differ from the pipeline fingerprint"):
        load_checkpoint(path)


def test_no_checkpoint_yet_is_a_file_not_found_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such checkpoint file") as caught:
        load_checkpoint(tmp_path / "absent.json")
    assert "absent.json" in str(caught.value)
    assert isinstance(caught.value, CheckpointNotFoundError)
    assert isinstance(caught.value, CheckpointFileError)  # what `except` clauses caught before
    with pytest.raises(FileNotFoundError, match="no checkpoint file matches"):
        load_checkpoint(tmp_path / "data-{step}.json")
    with pytest.raises(FileNotFoundError, match="no checkpoint file matches"):
        load_checkpoint(tmp_path / "no-such-dir" / "data-{step}.json")
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
        ({"a": object()}, r"state\['a'\] is a object; a state must be plain data"),
        ({"a": [1.0, float("nan")]}, r"state\['a'\]\[1\] is nan, which JSON cannot hold"),
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
        load_checkpoint_info(pattern, fallback=False)
    with pytest.warns(DamagedCheckpointWarning, match="loaded memory://ckpt-test/run/data-3"):
        assert load_checkpoint(pattern) == {**state, "step": 3}
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
    with pytest.warns(
        DamagedCheckpointWarning, match=r"data-20\.json: the checkpoint file is empty"
    ):
        loaded = load_checkpoint_info(pattern)
    assert (loaded.state, loaded.path, loaded.step) == (
        {**state, "step": 15},
        s3.url("run/data-15.json"),
        15,
    )


def test_save_and_load_retry_store_faults_by_the_given_policy(
    s3: S3Bucket, s3_proxy: FaultyProxy
) -> None:
    """Uploads, listings, removals (keep=) and reads of checkpoint files are retried after
    a transient fault, as often as `retry` says."""
    options = {"endpoint_url": s3_proxy.endpoint}
    fast = RetryPolicy(tries=3, first_delay=0.01, max_delay=0.05)
    pattern = s3.url("run/data-{step}.json")
    state = advanced(7).getstate()
    reset_retry_counts()
    save_checkpoint(pattern, {**state, "step": 1}, step=1, storage_options=options, retry=fast)
    for method, path in [("PUT", "data-2"), ("GET", "list-type"), ("DELETE", "data-1")]:
        s3_proxy.inject("slow_down", 1, method, path)
    save_checkpoint(
        pattern, {**state, "step": 2}, step=2, keep=1, storage_options=options, retry=fast
    )
    listed = s3.client.list_objects_v2(Bucket=s3.name, Prefix="run/")
    assert [item["Key"] for item in listed["Contents"]] == ["run/data-2.json"]
    s3_proxy.inject("slow_down", 1, "GET", "list-type")
    s3_proxy.inject("slow_down", 1, "GET", "data-2")
    assert load_checkpoint(pattern, storage_options=options, retry=fast) == {**state, "step": 2}
    assert s3_proxy.injected["slow_down"] == 5
    assert retry_counts() == {"SlowDown": 5}
    s3_proxy.inject("slow_down", 1, "GET", "data-2")
    with pytest.raises(ChunkReadError, match=r"run/data-2\.json failed after 1 tries"):
        load_checkpoint_info(pattern, storage_options=options, retry=RetryPolicy(tries=1))


def test_a_gz_name_compresses_the_file(tmp_path: Path) -> None:
    import gzip

    state = advanced(3).getstate()
    path = save_checkpoint(tmp_path / "data-{step}.json.gz", state, step=4, keep=1)
    assert json.loads(gzip.decompress(Path(path).read_bytes()))["state"] == state
    assert load_checkpoint(tmp_path / "data-{step}.json.gz") == state
    newest = Path(save_checkpoint(tmp_path / "data-{step}.json.gz", state, step=5, keep=2))
    newest.write_bytes(newest.read_bytes()[:-10])  # a truncated gzip stream
    with pytest.warns(DamagedCheckpointWarning, match=r"refused newer: .*data-5\.json\.gz: "):
        assert load_checkpoint_info(tmp_path / "data-{step}.json.gz").step == 4


def test_damaged_file_is_not_a_file_not_found_error(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path / "data-{step}.json", {"position": 1}, step=1)
    Path(path).write_bytes(Path(path).read_bytes()[:-5])
    for target in (path, str(tmp_path / "data-{step}.json")):
        with pytest.raises(CheckpointFileError, match="truncated") as caught:
            load_checkpoint(target)
        assert not isinstance(caught.value, FileNotFoundError)  # not taken for a first run


def test_damaged_newest_file_falls_back_to_the_newest_intact_one(tmp_path: Path) -> None:
    pattern = str(tmp_path / "data-{step}.json")
    states = {step: {**advanced(step).getstate(), "step": step} for step in (10, 20, 30)}
    for step, state in states.items():
        save_checkpoint(pattern, state, step=step, keep=3)
    newest, middle = tmp_path / "data-30.json", tmp_path / "data-20.json"
    newest.write_bytes(newest.read_bytes()[:100])  # torn by a crash
    with pytest.warns(DamagedCheckpointWarning) as caught:
        assert load_checkpoint(pattern) == states[20]
    message = str(caught[0].message)
    assert message.startswith(f"load_checkpoint: loaded {middle} (step 20), the newest intact")
    assert f"refused newer: {newest}: not a complete JSON document (100 bytes" in message
    assert caught[0].filename == __file__  # the warning points at the caller

    middle.write_text(middle.read_text().replace('"step":20', '"step":21'))  # edited
    with pytest.warns(DamagedCheckpointWarning, match=r"loaded .*data-10\.json \(step 10\)"):
        loaded = load_checkpoint_info(pattern)
    assert (loaded.state, loaded.path, loaded.step) == (
        states[10],
        str(tmp_path / "data-10.json"),
        10,
    )
    assert [path for path, _ in loaded.refused] == [str(newest), str(middle)]
    assert "does not match its checksum" in loaded.refused[1][1]

    with pytest.raises(CheckpointFileError, match=r"data-30\.json: not a complete JSON"):
        load_checkpoint_info(pattern, fallback=False)
    (tmp_path / "data-10.json").write_bytes(b"")
    with pytest.raises(CheckpointFileError) as refused:
        load_checkpoint(pattern)
    assert not isinstance(refused.value, FileNotFoundError)
    assert str(refused.value).startswith(
        f"load_checkpoint: none of the 3 checkpoint files of {pattern!r} is intact: {newest}: "
    )
    assert f"{tmp_path / 'data-10.json'}: the checkpoint file is empty" in str(refused.value)


def _saved_positions(directory: Path, *steps: int) -> str:
    """The pattern of `directory`'s files saved at `steps` (keep=2), state {"position": step}."""
    pattern = str(directory / "data-{step}.json")
    for step in steps:
        save_checkpoint(pattern, {"position": step}, step=step, keep=2)
    return pattern


def test_newest_intact_file_loads_without_a_warning(
    tmp_path: Path, recwarn: pytest.WarningsRecorder
) -> None:
    pattern = _saved_positions(tmp_path, 1, 2)
    loaded = load_checkpoint_info(pattern)
    assert (loaded.state, loaded.step, loaded.refused) == ({"position": 2}, 2, ())
    assert load_checkpoint_info(tmp_path / "data-1.json").step == 1  # recorded in the file
    assert load_checkpoint_info(save_checkpoint(tmp_path / "plain.json", {})).step is None
    assert not recwarn.list


def test_renamed_step_file_is_refused(tmp_path: Path) -> None:
    pattern = str(tmp_path / "data-{step}.json")
    save_checkpoint(pattern, {"position": 4}, step=4)
    os.rename(tmp_path / "data-4.json", tmp_path / "data-9.json")
    with pytest.raises(
        CheckpointFileError, match="the file name says step 9, the checkpoint was saved at step 4"
    ):
        load_checkpoint_info(pattern, fallback=False)


def test_edited_position_is_refused_by_the_checksum(tmp_path: Path) -> None:
    it = advanced(2)
    path = Path(save_checkpoint(tmp_path / "data.json", it.getstate()))
    text = path.read_text()
    assert text.count('"emitted":8') == 1
    path.write_text(text.replace('"emitted":8', '"emitted":9'))
    edited = pipeline()
    edited.setstate(json.loads(path.read_text())["state"])  # setstate alone accepts it
    with pytest.raises(CheckpointFileError, match="does not match its checksum") as caught:
        load_checkpoint(path)
    assert str(caught.value).startswith(f"{path}: the checkpoint's content does not match")
    document = json.loads(text)
    document["state"] = dict(reversed(document["state"].items()))  # same content, reordered
    path.write_text(json.dumps(document, indent=2))
    assert load_checkpoint(path) == it.getstate()


def test_deeply_nested_json_is_refused_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "deep.json"
    depth = 100_000
    path.write_text(
        '{"format": "infinibatch_like.checkpoint", "state": ' + "[" * depth + "]" * depth + "}"
    )
    with pytest.raises(CheckpointFileError, match="nested too deeply to read") as caught:
        load_checkpoint(path)
    assert str(caught.value).startswith(f"{path}: ")


@pytest.mark.parametrize(
    ("state", "where"),
    [
        ({0: 10}, 'state has the key 0 (int), which JSON would turn into the string "0"'),
        ({"a": {None: 1}}, "state['a'] has the key None (NoneType)"),
        ({"a": [{"b": {True: 1}}]}, "state['a'][0]['b'] has the key True (bool)"),
        ({"a": [1, (2, 3)]}, "state['a'][1] is a tuple, which JSON would turn into a list"),
        ({"a": {"b": float("inf")}}, "state['a']['b'] is inf, which JSON cannot hold"),
    ],
)
def test_state_that_json_would_change_is_refused_naming_where(
    tmp_path: Path, state: Any, where: str
) -> None:
    target = tmp_path / "data.json"
    with pytest.raises(TypeError, match=re.escape(f"save_checkpoint({str(target)!r}): {where}")):
        save_checkpoint(target, state)
    assert os.listdir(tmp_path) == []


def test_keep_tolerates_files_another_process_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pattern = _saved_positions(tmp_path, 1, 2)
    real_unlink = os.unlink

    def removed_by_the_other_process_first(path: Any, **kwargs: Any) -> None:
        real_unlink(path, **kwargs)  # the other job's save removed it...
        real_unlink(path, **kwargs)  # ...before this one did: FileNotFoundError

    monkeypatch.setattr(os, "unlink", removed_by_the_other_process_first)
    save_checkpoint(pattern, {"position": 3}, step=3, keep=2)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["data-2.json", "data-3.json"]


def test_concurrent_savers_with_keep_never_fail(tmp_path: Path) -> None:
    import subprocess
    import sys

    script = (
        "import sys\nfrom infinibatch_like import save_checkpoint\n"
        "for step in range(int(sys.argv[2]), 200, 2):\n"
        "    save_checkpoint(sys.argv[1], {'step': step}, step=step, keep=2)\n"
    )
    pattern = str(tmp_path / "data-{step}.json")
    jobs = [
        subprocess.Popen(
            [sys.executable, "-c", script, pattern, str(first)], stderr=subprocess.PIPE, text=True
        )
        for first in (0, 1)
    ]
    errors = [job.communicate(timeout=120)[1] for job in jobs]
    assert errors == ["", ""]
    assert load_checkpoint(pattern) == {"step": 199}


@pytest.mark.parametrize("root", ["local", "memory"])
def test_glob_characters_in_the_directory_are_literal(tmp_path: Path, root: str) -> None:
    base = str(tmp_path) if root == "local" else "memory://ckpt-glob"
    pattern = f"{base}/exp[1]*/data-{{step}}.json"
    decoy = f"{base}/exp1x/data-9.json"  # what the directory would match as a glob
    save_checkpoint(decoy, {"step": 9})
    for step in range(4):
        save_checkpoint(pattern, {"step": step}, step=step, keep=2)
    assert load_checkpoint(pattern) == {"step": 3}
    kept = sorted(path.rsplit("/", 1)[1] for path in _listing(f"{base}/exp[1]*"))
    assert kept == ["data-2.json", "data-3.json"]
    assert load_checkpoint(decoy) == {"step": 9}
    if root == "memory":
        import fsspec

        fsspec.filesystem("memory").rm("/ckpt-glob", recursive=True)


def _listing(directory: str) -> list[str]:
    if directory.startswith("memory://"):
        import fsspec

        return list(fsspec.filesystem("memory").ls(directory[len("memory://") :], detail=False))
    return [f"{directory}/{name}" for name in os.listdir(directory)]


_FULL_DISK = """
import os, resource, signal, sys
from infinibatch_like import save_checkpoint
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
try:
    save_checkpoint(sys.argv[1], {"data": os.urandom(8192).hex()})
except OSError as error:
    print(error)
"""


def test_full_disk_leaves_the_previous_file_and_no_temporary_file(tmp_path: Path) -> None:
    import subprocess
    import sys

    target = save_checkpoint(tmp_path / "data.json", {"position": 1})
    result = subprocess.run(
        [sys.executable, "-c", _FULL_DISK, target], capture_output=True, text=True, timeout=60
    )
    assert (result.stdout, result.stderr) == (f"[Errno 27] File too large: {target!r}\n", "")
    assert os.listdir(tmp_path) == ["data.json"]
    assert load_checkpoint(target) == {"position": 1}


def test_special_file_at_the_target_is_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    with pytest.raises(FileExistsError, match=f"{re.escape(str(fifo))}: exists and is a FIFO"):
        save_checkpoint(fifo, {"position": 1})
    assert fifo.is_fifo()
    assert os.listdir(tmp_path) == ["fifo.json"]
