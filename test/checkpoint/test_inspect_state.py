"""``python -m infinibatch_like inspect``: states in JSON files, torch checkpoints and
checkpoint files, local or in a store; sharded states shown shard by shard; bad files
refused naming them."""

from __future__ import annotations

import io
import itertools
import json
from pathlib import Path
from typing import Any

import pytest
from conftest import S3Bucket

from infinibatch_like import save_checkpoint
from infinibatch_like.__main__ import main
from infinibatch_like.distributed.sharded import ShardedIterator
from infinibatch_like.iterators import ChunkedSourceIterator, FixedBatchIterator


def _batches_state() -> dict[str, Any]:
    batches = FixedBatchIterator(ChunkedSourceIterator(list(range(20))), 3)
    next(batches)
    return batches.getstate()


def _inspect(target: str, capsys: pytest.CaptureFixture[str]) -> list[str]:
    assert main(["inspect", target]) == 0
    return capsys.readouterr().out.splitlines()


def test_inspect_reads_json_and_torch_checkpoints_from_s3(
    s3: S3Bucket, capsys: pytest.CaptureFixture[str]
) -> None:
    data = json.dumps(_batches_state()).encode()
    url = s3.put("run/state.json", data)
    out = _inspect(url, capsys)
    assert out[0] == f"{url}: JSON, {len(data):,} bytes"
    assert out[2:] == [
        "  FixedBatchIterator",
        "    source: NativeCheckpointableIterator  consumed=3",
    ]

    torch = pytest.importorskip("torch")
    buffer = io.BytesIO()
    torch.save({"model": {"w": torch.zeros(2)}, "data": _batches_state()}, buffer)
    url = s3.put("run/ckpt.pt", buffer.getvalue())
    out = _inspect(url, capsys)
    assert out[0] == f"{url}: torch checkpoint, {len(buffer.getvalue()):,} bytes"
    assert out[1].startswith("state at ['data']: ")

    assert main(["inspect", s3.url("run/absent.json")]) == 2
    error = capsys.readouterr().err
    assert error.startswith("infinibatch-like inspect: error: ")
    assert s3.url("run/absent.json") in error


def test_inspect_shows_each_shard_of_a_sharded_state(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sharded = ShardedIterator(  # shard s holds s + 1 items
        lambda shard, _: ChunkedSourceIterator(list(range(shard * 10, shard * 11 + 1))), 3
    )
    assert list(itertools.islice(sharded, 4)) == [0, 10, 20, 11]  # shard 0 has ended
    path = tmp_path / "state.json"
    path.write_text(json.dumps(sharded.getstate()))
    assert _inspect(str(path), capsys)[2:] == [
        "  ShardedIterator  next=2",
        "    shards[0]: shard=0 source=null replay=0 delivered=1 ended=true",
        "    shards[1]: shard=1 replay=0 delivered=2 ended=false",
        "      source: NativeCheckpointableIterator  consumed=2",
        "    shards[2]: shard=2 replay=0 delivered=1 ended=false",
        "      source: NativeCheckpointableIterator  consumed=1",
    ]


def test_inspect_verifies_a_checkpoint_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = Path(save_checkpoint(tmp_path / "data-{step}.json", _batches_state(), step=7))
    out = _inspect(str(path), capsys)
    assert out[1] == "checkpoint file: format version 2, step 7, checksum verified"
    assert out[2].startswith("state at ['state']: ")
    path.write_text(path.read_text().replace('"consumed":3', '"consumed":4'))
    out = _inspect(str(path), capsys)
    assert out[1].startswith(
        f"checkpoint file: refused by load_checkpoint: {path}: the checkpoint's content does "
        "not match its checksum"
    )
    assert out[3:] == [
        "  FixedBatchIterator",
        "    source: NativeCheckpointableIterator  consumed=4",
    ]


def test_inspect_refuses_deeply_nested_json_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    assert main(["inspect", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.err == (
        f"infinibatch-like inspect: error: {path}: the JSON document (200,000 bytes) is "
        "nested too deeply to read\n"
    )
