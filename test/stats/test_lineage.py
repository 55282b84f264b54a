"""Lineage: every packed token range names the chunk, record and offset it came from,
through shuffling, mixing by tokens, packing, batching, workers and restores."""

from __future__ import annotations

import json
from itertools import islice
from typing import Any

import pytest

import infinibatch_like.iterators as it
from infinibatch_like import PackingIterator, TokenBudgetMultiplexIterator
from infinibatch_like.datasets import chunked_dataset_iterator
from infinibatch_like.stats.lineage import (
    UNKNOWN,
    LineageLog,
    TokenOrigin,
    explain,
    of_value,
    on_value,
    origin_id,
    origin_parts,
    origins_of,
    traced_chunks,
)
from infinibatch_like.testing import check_resume
from infinibatch_like.torch import collate_packed

CHUNKS = {
    f"part-{number}.txt": [
        " ".join(f"w{(number * 11 + line * 5 + word) % 40}" for word in range(line % 17 + 1))
        for line in range(25)
    ]
    for number in range(6)
}
REFS = sorted(CHUNKS)
BOS, EOS = 1, 2


def read_chunk(ref: str) -> list[str]:
    return CHUNKS[ref]


def tokenize(line: str) -> list[int]:
    return [int(word[1:]) + 3 for word in line.split()]


def traced_pipeline(background: bool = False, strategy: str = "best_fit") -> Any:
    reader = traced_chunks(read_chunk, REFS)
    sources = [
        it.MapIterator(
            chunked_dataset_iterator(refs, reader, buffer_size=9, seed=seed), on_value(tokenize)
        )
        for seed, refs in enumerate([REFS[:3], REFS[3:]])
    ]
    mixed = TokenBudgetMultiplexIterator(sources, [1, 2], cost=of_value(len))
    window = {"window": 3} if strategy == "best_fit" else {}
    packed: it.CheckpointableIterator[Any] = PackingIterator(
        mixed, 16, strategy=strategy, bos_id=BOS, eos_id=EOS, traced=True, **window
    )
    if background:
        packed = it.PrefetchIterator(packed, 4, snapshot_every=5)
    return it.MapIterator(it.FixedBatchIterator(packed, 2), collate_packed)


def check_origins(batch: Any) -> int:
    """Every range's tokens are the named record's tokens from the named offset."""
    checked = 0
    for origin in origins_of(batch, REFS):
        document = [BOS, *tokenize(CHUNKS[origin.chunk_ref][origin.record]), EOS]
        length = origin.end - origin.start
        tokens = batch.tokens[origin.sequence, origin.start : origin.end].tolist()
        assert tokens == document[origin.offset : origin.offset + length], origin
        checked += length
    assert checked == int(batch.loss_mask.sum())  # every real token is explained
    return checked


@pytest.mark.parametrize("strategy", ["best_fit", "concat"])
def test_every_packed_token_range_names_its_chunk_record_and_offset(strategy: str) -> None:
    pipeline = traced_pipeline(strategy=strategy)
    assert sum(check_origins(batch) for batch in islice(pipeline, 40)) > 1000


def test_explain_restores_a_checkpoint_and_names_the_origins_of_a_later_step() -> None:
    pipeline = traced_pipeline()
    for _ in range(7):
        next(pipeline)
    saved = json.loads(json.dumps(pipeline.getstate()))
    for _ in range(5):
        next(pipeline)
    step_12 = next(pipeline)
    explained = explain(traced_pipeline(), saved, 5, REFS)
    assert explained == origins_of(step_12, REFS)
    assert all(isinstance(origin, TokenOrigin) for origin in explained)
    assert str(explained[0]).startswith("sequence 0 tokens [0, ")


def same_batches(a: Any, b: Any) -> bool:
    return all(
        x is y if x is None or isinstance(x, int) else bool((x == y).all())
        for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("background", [False, True], ids=["in-process", "worker-process"])
def test_lineage_resumes_exactly_also_behind_a_worker_process(background: bool) -> None:
    check_resume(
        lambda: traced_pipeline(background=background),
        max_items=30,
        restore_points=4,
        same=same_batches,
        check_torch=False,
    )


def test_without_lineage_there_are_no_origins_and_explain_says_how_to_switch_it_on() -> None:
    docs = it.NativeCheckpointableIterator([[5, 6], [7]])
    (sequence,) = PackingIterator(docs, 4)
    assert "origins" not in sequence
    assert collate_packed([sequence]).origins is None
    with pytest.raises(ValueError, match="build the PackingIterator with traced=True"):
        explain(PackingIterator(it.NativeCheckpointableIterator([[5, 6]]), 4), None, 0)


def test_a_traced_packer_refuses_documents_that_are_not_origin_pairs() -> None:
    packer = PackingIterator(it.NativeCheckpointableIterator([[1, 2, 3]]), 4, traced=True)
    with pytest.raises(TypeError, match=r"with traced=True a document must be an \[origin, tokens"):
        next(packer)


def test_origin_ids_round_trip_and_bad_chunks_are_named() -> None:
    assert origin_parts(origin_id(7, 123_456)) == (7, 123_456)
    with pytest.raises(ValueError, match="origin_id: chunk 0 or record 4294967296 is too large"):
        origin_id(0, 1 << 32)
    with pytest.raises(ValueError, match=r"traced_chunks: the chunk 'other\.txt' is not in"):
        traced_chunks(read_chunk, REFS)("other.txt")
    assert traced_chunks(read_chunk, REFS)(REFS[2])[3] == [origin_id(2, 3), CHUNKS[REFS[2]][3]]


def plain_pipeline() -> Any:
    """`traced_pipeline` with lineage off: plain records, plain functions."""
    sources = [
        it.MapIterator(
            chunked_dataset_iterator(refs, read_chunk, buffer_size=9, seed=seed), tokenize
        )
        for seed, refs in enumerate([REFS[:3], REFS[3:]])
    ]
    mixed = TokenBudgetMultiplexIterator(sources, [1, 2])
    packed = PackingIterator(mixed, 16, strategy="best_fit", window=3, bos_id=BOS, eos_id=EOS)
    return it.MapIterator(it.FixedBatchIterator(packed, 2), collate_packed)


def test_a_checkpoint_of_the_plain_pipeline_is_explained_by_its_traced_twin() -> None:
    """Training runs without lineage (no cost); the traced twin replays from its checkpoint."""
    training = plain_pipeline()
    for _ in range(9):
        next(training)
    saved = json.loads(json.dumps(training.getstate()))
    for _ in range(4):
        next(training)
    step_13 = next(training)
    explained = explain(traced_pipeline(), saved, 4, REFS)
    assert sum(origin.end - origin.start for origin in explained) == int(step_13.loss_mask.sum())
    for origin in explained:
        document = [BOS, *tokenize(CHUNKS[origin.chunk_ref][origin.record]), EOS]
        tokens = step_13.tokens[origin.sequence, origin.start : origin.end].tolist()
        assert tokens == document[origin.offset : origin.offset + origin.end - origin.start]


def test_traced_functions_refuse_values_that_are_not_origin_pairs() -> None:
    assert on_value(len)([origin_id(1, 2), "abc"]) == [origin_id(1, 2), 3]
    assert of_value(len)([5, "ab"]) == 2
    for function, owner in ((on_value(len), "on_value"), (of_value(len), "of_value")):
        with pytest.raises(TypeError, match=rf"{owner}: expected an \[origin, value\] pair"):
            function("a plain record")


def test_origins_go_through_bucketing_and_a_json_restore() -> None:
    def build() -> Any:
        records = chunked_dataset_iterator(REFS, traced_chunks(read_chunk, REFS), 7, seed=4)
        tokens = it.MapIterator(records, on_value(tokenize))
        return it.BucketedReadaheadBatchIterator(tokens, 10, key=of_value(len), batch_size=3)

    pipeline = build()
    for _ in range(5):
        next(pipeline)
    resumed = build()
    resumed.setstate(json.loads(json.dumps(pipeline.getstate())))
    batches = list(islice(resumed, 30))
    assert batches == list(islice(pipeline, 30))
    for batch in batches:
        for origin, tokens in batch:
            chunk, record = origin_parts(origin)
            assert tokens == tokenize(CHUNKS[REFS[chunk]][record])


def shuffled_pipeline(traced: bool, background: bool = False) -> Any:
    """Records -> buffered shuffle -> tokenize -> bucketed batches by length -> documents
    -> best-fit packing (behind a worker process if `background`) -> batches of 2
    sequences; plain or its traced twin."""
    reader: Any = traced_chunks(read_chunk, REFS) if traced else read_chunk
    records = chunked_dataset_iterator(REFS, reader, buffer_size=9, seed=3, shuffle=False)
    shuffled = it.BufferedShuffleIterator(records, 12, seed=5)
    tokens = it.MapIterator(shuffled, on_value(tokenize) if traced else tokenize)
    length: Any = of_value(len) if traced else len
    buckets = it.BucketedReadaheadBatchIterator(tokens, 10, key=length, batch_size=3, seed=6)
    documents = it.SelectManyIterator(buckets)
    packed: it.CheckpointableIterator[Any] = PackingIterator(
        documents, 16, strategy="best_fit", window=3, bos_id=BOS, eos_id=EOS, traced=traced
    )
    if background:
        packed = it.PrefetchIterator(packed, 4, snapshot_every=5)
    return it.MapIterator(it.FixedBatchIterator(packed, 2), collate_packed)


def check_step(origins: list[TokenOrigin], batch: Any) -> None:
    """The ranges cover every real token; those of known origin hold its tokens."""
    assert sum(origin.end - origin.start for origin in origins) == int(batch.loss_mask.sum())
    for origin in origins:
        if origin.chunk == UNKNOWN:
            continue
        document = [BOS, *tokenize(CHUNKS[origin.chunk_ref][origin.record]), EOS]
        tokens = batch.tokens[origin.sequence, origin.start : origin.end].tolist()
        assert tokens == document[origin.offset : origin.offset + origin.end - origin.start]


def test_a_log_of_a_plain_run_explains_steps_through_a_buffered_shuffle() -> None:
    """The shuffle's buffer, in the snapshots, holds plain records: their origins come
    from an earlier snapshot's replay."""
    training, log = shuffled_pipeline(traced=False), LineageLog(every=4)
    log.after_step(-1, training)
    batches = []
    for step, batch in zip(range(30), training, strict=False):
        batches.append(batch)
        log.after_step(step, training)
    assert [at for at, _ in log.snapshots] == [0, 4, 8, 12, 16, 20, 24, 28]
    saved = LineageLog.from_snapshots(json.loads(json.dumps(log.snapshots)), every=4)
    twin = shuffled_pipeline(traced=True)
    held = 0
    for step in (3, 13, 22, 29):
        at, state = log.snapshots[step // 4]
        from_latest = explain(twin, state, step - at, REFS)
        held += any(origin.chunk == UNKNOWN for origin in from_latest)
        explained = saved.explain(twin, step, REFS)
        assert all(origin.chunk != UNKNOWN for origin in explained)
        check_step(explained, batches[step])
    assert held >= 2  # records from the buffer: the log went back further


def test_explain_names_the_ranges_of_records_held_in_the_checkpoint_as_unknown() -> None:
    training = shuffled_pipeline(traced=False)
    for _ in range(10):
        next(training)
    state = json.loads(json.dumps(training.getstate()))
    step_11 = [next(training), next(training)][1]
    explained = explain(shuffled_pipeline(traced=True), state, 1, REFS)
    held = [origin for origin in explained if origin.chunk == UNKNOWN]
    assert held
    assert all(origin.record == UNKNOWN for origin in held)
    assert str(held[0]).endswith(f"a record held in the checkpoint, from token {held[0].offset}")
    check_step(explained, step_11)


def test_a_log_kept_across_a_restore_explains_steps_on_both_sides_behind_a_worker() -> None:
    first, log = shuffled_pipeline(traced=False, background=True), LineageLog(every=5)
    log.after_step(-1, first)
    batches = []
    for step in range(12):
        batches.append(next(first))
        log.after_step(step, first)
    checkpoint = json.loads(json.dumps({"data": first.getstate(), "lineage": log.snapshots}))
    first.close()  # a crash after step 11; the run resumes from the checkpoint
    resumed = shuffled_pipeline(traced=False, background=True)
    resumed.setstate(checkpoint["data"])
    log = LineageLog.from_snapshots(checkpoint["lineage"], every=5)
    for step in range(12, 24):
        batches.append(next(resumed))
        log.after_step(step, resumed)
    resumed.close()
    assert [at for at, _ in log.snapshots] == [0, 5, 10, 15, 20]
    with shuffled_pipeline(traced=True, background=True) as twin:
        for step in (4, 11, 17, 23):
            explained = log.explain(twin, step, REFS)
            assert all(origin.chunk != UNKNOWN for origin in explained)
            check_step(explained, batches[step])


def test_lineage_log_arguments_and_saved_snapshots_are_checked() -> None:
    with pytest.raises(ValueError, match="LineageLog: every must be"):
        LineageLog(every=0)
    with pytest.raises(ValueError, match=r"from_snapshots: expected \[step, state\] pairs"):
        LineageLog.from_snapshots([{"step": 3}])
    with pytest.raises(ValueError, match=r"LineageLog\.explain: step must be >= 0"):
        LineageLog().explain(traced_pipeline(), -1)
