"""PackingIterator: packed streams against plain reference packers, the per-token fields,
exact resumes from any point (states without tokens, bounded re-reads), sharded and
background use."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from collections import defaultdict
from itertools import islice, pairwise
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _items import packed_lists
from _profiles import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import infinibatch_like.iterators as it
from infinibatch_like import PackingIterator, StateMismatchError
from infinibatch_like._core.protocol import GATHERED_FORMAT
from infinibatch_like.distributed import restore_state
from infinibatch_like.distributed.elastic import elastic_state
from infinibatch_like.distributed.sharded import ShardedIterator
from infinibatch_like.testing import assert_checkpointable, check_resume

PROPERTY = settings(max_examples=examples(0.8), suppress_health_check=[HealthCheck.too_slow])

documents = st.lists(st.lists(st.integers(1, 999), max_size=40), max_size=60)
options = st.fixed_dictionaries(
    {
        "long_documents": st.sampled_from(["split", "truncate"]),
        "bos_id": st.sampled_from([None, 1000]),
        "eos_id": st.sampled_from([None, 1001]),
    }
)


def as_lists(sequence: Any) -> dict[str, list[Any]]:
    return {key: value.tolist() for key, value in sequence.items()}


def same_sequences(a: Any, b: Any) -> bool:
    return as_lists(a) == as_lists(b)


def packer(docs: list[Any], seq_len: int, **kwargs: Any) -> PackingIterator:
    return PackingIterator(it.NativeCheckpointableIterator(docs), seq_len, **kwargs)


def framed(doc: list[int], seq_len: int, kwargs: dict[str, Any]) -> list[int]:
    """A document as the packer reads it: BOS/EOS added, truncated if asked."""
    bos, eos = kwargs.get("bos_id"), kwargs.get("eos_id")
    tokens = ([bos] if bos is not None else []) + doc + ([eos] if eos is not None else [])
    if kwargs.get("long_documents") == "truncate":
        tokens = tokens[:seq_len]
    return tokens


def pieces_of(sequence: dict[str, list[Any]]) -> list[list[int]]:
    """The document pieces of a packed sequence, by its cu_seqlens (padding left out)."""
    bounds, tokens, segments = sequence["cu_seqlens"], sequence["tokens"], sequence["segment_ids"]
    return [tokens[a:b] for a, b in pairwise(bounds) if segments[a] > 0]


def check_fields(sequence: dict[str, list[Any]], seq_len: int, pad_id: int) -> None:
    """segment ids, positions, loss mask and cu_seqlens agree with each other."""
    tokens, segments = sequence["tokens"], sequence["segment_ids"]
    bounds = sequence["cu_seqlens"]
    assert len(tokens) == seq_len
    assert bounds[0] == 0
    assert bounds[-1] == seq_len
    assert all(a < b for a, b in pairwise(bounds))
    fill = sum(1 for segment in segments if segment > 0)
    assert segments[:fill] == sorted(segments[:fill])
    assert 0 not in segments[:fill]
    assert all(segment == 0 for segment in segments[fill:])
    assert all(token == pad_id for token in tokens[fill:])
    assert sequence["loss_mask"] == [segment > 0 for segment in segments]
    for number, (a, b) in enumerate(pairwise(bounds), 1):
        assert sequence["positions"][a:b] == list(range(b - a))
        assert set(segments[a:b]) == ({number} if a < fill else {0})


# -- what is packed ---------------------------------------------------------------------------


@PROPERTY
@given(docs=documents, seq_len=st.integers(1, 24), kwargs=options)
def test_concat_cuts_the_concatenated_documents_every_seq_len_tokens(
    docs: list[list[int]], seq_len: int, kwargs: dict[str, Any]
) -> None:
    framed_docs = [framed(doc, seq_len, kwargs) for doc in docs]
    stream = [token for doc in framed_docs for token in doc]
    got = [as_lists(sequence) for sequence in packer(docs, seq_len, pad_id=7, **kwargs)]
    expected = [stream[start : start + seq_len] for start in range(0, len(stream), seq_len)]
    if expected:
        expected[-1] = expected[-1] + [7] * (seq_len - len(expected[-1]))
    assert [sequence["tokens"] for sequence in got] == expected
    # the pieces are the documents cut at the sequence boundaries
    boundaries, position = set(), 0
    for doc in framed_docs:
        position += len(doc)
        boundaries.add(position)
    cuts = sorted({*boundaries, *range(seq_len, len(stream), seq_len)} - {0})
    pieces = [piece for sequence in got for piece in pieces_of(sequence)]
    assert pieces == [stream[a:b] for a, b in zip([0, *cuts], cuts, strict=False) if b > a]
    for sequence in got:
        check_fields(sequence, seq_len, 7)


def reference_best_fit(docs: list[list[int]], seq_len: int, window: int) -> list[list[list[int]]]:
    """A plain best-fit packer: each sequence as its list of pieces, in yield order."""
    open_: list[dict[str, Any]] = []  # in order of opening
    done: list[list[list[int]]] = []
    finished = 0

    def finish(entry: dict[str, Any]) -> None:
        nonlocal finished
        open_.remove(entry)
        done.append(entry["pieces"])
        finished += 1

    for doc in docs:
        rest = doc
        while len(rest) >= seq_len:
            done.append([rest[:seq_len]])
            finished += 1
            rest = rest[seq_len:]
        if rest:
            fits = [entry for entry in open_ if seq_len - entry["fill"] >= len(rest)]
            if fits:
                target = min(fits, key=lambda entry: seq_len - entry["fill"])
            else:
                if len(open_) == window:
                    finish(open_[0])
                target = {"fill": 0, "pieces": [], "born": finished}
                open_.append(target)
            target["pieces"].append(rest)
            target["fill"] += len(rest)
            if target["fill"] == seq_len:
                finish(target)
        while open_ and finished - open_[0]["born"] > 4 * window:
            finish(open_[0])
    for entry in list(open_):
        finish(entry)
    return done


@PROPERTY
@given(docs=documents, seq_len=st.integers(1, 24), window=st.integers(1, 5), kwargs=options)
def test_best_fit_matches_a_plain_best_fit_packer(
    docs: list[list[int]], seq_len: int, window: int, kwargs: dict[str, Any]
) -> None:
    framed_docs = [framed(doc, seq_len, kwargs) for doc in docs]
    got = [
        as_lists(sequence)
        for sequence in packer(docs, seq_len, strategy="best_fit", window=window, **kwargs)
    ]
    assert [pieces_of(sequence) for sequence in got] == reference_best_fit(
        framed_docs, seq_len, window
    )
    for sequence in got:
        check_fields(sequence, seq_len, 0)


def test_best_fit_keeps_documents_that_fit_whole_and_pads_less_than_a_window_of_one() -> None:
    rng = np.random.default_rng(3)
    docs = [rng.integers(1, 50, size) for size in rng.integers(1, 60, 400)]
    narrow = [as_lists(s) for s in packer(docs, 64, strategy="best_fit", window=1)]
    wide = [as_lists(s) for s in packer(docs, 64, strategy="best_fit", window=8)]
    whole = sorted(tuple(piece) for sequence in wide for piece in pieces_of(sequence))
    assert whole == sorted(tuple(doc.tolist()) for doc in docs)
    assert len(wide) < len(narrow)


def test_numpy_documents_of_any_int_dtype_pack_like_lists() -> None:
    docs = [[5, 6, 7], [8], [9, 10, 11, 12, 13]]
    arrays = [
        np.asarray(doc, dtype=dtype)
        for doc, dtype in zip(docs, ["int32", "uint16", "int64"], strict=False)
    ]
    expected = [as_lists(s) for s in packer(docs, 4, bos_id=1)]
    assert [as_lists(s) for s in packer(arrays, 4, bos_id=1)] == expected
    assert expected[0]["tokens"] == [1, 5, 6, 7]


def test_fields_of_one_sequence() -> None:
    (first,) = packer([[11, 12, 13], [21, 22]], 7, strategy="best_fit", pad_id=9)
    assert as_lists(first) == {
        "tokens": [11, 12, 13, 21, 22, 9, 9],
        "segment_ids": [1, 1, 1, 2, 2, 0, 0],
        "positions": [0, 1, 2, 0, 1, 0, 1],
        "loss_mask": [True] * 5 + [False] * 2,
        "cu_seqlens": [0, 3, 5, 7],
    }
    assert first["tokens"].dtype == np.int64
    assert first["cu_seqlens"].dtype == np.int32


# -- exact resume -----------------------------------------------------------------------------


def lognormal_docs(count: int, median: int, seed: int) -> list[Any]:
    rng = np.random.default_rng(seed)
    sizes = np.maximum(1, rng.lognormal(np.log(median), 1.0, count)).astype(int)
    return [rng.integers(2, 30000, size) for size in sizes]


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"strategy": "best_fit", "window": 4},
        {"strategy": "best_fit", "window": 2, "long_documents": "truncate", "eos_id": 1},
    ],
    ids=["concat", "best-fit", "best-fit-truncate"],
)
def test_random_checkpoints_resume_the_next_fifty_sequences(kwargs: dict[str, Any]) -> None:
    """200 random checkpoints here (bench/bench_packing.py --resume-check runs 1,000)."""
    docs = lognormal_docs(1200, 12, seed=1)
    pipeline = packer(docs, 32, **kwargs)
    states, reference = [], []
    for sequence in pipeline:
        states.append(json.dumps(pipeline.getstate()))
        reference.append(as_lists(sequence))
    assert len(reference) > 300
    rng = random.Random(5)
    for point in rng.sample(range(len(reference)), 200):
        fresh = packer(docs, 32, **kwargs)
        fresh.setstate(json.loads(states[point]))
        got = [as_lists(sequence) for sequence in islice(fresh, 50)]
        assert got == reference[point + 1 : point + 51], point


@settings(max_examples=examples(0.4), suppress_health_check=[HealthCheck.too_slow])
@given(
    docs=documents,
    seq_len=st.integers(1, 16),
    strategy=st.sampled_from(["concat", "best_fit"]),
    kwargs=options,
    data=st.data(),
)
def test_a_restore_at_any_point_continues_the_uninterrupted_stream(
    docs: list[list[int]], seq_len: int, strategy: str, kwargs: dict[str, Any], data: Any
) -> None:
    window = {"window": data.draw(st.integers(1, 4))} if strategy == "best_fit" else {}
    build = lambda: packer(docs, seq_len, strategy=strategy, **window, **kwargs)  # noqa: E731
    reference = [as_lists(sequence) for sequence in build()]
    point = data.draw(st.integers(0, len(reference)))
    interrupted = build()
    list(islice(interrupted, point))
    state = json.loads(json.dumps(interrupted.getstate()))
    fresh = build()
    fresh.setstate(state)
    assert fresh.getstate() == state
    assert [as_lists(sequence) for sequence in fresh] == reference[point:]


def test_checkpoints_do_not_change_the_packing_or_its_padding() -> None:
    docs = lognormal_docs(1500, 300, seed=2)
    plain = [as_lists(s) for s in packer(docs, 2048, strategy="best_fit", window=8)]
    pipeline = packer(docs, 2048, strategy="best_fit", window=8)
    checkpointed = []
    for sequence in pipeline:
        checkpointed.append(as_lists(sequence))
        pipeline.setstate(json.loads(json.dumps(pipeline.getstate())))
    assert checkpointed == plain

    def padding(sequences: list[dict[str, Any]]) -> float:
        return 1 - sum(sum(s["loss_mask"]) for s in sequences) / (2048 * len(sequences))

    assert padding(checkpointed) == padding(plain) < 0.02


def test_the_state_holds_no_tokens_and_stays_under_4_kb_for_seq_len_8192() -> None:
    rng = np.random.default_rng(4)
    docs = [rng.integers(2, 50000, size) for size in rng.integers(4200, 8000, 400)]
    pipeline = packer(docs, 8192, strategy="best_fit", window=128)
    largest, most_open = 0, 0
    for _ in pipeline:
        state = pipeline.getstate()
        most_open = max(most_open, len(state["fills"]))
        del state["source"]
        largest = max(largest, len(json.dumps(state)))
    assert most_open == 128
    assert largest <= 4096


class Counted:
    """Counts the tokens of the documents read through it."""

    def __init__(self) -> None:
        self.tokens = 0

    def __call__(self, doc: Any) -> Any:
        self.tokens += len(doc)
        return doc


@pytest.mark.parametrize(
    ("kwargs", "bound"),
    [({}, 2), ({"strategy": "best_fit", "window": 3}, 6 * 3 + 2)],
    ids=["concat", "best-fit"],
)
def test_a_restore_re_reads_a_bounded_number_of_sequences(
    kwargs: dict[str, Any], bound: int
) -> None:
    docs = lognormal_docs(700, 20, seed=6)
    longest = max(len(doc) for doc in docs)
    seq_len = 64

    def build(counter: Counted) -> PackingIterator:
        source = it.MapIterator(it.NativeCheckpointableIterator(docs), counter)
        return PackingIterator(source, seq_len, **kwargs)

    pipeline = build(Counted())
    states = [pipeline.getstate() for _ in iter(lambda: next(pipeline, None), None)]
    most = 0
    for state in states:
        counter = Counted()
        build(counter).setstate(state)
        most = max(most, counter.tokens)
    assert 0 < most <= bound * seq_len + longest


# -- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"seq_len": 0}, ValueError, "PackingIterator: seq_len must be >= 1, got 0"),
        ({"strategy": "greedy"}, ValueError, "strategy must be one of ('concat', 'best_fit')"),
        ({"window": 4}, ValueError, "window applies to strategy='best_fit' only"),
        ({"strategy": "best_fit", "window": 129}, ValueError, "window must be <= 128"),
        ({"strategy": "best_fit", "window": 0}, ValueError, "window must be >= 1"),
        ({"long_documents": "drop"}, ValueError, "long_documents must be one of"),
        ({"pad_id": -1}, ValueError, "pad_id must be >= 0"),
        ({"eos_id": "2"}, TypeError, "eos_id must be an int"),
    ],
)
def test_bad_arguments_are_refused_by_name(
    kwargs: dict[str, Any], error: type, message: str
) -> None:
    arguments = {"seq_len": 8, **kwargs}
    with pytest.raises(error, match=re_escaped(message)):
        PackingIterator(it.NativeCheckpointableIterator([]), **arguments)


def re_escaped(text: str) -> str:
    import re

    return re.escape(text)


@pytest.mark.parametrize("bad", [[1.5, 2.0], [[1, 2], [3, 4]], ["a"], [[1], [2, 3]], 7])
def test_a_document_that_is_not_a_flat_list_of_ints_is_refused(bad: Any) -> None:
    pipeline = packer([[1, 2], bad], 4)
    with pytest.raises(
        TypeError, match="PackingIterator: a document must be a flat sequence of ints"
    ):
        list(pipeline)


def test_damaged_states_are_refused_naming_the_field() -> None:
    docs = lognormal_docs(300, 10, seed=7)
    pipeline = packer(docs, 16, strategy="best_fit", window=3)
    list(islice(pipeline, 20))
    state = pipeline.getstate()
    cases = {
        "fills": ({"fills": [16]}, "state field 'fills[0]' must be between 1 and seq_len - 1=15, "
                  "got 16"),
        "ages": ({"ages": [99] * len(state["fills"])}, "state field 'ages[0]' must be between 0 "
                 "and 12, got 99"),
        "read": ({"read": 10**12}, "state field 'read' must be <= "),
        "yielded": ({"yielded": state["yielded"] + 5000}, "the checkpoint skips"),
    }
    more = {
        "fills": ({"fills": [1, 2, 3, 4]}, "state field 'fills' holds 4 items, expected at most 3"),
        "ages": ({"ages": [0] * (len(state["fills"]) + 1)}, "state field 'ages' holds "
                 f"{len(state['fills']) + 1} items, expected {len(state['fills'])} (one per fill)"),
        "yielded": ({"yielded": 2**20 + 1}, "state field 'yielded' must be between 0 and 1048576"),
    }
    for field, (change, message) in more.items():
        with pytest.raises(StateMismatchError, match=re_escaped(message)):
            packer(docs, 16, strategy="best_fit", window=3).setstate({**state, **change})
        assert field in change
    for field, (change, message) in cases.items():
        with pytest.raises(StateMismatchError, match=re_escaped(message)):
            packer(docs, 16, strategy="best_fit", window=3).setstate({**state, **change})
        assert field in change
    with pytest.raises(StateMismatchError, match="seq_len=16, this stage has seq_len=32"):
        packer(docs, 32, strategy="best_fit", window=3).setstate(state)


# -- the checkpoint contract, shards, workers -----------------------------------------------


@pytest.mark.parametrize(
    "kwargs", [{}, {"strategy": "best_fit", "window": 3, "bos_id": 1, "eos_id": 2}]
)
def test_packing_is_checkpointable(kwargs: dict[str, Any]) -> None:
    docs = lognormal_docs(200, 6, seed=8)
    assert_checkpointable(
        lambda: it.MapIterator(packer(docs, 12, **kwargs), packed_lists),
        different=lambda: it.MapIterator(packer(docs, 12, pad_id=3), packed_lists),
    )
    check_resume(lambda: packer(docs, 12, **kwargs), same=same_sequences)


def test_packing_resumes_exactly_behind_a_worker_process() -> None:
    docs = lognormal_docs(300, 8, seed=9)
    check_resume(
        lambda: it.PrefetchIterator(
            packer(docs, 16, strategy="best_fit", window=2), 4, snapshot_every=5
        ),
        max_items=120,
        restore_points=4,
        same=same_sequences,
        check_torch=False,
    )


SHARD_DOCS = lognormal_docs(600, 10, seed=10)


def packed_shard(shard: int, num_shards: int) -> it.CheckpointableIterator[Any]:
    docs = [doc + 100_000 * shard for doc in SHARD_DOCS[shard::num_shards]]
    source = it.InfinitePermutationSourceIterator(docs, seed=shard)
    return it.MapIterator(PackingIterator(source, 24, strategy="best_fit", window=3), packed_lists)


def shard_of(item: tuple[list[Any], ...]) -> int:
    return int(item[0][0]) // 100_000


def test_packing_inside_shards_continues_the_same_on_another_number_of_ranks() -> None:
    shards, per_shard = 4, 15
    reference: dict[int, list[Any]] = defaultdict(list)
    single = ShardedIterator(packed_shard, shards, 0, 1)
    for item in islice(single, 4 * 60):
        reference[shard_of(item)].append(item)
    old = [ShardedIterator(packed_shard, shards, rank, 2) for rank in range(2)]
    for rank, pipeline in enumerate(old):
        list(islice(pipeline, 6 + 5 * rank))
    states = [pipeline.getstate() for pipeline in old]
    start = {shard: count for pipeline in old for shard, count in pipeline.delivered.items()}
    for new, workers in ((1, 0), (3, 0), (4, 0), (1, 2)):
        seen: dict[int, list[Any]] = defaultdict(list)
        for rank in range(new):
            pipeline = ShardedIterator(packed_shard, shards, rank, new, workers=workers)
            pipeline.setstate(elastic_state(pipeline, states, rank, new))
            for item in islice(pipeline, per_shard * len(pipeline.shards)):
                seen[shard_of(item)].append(item)
            pipeline.close()
        for shard in range(shards):
            assert seen[shard] == reference[shard][start[shard] : start[shard] + per_shard]


def test_without_numpy_the_package_imports_and_the_packer_names_the_extra() -> None:
    code = textwrap.dedent(
        """
        import sys
        sys.modules["numpy"] = None  # as if it were not installed
        import infinibatch_like
        try:
            infinibatch_like.PackingIterator(infinibatch_like.NativeCheckpointableIterator([]), 8)
        except ModuleNotFoundError as error:
            print(error)
        """
    )
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert "infinibatch_like.PackingIterator needs the package 'numpy'" in result.stdout
    assert "pip install 'infinibatch_like[torch]'" in result.stdout


CHUNKS = [
    [
        " ".join(f"w{(chunk * 7 + line * 3 + word) % 50}" for word in range(line % 23))
        for line in range(30)
    ]
    for chunk in range(6)
]


def word_ids(line: str) -> list[int]:
    return [int(word[1:]) + 3 for word in line.split()]


def test_a_chunked_shuffled_tokenized_mixed_packed_batched_pipeline_resumes_exactly() -> None:
    from infinibatch_like import TokenBudgetMultiplexIterator
    from infinibatch_like.datasets import chunked_dataset_iterator

    def build() -> it.CheckpointableIterator[Any]:
        sources = [
            it.MapIterator(
                chunked_dataset_iterator(chunks, CHUNKS.__getitem__, buffer_size=17, seed=seed),
                word_ids,
            )
            for seed, chunks in enumerate([[0, 1, 2], [3, 4, 5]])
        ]
        mixed = TokenBudgetMultiplexIterator(sources, [2, 1])
        packed = PackingIterator(mixed, 32, strategy="best_fit", window=4, bos_id=1, eos_id=2)
        return it.MapIterator(it.FixedBatchIterator(packed, 3), packed_batch)

    check_resume(build, max_items=40, restore_points=6, check_torch=False)


def packed_batch(sequences: list[Any]) -> list[tuple[list[Any], ...]]:
    return [packed_lists(sequence) for sequence in sequences]


def test_packing_above_a_sharded_iterator_cannot_resume_on_another_number_of_ranks() -> None:
    def outer(rank: int, world_size: int) -> PackingIterator:
        sharded = ShardedIterator(packed_documents, 4, rank, world_size)
        return PackingIterator(sharded, 16)

    states = [outer(rank, 2).getstate() for rank in range(2)]
    gathered = {"format": GATHERED_FORMAT, "world_size": 2, "ranks": states}
    with pytest.raises(
        ValueError,
        match=r"PackingIterator cannot be elastic \(its open sequences hold this rank's "
        r"documents\); build the rank-dependent part of the pipeline as a ShardedIterator",
    ):
        restore_state(outer(0, 1), gathered)


def packed_documents(shard: int, num_shards: int) -> it.CheckpointableIterator[Any]:
    return it.NativeCheckpointableIterator(SHARD_DOCS[shard::num_shards])
