"""WebDataset tar shards: samples grouped by key, bad samples named or skipped by the skip
policy, exact restores, plain and compressed, on disk and on S3."""

from __future__ import annotations

import functools
import gc
import gzip
import io
import json
import tarfile
import warnings
from pathlib import Path
from typing import Any

import pytest
import zstandard
from _profiles import examples
from conftest import S3Bucket
from hypothesis import given, settings
from hypothesis import strategies as st

from infinibatch_like.datasets import chunked_dataset_iterator
from infinibatch_like.io import (
    ChunkFormatError,
    open_output,
    read_jsonl,
    read_lines,
    read_webdataset,
    write_webdataset,
)
from infinibatch_like.stages.bad_records import SkipBudgetExceeded, SkipPolicy, skip_ledgers
from infinibatch_like.testing import assert_checkpointable, check_resume

Member = tuple[str, bytes | None]  # None: a symbolic link


def tar_bytes(members: list[Member]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type, info.linkname = tarfile.SYMTYPE, "elsewhere"
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


COMPRESS = {
    ".tar": lambda data: data,
    ".tar.gz": gzip.compress,
    ".tar.zst": lambda data: zstandard.ZstdCompressor().compress(data),
}


def sample_members(first: int, count: int) -> list[Member]:
    members: list[Member] = []
    for number in range(first, first + count):
        key = f"images/{number:04d}"
        members += [
            (f"{key}.jpg", bytes([number % 256]) * (number % 7 + 1)),
            (f"{key}.json", json.dumps({"n": number}).encode()),
            (f"{key}.seg.png", b"png"),
        ]
    return members


def expected_sample(number: int) -> dict[str, Any]:
    return {
        "__key__": f"images/{number:04d}",
        "jpg": bytes([number % 256]) * (number % 7 + 1),
        "json": json.dumps({"n": number}).encode(),
        "seg.png": b"png",
    }


def shards(tmp_path: Path, suffix: str, sizes: list[int]) -> list[str]:
    refs, first = [], 0
    for index, count in enumerate(sizes):
        path = tmp_path / f"shard-{index:04d}{suffix}"
        path.write_bytes(COMPRESS[suffix](tar_bytes(sample_members(first, count))))
        refs.append(str(path))
        first += count
    return refs


def drain(iterator: Any) -> list[Any]:
    """Every sample, and each error's message in its place."""
    out: list[Any] = []
    while True:
        try:
            out.append(next(iterator))
        except StopIteration:
            return out
        except ChunkFormatError as error:
            out.append(str(error))


@pytest.mark.parametrize("suffix", sorted(COMPRESS))
def test_members_are_grouped_into_samples_by_key(tmp_path: Path, suffix: str) -> None:
    (ref,) = shards(tmp_path, suffix, [5])
    assert list(read_webdataset(ref)) == [expected_sample(n) for n in range(5)]
    decoded = list(read_webdataset(ref, decode=("json", "txt")))
    assert [sample["json"] for sample in decoded] == [{"n": n} for n in range(5)]


def test_directories_are_passed_over_and_text_decodes(tmp_path: Path) -> None:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        tar.addfile(_directory("d"))
        for name, data in [("d/a.txt", "é".encode()), ("d/a.cls.txt", b"3")]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    path = tmp_path / "s.tar"
    path.write_bytes(buffer.getvalue())
    assert list(read_webdataset(path, decode=["txt"])) == [
        {"__key__": "d/a", "txt": "é", "cls.txt": "3"}
    ]


def _directory(name: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE
    return info


BAD_SHARD: list[Member] = [
    ("a.jpg", b"A"),
    ("b.jpg", b"B"),
    ("b.lnk", None),  # a symbolic link
    ("c.jpg", b"C"),
    ("README", b"no extension"),
    ("d.jpg", b"D"),
    ("d.jpg", b"D again"),
    ("e.jpg", b"E"),
    ("a.txt", b"a's key again, not next to a.jpg"),
    ("f.json", b"{not json"),
    ("g.jpg", b"G"),
]


def test_bad_samples_are_named_and_reading_goes_on(tmp_path: Path) -> None:
    path = tmp_path / "bad.tar"
    path.write_bytes(tar_bytes(BAD_SHARD))
    got = drain(read_webdataset(path, decode=["json"]))
    shard = str(path)
    assert got == [
        {"__key__": "a", "jpg": b"A"},
        f"{shard}: bad sample 'b': the member 'b.lnk' is not a regular file (tar type b'2')",
        {"__key__": "c", "jpg": b"C"},
        f"{shard}: bad sample 'README': the member 'README' has no extension",
        f"{shard}: bad sample 'd': the member 'd.jpg' repeats the extension 'jpg'",
        {"__key__": "e", "jpg": b"E"},
        f"{shard}: bad sample 'a': its key 'a' (member 'a.txt') was seen earlier in the shard",
        f"{shard}: bad sample 'f': the member 'f.json' does not decode as json: Expecting "
        "property name enclosed in double quotes: line 1 column 2 (char 1)",
        {"__key__": "g", "jpg": b"G"},
    ]


@pytest.mark.parametrize(
    ("suffix", "cut"),
    [(".tar", 5120), (".tar", 5000), (".tar", 5700), (".tar.gz", None)],
    ids=["at-a-header", "in-a-header", "in-data", "gzip"],
)
def test_a_truncated_shard_raises_once_naming_it_then_ends(
    tmp_path: Path, suffix: str, cut: int | None
) -> None:
    data = COMPRESS[suffix](tar_bytes(sample_members(0, 4)))  # members at every 1024 bytes
    path = tmp_path / f"cut{suffix}"
    path.write_bytes(data[: cut or len(data) // 2])
    got = drain(read_webdataset(path))
    assert got[-1].startswith(f"{path}: truncated or damaged tar shard, at ")
    assert got[:-1] == [expected_sample(n) for n in range(len(got) - 1)]
    if cut is not None:
        assert len(got) == 2  # the second sample, cut short, is the bad one


def test_skip_policy_skips_bad_samples_with_a_ledger_and_restores_exactly(tmp_path: Path) -> None:
    bad = tmp_path / "shard-0001.tar"
    bad.write_bytes(tar_bytes(BAD_SHARD))
    good = tmp_path / "shard-0000.tar"
    good.write_bytes(tar_bytes(sample_members(0, 6)))
    cut = tmp_path / "shard-0002.tar"
    cut.write_bytes(tar_bytes(sample_members(6, 6))[:5700])  # in the second sample
    refs = [str(good), str(bad), str(cut)]
    reader = functools.partial(read_webdataset, decode=["json"])

    def build(policy: SkipPolicy | None = None) -> Any:
        return chunked_dataset_iterator(
            refs,
            reader,
            buffer_size=4,
            train=False,
            shuffle=False,
            on_error=policy or SkipPolicy(max_skips=6),
        )

    keys = [sample["__key__"] for sample in build()]
    assert keys[:6] == [f"images/{n:04d}" for n in range(6)]
    assert keys[6:] == ["a", "c", "e", "g", "images/0006"]
    pipeline = build()
    list(pipeline)
    (ledger,) = skip_ledgers(pipeline).values()
    assert ledger.records == 6
    assert [entry["position"] for entry in ledger.last[:5]] == [1, 3, 4, 6, 7]
    assert ledger.last[-1]["message"].startswith(f"{cut}: truncated or damaged tar shard")
    check_resume(build, max_items=40, restore_points=[0, 6, 7, 8, 9, 10, 11], check_torch=False)
    with pytest.raises(SkipBudgetExceeded, match="bad sample 'README'"):
        list(build(SkipPolicy(max_skips=1)))


@pytest.mark.parametrize("suffix", [".tar", ".tar.zst"])
def test_chunked_dataset_of_shards_is_checkpointable(tmp_path: Path, suffix: str) -> None:
    refs = shards(tmp_path, suffix, [7, 3, 9])

    def build() -> Any:
        return chunked_dataset_iterator(refs, read_webdataset, buffer_size=5, seed=2)

    assert_checkpointable(build, max_items=50, restore_points=[0, 1, 6, 7, 8, 10, 11, 49])
    check_resume(build, max_items=60, restore_points=5)


@settings(max_examples=examples(0.3))
@given(
    members=st.lists(
        st.tuples(st.sampled_from("abcd"), st.sampled_from(["jpg", "txt", "x.y", ""])),
        max_size=12,
    ),
    skips=st.lists(st.integers(0, 5), max_size=4),
)
def test_skipping_equals_taking(members: list[tuple[str, str]], skips: list[int]) -> None:
    """skip(n) passes over exactly the samples (bad ones included) of n next() calls."""
    data = tar_bytes([(f"{key}.{ext}" if ext else key, b"x") for key, ext in members])
    with _shard(data) as ref:
        taken = drain(read_webdataset(ref))
        skipping, position = read_webdataset(ref), 0
        for count in skips:
            skipped = skipping.skip(count)  # type: ignore[attr-defined]
            assert skipped == min(count, len(taken) - position)
            position += skipped
            if position < len(taken):
                assert drain_one(skipping) == taken[position]
                position += 1


class _shard:
    """A temporary shard file holding `data`."""

    def __init__(self, data: bytes) -> None:
        import tempfile

        self._directory = tempfile.TemporaryDirectory()
        self.path = str(Path(self._directory.name) / "s.tar")
        Path(self.path).write_bytes(data)

    def __enter__(self) -> str:
        return self.path

    def __exit__(self, *exc: object) -> None:
        self._directory.cleanup()


def drain_one(iterator: Any) -> Any:
    try:
        return next(iterator)
    except ChunkFormatError as error:
        return str(error)


def test_bad_arguments_and_tar_archives_in_line_readers_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"decode must be a collection of \['json', 'txt'\]"):
        read_webdataset(tmp_path / "s.tar", decode=["jpg"])
    with pytest.raises(ValueError, match="decode must be"):
        read_webdataset(tmp_path / "s.tar", decode="json")
    with pytest.raises(ValueError, match=r"compression suffix '\.lz4' is not supported"):
        read_webdataset(tmp_path / "s.tar.lz4")
    for reader in (read_lines, read_jsonl):
        with pytest.raises(ValueError, match="cannot read a tar archive; read WebDataset"):
            reader(str(tmp_path / "s.tar.gz"))


def test_shards_on_s3_resume_exactly(s3: S3Bucket) -> None:
    refs = []
    for index, first in enumerate((0, 8)):
        data = gzip.compress(tar_bytes(sample_members(first, 8)))
        refs.append(s3.put(f"wds/shard-{index:04d}.tar.gz", data))

    def build() -> Any:
        return chunked_dataset_iterator(refs, read_webdataset, buffer_size=4, seed=9)

    first_pass = [sample for _, sample in zip(range(16), build(), strict=False)]
    assert sorted(s["__key__"] for s in first_pass) == [f"images/{n:04d}" for n in range(16)]
    check_resume(build, max_items=40, restore_points=4, check_torch=False)


def test_written_shards_read_back_and_are_reproducible(tmp_path: Path) -> None:
    samples = [expected_sample(n) for n in range(5)]
    outputs = []
    for name in ("a.tar.gz", "b.tar.gz"):
        with open_output(tmp_path / name) as out:
            assert write_webdataset(out, samples) == 5
        outputs.append((tmp_path / name).read_bytes())
    assert outputs[0] == outputs[1]
    assert list(read_webdataset(tmp_path / "a.tar.gz")) == samples


@pytest.mark.parametrize(
    ("samples", "error", "message"),
    [
        ([{"jpg": b""}], TypeError, "sample 0 must be a mapping with a str '__key__'"),
        ([{"__key__": "a.b", "jpg": b""}], ValueError, "sample 0 has the key 'a.b'"),
        ([{"__key__": "d/", "jpg": b""}], ValueError, "sample 0 has the key 'd/'"),
        ([{"__key__": "a", "": b""}], ValueError, "sample 0 \\('a'\\) has the extension ''"),
        ([{"__key__": "a", "txt": "text"}], TypeError, "the data of 'txt' must be bytes, got str"),
        (
            [{"__key__": "a", "x": b""}, {"__key__": "b"}, {"__key__": "a", "y": b""}],
            ValueError,
            "sample 2 repeats the key 'a'",
        ),
    ],
)
def test_writing_bad_samples_is_refused_naming_them(
    samples: list[dict[str, Any]], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        write_webdataset(io.BytesIO(), samples)


def test_a_shard_dropped_half_read_closes_its_file(tmp_path: Path) -> None:
    (ref,) = shards(tmp_path, ".tar", [4])
    samples = read_webdataset(ref)
    next(samples)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        del samples
        gc.collect()
    assert [str(warning.message) for warning in caught] == []  # no "unclosed file"
