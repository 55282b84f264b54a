"""From raw files to training batches: chunk a corpus, check it, size an epoch, train,
resume; first on local disk, then on S3.

Run it with ``python tutorials/05_raw_to_batches.py``. It needs ``infinibatch_like`` with
its ``progress``, ``remote`` and ``zstd`` extras, and ``moto[server]`` and ``boto3`` to
play S3 locally (a real bucket works the same: leave out step 5's server and use your
credentials).

The story, top to bottom:

1. raw data as it often arrives: a few gzip JSON-lines files of uneven sizes;
2. ``python -m infinibatch_like chunk`` cuts them into zstd chunks of 400 records with an
   index, and ``verify`` reads every chunk back against it;
3. ``load_index`` tells, without reading the data, how many records and batches each of
   2 ranks sees per epoch;
4. a training pipeline over the chunks, checkpointed mid-epoch and resumed exactly;
5. the same on S3 (moto's server on 127.0.0.1 stands in for the store): raw files in a
   bucket, chunks written to the bucket, the same records, batches and epoch sizes.

Every claim the comments make is checked with an ``assert``.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import random
import subprocess
import sys
import tempfile
from itertools import islice
from pathlib import Path
from typing import Any

from infinibatch_like.datasets import chunked_dataset_iterator
from infinibatch_like.io import list_chunks, read_jsonl
from infinibatch_like.iterators import CheckpointableIterator, FixedBatchIterator
from infinibatch_like.prepare import load_index

BATCH_SIZE = 32
WORLD_SIZE = 2
SEED = 11


def cli(*args: str) -> str:
    """Run ``python -m infinibatch_like ARGS`` as a user would in a shell; its output."""
    result = subprocess.run(
        [sys.executable, "-m", "infinibatch_like", *args],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


# ---------------------------------------------------------------------------------------
# Step 1: raw data. Three gzip JSON-lines files of 1,500, 700 and 1,000 records.
# ---------------------------------------------------------------------------------------


def write_raw(directory: Path) -> list[dict[str, Any]]:
    rng = random.Random(0)
    records = []
    directory.mkdir(parents=True)
    for number, size in enumerate((1500, 700, 1000)):
        part = [
            {"id": f"{number}-{i}", "text": " ".join("ab" * rng.randint(1, 5) for _ in range(9))}
            for i in range(size)
        ]
        with gzip.open(directory / f"part-{number}.jsonl.gz", "wt", encoding="utf-8") as out:
            out.writelines(json.dumps(record) + "\n" for record in part)
        records.extend(part)
    return records


workdir = Path(tempfile.mkdtemp(prefix="raw_to_batches_"))
raw_records = write_raw(workdir / "raw")

# ---------------------------------------------------------------------------------------
# Step 2: chunk and verify. Chunks never straddle input files, and a file's chunks hold
# at most 400 records, their sizes differing by one at most: 1500 -> 4 x 375,
# 700 -> 2 x 350, 1000 -> 334 + 333 + 333. Running the same command again does nothing;
# after an interruption it finishes the job.
# ---------------------------------------------------------------------------------------

chunks_dir = workdir / "chunks"
command = [str(workdir / "raw" / "part-*.jsonl.gz"), "--out", str(chunks_dir)]
print(cli("chunk", *command, "--items-per-chunk", "400", "--compress", "zst", "--quiet"))
report = cli("verify", str(chunks_dir))
print(report)
assert "OK, 9 chunks, 3,200 items" in report

# ---------------------------------------------------------------------------------------
# Step 3: the index. Its chunk_refs feed chunked_dataset_iterator with read_jsonl; its
# counts say how long an epoch is for each rank, for the seed the pipeline uses.
# ---------------------------------------------------------------------------------------

index = load_index(str(chunks_dir))
assert len(index) == len(raw_records) == 3200
assert [chunk.items for chunk in index.chunks] == [375, 375, 375, 375, 350, 350, 334, 333, 333]
per_rank = [index.items_per_epoch(WORLD_SIZE, rank, seed=SEED) for rank in range(WORLD_SIZE)]
steps = [index.batches_per_epoch(BATCH_SIZE, WORLD_SIZE, r, seed=SEED) for r in range(WORLD_SIZE)]
print(f"items per epoch per rank: {per_rank}; batches of {BATCH_SIZE}: {steps}")
assert sum(per_rank) == len(index)  # each epoch splits the corpus between the ranks


def pipeline(refs: list[str], rank: int) -> CheckpointableIterator[list[dict[str, Any]]]:
    records = chunked_dataset_iterator(
        refs, read_jsonl, buffer_size=1000, seed=SEED, num_instances=WORLD_SIZE,
        instance_rank=rank,
    )  # fmt: skip
    return FixedBatchIterator(records, BATCH_SIZE)


# ---------------------------------------------------------------------------------------
# Step 4: train rank 0 for 20 steps, checkpoint, "crash", and resume in a fresh pipeline.
# ---------------------------------------------------------------------------------------

with pipeline(index.chunk_refs, rank=0) as batches:
    reference = list(islice(batches, 40))
with pipeline(index.chunk_refs, rank=0) as batches:
    first = list(islice(batches, 20))
    checkpoint = json.dumps(batches.getstate())
with pipeline(index.chunk_refs, rank=0) as batches:
    batches.setstate(json.loads(checkpoint))
    resumed = list(islice(batches, 20))
assert first + resumed == reference
print(f"resumed exactly after 20 batches ({len(checkpoint)} bytes of checkpoint)")

# One epoch of rank 0, as the index counted it: the records of the chunks it was given.
# (buffer_size=1 keeps each chunk's order, so the records are easy to compare.)
with chunked_dataset_iterator(
    index.chunk_refs, read_jsonl, buffer_size=1, seed=SEED, num_instances=WORLD_SIZE
) as records:
    epoch = list(islice(records, per_rank[0]))
chosen = index.rank_chunks(WORLD_SIZE, 0, seed=SEED)
assert epoch == [record for p in chosen for record in read_jsonl(index.chunk_refs[p])]

# ---------------------------------------------------------------------------------------
# Step 5: the same on S3. moto's server plays the store on 127.0.0.1; AWS_ENDPOINT_URL and
# the AWS_* credentials point every S3 client (s3fs, boto3) at it, as they would point at
# a real store's endpoint.
# ---------------------------------------------------------------------------------------

from moto.server import ThreadedMotoServer  # noqa: E402 - only this step needs it

logging.getLogger("werkzeug").setLevel(logging.ERROR)  # the server's request log
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
try:
    host, port = server.get_host_and_port()
    os.environ.update(
        AWS_ENDPOINT_URL=f"http://{host}:{port}",
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
    )
    import boto3

    s3 = boto3.client("s3")
    s3.create_bucket(Bucket="corpus")
    for path in sorted((workdir / "raw").iterdir()):
        s3.upload_file(str(path), "corpus", f"raw/{path.name}")

    print(cli("chunk", "s3://corpus/raw/*.jsonl.gz", "--out", "s3://corpus/chunks",
              "--items-per-chunk", "400", "--compress", "zst", "--quiet"))  # fmt: skip
    assert "OK, 9 chunks" in cli("verify", "s3://corpus/chunks")

    remote = load_index("s3://corpus/chunks")
    assert remote.chunk_refs[0] == "s3://corpus/chunks/chunk-000000-000000.jsonl.zst"
    assert list_chunks("s3://corpus/chunks/chunk-*") == remote.chunk_refs
    assert [c.items for c in remote.chunks] == [c.items for c in index.chunks]
    assert remote.items_per_epoch(WORLD_SIZE, 0, seed=SEED) == per_rank[0]
    # The same records in the same chunks, so the same batches: read_jsonl reads URLs as
    # it reads paths (where the environment does not hold the store's settings, bind them:
    # functools.partial(read_jsonl, storage_options={...})).
    with pipeline(remote.chunk_refs, rank=0) as batches:
        assert list(islice(batches, 20)) == first
        remote_checkpoint = json.dumps(batches.getstate())
    with pipeline(remote.chunk_refs, rank=0) as batches:
        batches.setstate(json.loads(remote_checkpoint))
        assert list(islice(batches, 20)) == resumed
    print("S3: same chunks, same epoch sizes, same batches, same resume")
finally:
    server.stop()
