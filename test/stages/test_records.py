"""Bad records: on_error=SkipPolicy skips failing records deterministically, within a budget,
keeps a bounded ledger in the state, and leaves the default ("raise") unchanged."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from _profiles import examples
from _streams import roundtrip
from hypothesis import given, settings
from hypothesis import strategies as st

import infinibatch_like.distributed.ranks as distributed
import infinibatch_like.iterators as it
from infinibatch_like import StateMismatchError
from infinibatch_like.datasets import chunked_dataset_iterator
from infinibatch_like.distributed import EqualLengthIterator
from infinibatch_like.stages.bad_records import (
    DEFAULT_SKIP_POLICY,
    ParsedRecords,
    SkipBudgetExceeded,
    SkipPolicy,
    skip_ledgers,
)


class Parse:
    """``int(x) * 10``, raising ValueError on the items in `bad`."""

    def __init__(self, bad: set[int]) -> None:
        self.bad = bad

    def __call__(self, x: int) -> int:
        if x in self.bad:
            raise ValueError(f"bad item {x}")
        return x * 10


def model(n: int, bad: set[int], policy: SkipPolicy) -> tuple[list[int], int | None]:
    """The outputs of a skipping map over range(n), and the item it gives up on (or None)."""
    out: list[int] = []
    windows: dict[int, int] = {}
    for x in range(n):
        if x in bad:
            window = 0 if policy.per_items is None else x // policy.per_items
            windows[window] = windows.get(window, 0) + 1
            if windows[window] > policy.max_skips:
                return out, x
            continue
        out.append(x * 10)
    return out, None


def drain(pipeline: Iterator[Any]) -> tuple[list[Any], BaseException | None]:
    out: list[Any] = []
    try:
        for item in pipeline:
            out.append(item)
    except SkipBudgetExceeded as error:
        return out, error
    return out, None


policies = st.builds(
    lambda m, n, keep: SkipPolicy(m, None if n is None else m + n, keep),
    st.integers(0, 3),
    st.one_of(st.none(), st.integers(1, 8)),
    st.integers(0, 4),
)


@settings(max_examples=examples(0.6))
@given(
    n=st.integers(0, 40),
    bad=st.sets(st.integers(0, 39), max_size=12),
    policy=policies,
    point=st.integers(0, 40),
)
def test_map_skips_exactly_the_failing_items_and_restores_the_same(
    n: int, bad: set[int], policy: SkipPolicy, point: int
) -> None:
    def build() -> it.MapIterator[int]:
        return it.MapIterator(it.NativeCheckpointableIterator(list(range(n))), Parse(bad),
                              on_error=policy)

    expected, gives_up_at = model(n, bad, policy)
    out, error = drain(build())
    assert out == expected
    assert (error is None) == (gives_up_at is None)
    if error is not None:
        assert isinstance(error.__cause__, ValueError)
        assert f"bad item {gives_up_at}" in str(error)
    # A restore at any point skips the same items, with the same ledger at the end.
    first = build()
    taken = [next(first) for _ in range(min(point, len(expected)))]
    state = roundtrip(first.getstate())
    again = build()
    again.setstate(state)
    rest, error_again = drain(again)
    assert taken + rest == expected
    assert (error_again is None) == (error is None)
    if error is None:
        assert again.skip_ledger.records == len([x for x in bad if x < n])
        assert len(again.skip_ledger.last) == min(policy.keep_last, again.skip_ledger.records)
        assert again.getstate() == roundtrip(drain_state(build()))


def drain_state(pipeline: it.MapIterator[int]) -> dict[str, Any]:
    drain(pipeline)
    return pipeline.getstate()


def test_ledger_entries_name_stage_position_error_and_message() -> None:
    pipeline = it.MapIterator(it.NativeCheckpointableIterator(list(range(10))), Parse({2, 7}),
                              on_error=SkipPolicy(max_skips=1, per_items=5, keep_last=8))
    assert list(pipeline) == [x * 10 for x in range(10) if x not in (2, 7)]
    ledger = pipeline.skip_ledger
    assert (ledger.stage, ledger.records, ledger.chunks) == ("MapIterator", 2, 0)
    assert ledger.last == [
        {"in_stage": "MapIterator", "kind": "item", "chunk": None, "position": 2,
         "error": "ValueError", "message": "bad item 2"},
        {"in_stage": "MapIterator", "kind": "item", "chunk": None, "position": 7,
         "error": "ValueError", "message": "bad item 7"},
    ]
    assert skip_ledgers(pipeline) == {"MapIterator": ledger}
    assert skip_ledgers(roundtrip(pipeline.getstate())) == {"MapIterator": ledger}


def test_budget_exceeded_names_stage_budget_and_last_errors_and_restores_to_raise_again() -> None:
    def build() -> it.MapIterator[int]:
        return it.MapIterator(it.NativeCheckpointableIterator(list(range(30))), Parse({1, 3, 12}),
                              on_error=SkipPolicy(max_skips=1, per_items=10))

    pipeline = build()
    with pytest.raises(SkipBudgetExceeded) as raised:
        list(pipeline)
    message = str(raised.value)
    assert message.startswith("MapIterator: more than 1 bad records in items 0..9, beyond its "
                              "budget on_error=SkipPolicy(max_skips=1, per_items=10")
    assert "the last errors: item 1: ValueError: bad item 1; item 3: ValueError: bad item 3" in (
        message)
    assert raised.value.stage == "MapIterator"
    assert len(raised.value.last) == 2
    # The state points at the item it gave up on: a restore meets it and gives up again.
    state = roundtrip(pipeline.getstate())
    assert state["skips"]["records"] == 1
    again = build()
    again.setstate(state)
    with pytest.raises(SkipBudgetExceeded, match="bad item 3"):
        next(again)


def test_skipped_is_a_deprecated_name_of_the_skip_ledger() -> None:
    """``stage.skipped`` (a ledger here, a count on `SkipIterator`) still answers, with a
    DeprecationWarning naming `skip_ledger`."""
    pipeline = it.MapIterator(it.NativeCheckpointableIterator([1, 2, 3]), Parse({2}),
                              on_error="skip")  # fmt: skip
    assert list(pipeline) == [10, 30]
    with pytest.warns(DeprecationWarning, match=r"MapIterator\.skipped is deprecated; use "
                      r"\.skip_ledger"):  # fmt: skip
        ledger = pipeline.skipped
    assert ledger == pipeline.skip_ledger
    assert ledger.records == 1


def test_default_raise_is_unchanged_and_bad_on_error_values_are_refused() -> None:
    plain = it.MapIterator(it.NativeCheckpointableIterator([1, 2]), Parse({2}))
    assert next(plain) == 10
    assert "skips" not in plain.getstate()
    with pytest.raises(ValueError, match="bad item 2"):
        next(plain)
    assert plain.skip_ledger.records == 0
    assert plain.skip_ledger.last == []
    with pytest.raises(TypeError, match=r"MapIterator: on_error must be 'raise', 'skip' \(that "
                       r"is SkipPolicy\(max_skips=10, per_items=10000, keep_last=32\)\) or a "
                       r"SkipPolicy, got 'ignore'"):
        it.MapIterator(it.NativeCheckpointableIterator([1]), Parse(set()), on_error="ignore")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="SelectManyIterator: on_error must be"):
        it.SelectManyIterator(it.NativeCheckpointableIterator([[1]]), on_error=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ParallelMapIterator: on_error must be"):
        it.ParallelMapIterator(it.NativeCheckpointableIterator([1]), str, 1, 1, on_error=3)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"max_skips": -1}, ValueError, "SkipPolicy: max_skips must be >= 0, got -1"),
        ({"max_skips": 1.5}, TypeError, "SkipPolicy: max_skips must be an int, got 1.5"),
        ({"max_skips": 0, "per_items": 0}, ValueError, "per_items must be >= 1, got 0"),
        ({"max_skips": 5, "per_items": 5}, ValueError,
         "max_skips=5 must be < per_items=5 (a budget allowing every item"),
        ({"max_skips": 1, "keep_last": True}, TypeError, "keep_last must be an int, got True"),
    ],
)
def test_skip_policy_refuses_bad_arguments(
    kwargs: dict[str, Any], error: type, message: str
) -> None:
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        SkipPolicy(**kwargs)


def test_on_error_may_change_at_a_restart_and_damaged_ledgers_are_refused() -> None:
    source = list(range(20))
    raising = it.MapIterator(it.NativeCheckpointableIterator(source), Parse({5}))
    for _ in range(3):
        next(raising)
    state = raising.getstate()  # taken before the crash on item 5
    skipping = it.MapIterator(it.NativeCheckpointableIterator(source), Parse({5}),
                              on_error=SkipPolicy(1))
    skipping.setstate(state)
    assert list(skipping) == [x * 10 for x in range(3, 20) if x != 5]
    assert skipping.skip_ledger.last[0]["position"] == 2  # counted from the restore point
    damaged = skipping.getstate()
    damaged["skips"]["last"][0]["position"] = "two"
    with pytest.raises(StateMismatchError, match=r"MapIterator: state field "
                       r"'skips\.last\[0\]\.position' has type str, expected int: 'two'"):
        it.MapIterator(it.NativeCheckpointableIterator(source), Parse({5}),
                       on_error=SkipPolicy(1)).setstate(damaged)
    damaged = skipping.getstate()
    damaged["skips"]["in_window"] = 2
    with pytest.raises(StateMismatchError, match="2 failures in window 0 after 17 items"):
        it.MapIterator(it.NativeCheckpointableIterator(source), Parse({5}),
                       on_error=SkipPolicy(1)).setstate(damaged)


# -- chunk readers ----------------------------------------------------------------------------

LINES = {
    "a.jsonl": ['{"x": 1}', '{"x": 2}', "{oops", '{"x": 4}'],
    "b.jsonl": ['{"x": 5}', '{"x": 6}'],
    "missing.jsonl": None,
    "c.jsonl": ["{bad", '{"x": 8}'],
    "d.jsonl": ["{bad"],
}


class JsonLines:
    """Parses a chunk's lines one by one; a bad line raises and the next one is read."""

    def __init__(self, lines: list[str]) -> None:
        self.lines = iter(lines)

    def __iter__(self) -> JsonLines:
        return self

    def __next__(self) -> int:
        value: int = json.loads(next(self.lines))["x"]
        return value


def read_json_lines(name: str) -> JsonLines:
    lines = LINES[name]
    if lines is None:
        raise FileNotFoundError(f"no such chunk: {name}")
    return JsonLines(lines)


def read_with_generator(name: str) -> Iterator[int]:
    lines = LINES[name]
    if lines is None:
        raise FileNotFoundError(f"no such chunk: {name}")
    for line in lines:
        yield json.loads(line)["x"]


EIGHT = SkipPolicy(3, 8)


@pytest.mark.parametrize("read_ahead", [0, 2])
def test_chunk_reader_skips_bad_records_and_unreadable_chunks_the_same_after_restores(
    read_ahead: int,
) -> None:
    def build(
        reader: Callable[[str], Any] = read_json_lines, policy: SkipPolicy = EIGHT
    ) -> it.SelectManyIterator:
        return it.SelectManyIterator(it.NativeCheckpointableIterator(list(LINES)), reader,
                                     read_ahead=read_ahead, on_error=policy)

    pipeline = build()
    assert list(pipeline) == [1, 2, 4, 5, 6, 8]
    ledger = pipeline.skip_ledger
    assert (ledger.records, ledger.chunks) == (2, 2)
    assert ledger.per_chunk == {"'a.jsonl'": 1, "'missing.jsonl'": 1, "'c.jsonl'": 1,
                                "'d.jsonl'": 1}
    assert [(e["kind"], e["chunk"], e["position"], e["error"]) for e in ledger.last] == [
        ("record", "'a.jsonl'", 2, "JSONDecodeError"),
        ("chunk", "'missing.jsonl'", 0, "FileNotFoundError"),
        ("record", "'c.jsonl'", 0, "JSONDecodeError"),
        ("chunk", "'d.jsonl'", 0, "JSONDecodeError"),
    ]
    assert ledger.last[1]["message"] == "no such chunk: missing.jsonl"
    final = pipeline.getstate()
    for point in range(7):
        first = build()
        taken = [next(first) for _ in range(point)]
        again = build()
        again.setstate(roundtrip(first.getstate()))
        assert taken + list(again) == [1, 2, 4, 5, 6, 8]
        assert again.getstate() == final
    # A generator reader ends at its first error: the rest of that chunk is not read.
    generated = build(read_with_generator, SkipPolicy(4, 8))
    assert list(generated) == [1, 2, 5, 6]
    assert [(e["kind"], e["chunk"]) for e in generated.skip_ledger.last] == [
        ("record", "'a.jsonl'"), ("chunk", "'missing.jsonl'"), ("chunk", "'c.jsonl'"),
        ("chunk", "'d.jsonl'"),
    ]


def test_chunk_reader_budget_exceeded_points_at_the_failing_record() -> None:
    def build() -> it.SelectManyIterator:
        return it.SelectManyIterator(it.NativeCheckpointableIterator(list(LINES)),
                                     read_json_lines, on_error=SkipPolicy(1))

    pipeline = build()
    out, error = drain(pipeline)
    assert out == [1, 2, 4, 5, 6]
    assert error is not None
    assert "SelectManyIterator: more than 1 bad records in the run" in str(
        error)
    assert "chunk 'missing.jsonl' (whole chunk): FileNotFoundError" in str(error)
    again = build()
    again.setstate(roundtrip(pipeline.getstate()))
    with pytest.raises(SkipBudgetExceeded, match=r"missing\.jsonl"):
        next(again)


@pytest.mark.parametrize("read_ahead", [0, 2])
@pytest.mark.parametrize(
    ("policy", "before", "cause"),
    [(SkipPolicy(0), [1, 2], json.JSONDecodeError),
     (SkipPolicy(1), [1, 2, 4, 5, 6], FileNotFoundError)],
)
def test_chunk_reader_budget_exceeded_is_raised_from_the_reading_error(
    read_ahead: int, policy: SkipPolicy, before: list[int], cause: type[Exception]
) -> None:
    pipeline = it.SelectManyIterator(it.NativeCheckpointableIterator(list(LINES)),
                                     read_json_lines, read_ahead=read_ahead, on_error=policy)
    out, error = drain(pipeline)
    assert out == before
    assert isinstance(error, SkipBudgetExceeded)
    assert type(error.__cause__) is cause
    assert str(error).endswith(f"{cause.__name__}: {error.__cause__}")


@pytest.mark.parametrize("read_ahead", [0, 2])
def test_chunk_reader_restored_after_a_source_error_repeats_no_record(read_ahead: int) -> None:
    def build() -> it.SelectManyIterator:
        names = it.MapIterator(it.NativeCheckpointableIterator(["a.jsonl", "b.jsonl", "oops"]),
                               lambda name: LINES[name] and name)
        return it.SelectManyIterator(names, read_json_lines, read_ahead=read_ahead,
                                     on_error=SkipPolicy(3, 8))

    pipeline = build()
    taken = [next(pipeline) for _ in range(5)]
    with pytest.raises(KeyError, match="oops"):
        next(pipeline)
    assert taken == [1, 2, 4, 5, 6]
    again = build()
    again.setstate(roundtrip(pipeline.getstate()))
    with pytest.raises(KeyError, match="oops"):  # where it failed: nothing read twice
        next(again)
    assert again.getstate() == pipeline.getstate()
    assert again.getstate()["skips"]["seen"] == 6


def test_chunk_reader_that_fails_forever_ends_within_the_budget() -> None:
    class Broken:
        def __iter__(self) -> Broken:
            return self

        def __next__(self) -> int:
            raise OSError("disk error")

    pipeline = it.SelectManyIterator(it.NativeCheckpointableIterator([0]), lambda _: Broken(),
                                     read_ahead=1, on_error=SkipPolicy(2, 10))
    with pytest.raises(SkipBudgetExceeded, match="OSError: disk error"):
        next(pipeline)


def read_lines(name: str) -> list[str]:
    return [line for line in LINES[name] or ()]


def parse_line(line: str) -> int:
    value: int = json.loads(line)["x"]
    return value


def test_chunked_dataset_iterator_passes_on_error_down_through_a_worker_process() -> None:
    def build() -> Any:
        return chunked_dataset_iterator(
            [name for name in LINES if LINES[name] is not None], read_lines, buffer_size=3,
            seed=1, prefetch=True, transform=parse_line, on_error=SkipPolicy(5, 10),
        )

    with build() as pipeline:
        items = [next(pipeline) for _ in range(12)]
        state = roundtrip(pipeline.getstate())
        later = [next(pipeline) for _ in range(12)]
    assert set(items) <= {1, 2, 4, 5, 6, 8}
    ledgers = skip_ledgers(state)
    reader = (
        "MapIterator.source > PrefetchIterator.source > BlockwiseShuffleIterator.source > "
        "SelectManyIterator"
    )
    assert list(ledgers) == ["MapIterator", reader]
    assert ledgers[reader].records == 0  # the bad lines fail in the transform
    assert ledgers["MapIterator"].last[0]["error"] == "JSONDecodeError"
    with build() as again:
        again.setstate(state)
        assert [next(again) for _ in range(12)] == later


# -- parallel map --------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_parallel_map_skips_what_map_skips_also_for_worker_errors(mode: str) -> None:
    bad, policy = {3, 9, 10, 30}, SkipPolicy(2, 10, keep_last=2)
    reference = it.MapIterator(it.NativeCheckpointableIterator(list(range(40))), Parse(bad),
                               on_error=policy)
    expected = list(reference)

    def build(start_method: str | None = None) -> it.ParallelMapIterator:
        return it.ParallelMapIterator(it.NativeCheckpointableIterator(list(range(40))),
                                      Parse(bad), 2, 3, snapshot_every=4, mode=mode,
                                      start_method=start_method, on_error=policy)

    with build("spawn") as pipeline:  # the transform is wrapped, pickled, sent
        assert list(pipeline) == expected
        assert pipeline.skip_ledger.last == [
            {**entry, "in_stage": "ParallelMapIterator"} for entry in reference.skip_ledger.last
        ]
        assert pipeline.skip_ledger.records == 4
    with build() as first:
        taken = [next(first) for _ in range(13)]
        state = roundtrip(first.getstate())
    with build() as again:
        again.setstate(state)
        assert taken + list(again) == expected
    with it.ParallelMapIterator(it.NativeCheckpointableIterator(list(range(40))),
                                Parse(bad), 2, 3, mode=mode, on_error=SkipPolicy(1, 10)) as strict:
        out, error = drain(strict)
        assert out == [x * 10 for x in range(9) if x != 3]
        assert error is not None
        assert "ParallelMapIterator: more than 1 bad records in items 0..9" in str(error)
        with pytest.raises(RuntimeError) as refused:
            strict.getstate()
        assert str(refused.value) == lost_input_after(str(error))


# -- equal batch counts across ranks --------------------------------------------------------


class Ranks:
    """Two ranks on threads; the collective is an element-wise max (a barrier)."""

    def __init__(self, size: int) -> None:
        self.slots: list[list[int]] = [[] for _ in range(size)]
        self.barrier = threading.Barrier(size, timeout=10)

    def reduce(self, flags: list[int], rank: int) -> list[int]:
        self.slots[rank] = flags
        self.barrier.wait()
        result = [max(values) for values in zip(*self.slots, strict=True)]
        self.barrier.wait()
        return result


def test_ranks_still_yield_equal_batch_counts_when_one_rank_skips(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ranks = Ranks(2)
    monkeypatch.setattr(distributed, "all_reduce_max", lambda flags, rank: ranks.reduce(flags,
                                                                                         rank))
    bad = {0: set(), 1: {3, 4, 11, 15, 20}}  # rank 1 meets five bad records
    results: dict[int, Any] = {}

    def run(rank: int) -> None:
        records = it.MapIterator(
            it.NativeCheckpointableIterator(list(range(rank * 100, rank * 100 + 24))),
            Parse({rank * 100 + x for x in bad[rank]}), on_error=SkipPolicy(3, 12),
        )
        batches = EqualLengthIterator(it.FixedBatchIterator(records, 4), group=rank)  # type: ignore[arg-type]
        results[rank] = (list(batches), batches.counts, records.skip_ledger.records)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    (batches0, counts0, skipped0), (batches1, counts1, skipped1) = results[0], results[1]
    assert skipped0 == 0
    assert sum(len(batch) for batch in batches1[:5]) == 19  # five records skipped
    assert skipped1 == 2  # padding re-read the share from its start, meeting 103 and 104 again
    assert len(batches0) == len(batches1) == 6  # 24 items vs 19: rank 1 pads one batch
    assert counts0 == {"real": 6, "padded": 0, "dropped": 0}
    assert counts1 == {"real": 5, "padded": 1, "dropped": 0}
    assert batches1[5] == batches1[0]


def test_parsed_records_let_the_reader_skip_one_bad_line_and_name_it() -> None:
    chunks = {"p0": ['{"x": 1}', "oops", '{"x": 3}'], "p1": ['{"x": 4}', '{"x": "5"', "{}"]}

    def read(name: str) -> ParsedRecords[int]:
        return ParsedRecords(chunks[name], lambda line: json.loads(line)["x"])

    pipeline = it.SelectManyIterator(it.NativeCheckpointableIterator(list(chunks)), read,
                                     on_error=SkipPolicy(3, 6))
    assert list(pipeline) == [1, 3, 4]
    assert [(e["chunk"], e["position"], e["error"]) for e in pipeline.skip_ledger.last] == [
        ("'p0'", 1, "JSONDecodeError"), ("'p1'", 1, "JSONDecodeError"), ("'p1'", 2, "KeyError"),
    ]
    assert pipeline.skip_ledger.per_chunk == {"'p0'": 1, "'p1'": 2}


def test_chunked_dataset_iterator_names_itself_for_a_bad_on_error() -> None:
    with pytest.raises(TypeError, match="chunked_dataset_iterator: on_error must be 'raise', "
                       "'skip'"):
        chunked_dataset_iterator(["a"], read_lines, 4, on_error="ignore")  # type: ignore[arg-type]


def test_on_error_skip_is_the_default_policy_of_ten_in_ten_thousand() -> None:
    assert SkipPolicy(max_skips=10, per_items=10_000) == DEFAULT_SKIP_POLICY
    bad = {3, 9_999, 10_000, *range(20_000, 20_010)}
    pipeline = it.MapIterator(it.NativeCheckpointableIterator(range(30_000)), Parse(bad),
                              on_error="skip")
    assert list(pipeline) == [x * 10 for x in range(30_000) if x not in bad]
    assert pipeline.skip_ledger.records == len(bad)
    too_many = it.MapIterator(it.NativeCheckpointableIterator(range(30_000)),
                              Parse(set(range(100, 111))), on_error="skip")
    out, error = drain(too_many)
    assert out == [x * 10 for x in range(100)]
    assert "more than 10 bad records in items 0..9999, beyond its budget on_error=SkipPolicy(" \
        "max_skips=10, per_items=10000" in str(error)
    lines = {"a": ['{"x": 1}', "oops", '{"x": 3}']}
    chunks = chunked_dataset_iterator(
        list(lines), lambda name: ParsedRecords(lines[name], lambda line: json.loads(line)["x"]),
        4, train=False, shuffle=False, on_error="skip",
    )
    assert list(chunks) == [1, 3]
    assert [ledger.records for ledger in skip_ledgers(chunks).values()] == [1]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("seen", -1, r"state field 'skips\.seen' must be >= 0, got -1"),
        ("records", "1", r"state field 'skips\.records' has type str, expected int: '1'"),
        ("per_chunk", [["a"]], r"state field 'skips\.per_chunk\[0\]' must be a list of 2 items, "
                               r"got \['a'\]"),
        ("per_chunk", [["a", "b"]], r"state field 'skips\.per_chunk\[0\]\[1\]' has type str"),
        ("last", {}, r"state field 'skips\.last' must be a list, got dict"),
        ("last", [{"kind": "record"}], r"'skips\.last\[0\]' lacks the fields \['in_stage', "),
    ],
)
def test_damaged_ledgers_are_refused_naming_the_stage(
    field: str, value: Any, message: str
) -> None:
    def build() -> it.MapIterator[int]:
        return it.MapIterator(it.NativeCheckpointableIterator(list(range(9))), Parse({4}),
                              on_error=SkipPolicy(1))

    pipeline = build()
    for _ in range(5):
        next(pipeline)
    state = pipeline.getstate()
    state["skips"][field] = value
    with pytest.raises(StateMismatchError, match=f"at MapIterator: .*{message}"):
        build().setstate(state)
    with pytest.raises(StateMismatchError, match=message):
        skip_ledgers(state)


def lost_input_after(exceeded: str) -> str:
    """What getstate raises after a stage gave up on an item that its source cannot give back."""
    return (f"{exceeded}; the item it failed on is consumed from the source and the source "
            "cannot step back to it: the position after the error is not defined. Restore a "
            "checkpoint taken before the error (setstate) to continue")


def test_map_over_a_source_that_cannot_step_back_refuses_getstate_after_the_budget() -> None:
    source = it.ZipIterator(it.NativeCheckpointableIterator([1, 2, 3]))
    pipeline = it.MapIterator(source, lambda pair: Parse({2})(pair[0]), on_error=SkipPolicy(0))
    assert next(pipeline) == 10
    with pytest.raises(SkipBudgetExceeded) as raised:
        next(pipeline)
    assert str(raised.value).startswith("MapIterator: more than 0 bad records in the run")
    with pytest.raises(RuntimeError) as refused:
        pipeline.getstate()
    assert str(refused.value) == lost_input_after(str(raised.value))
