"""The PyTorch adapters: CheckpointableDataset with DataLoaders, and pad_batch.

DataLoader tests start worker processes (about a second each), so they are few and small:
one uninterrupted reference run is shared by the resume tests.
"""

from __future__ import annotations

import functools
import io
import json
import multiprocessing
import pickle
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _profiles import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from infinibatch_like import StateMismatchError
from infinibatch_like.datasets import chunked_dataset_iterator
from infinibatch_like.iterators import (
    BucketedReadaheadBatchIterator,
    CheckpointableIterator,
    FixedBatchIterator,
    MapIterator,
    ParallelMapIterator,
    PrefetchIterator,
)
from infinibatch_like.torch import (
    CheckpointableDataset,
    PaddedArrays,
    PaddedArraysNoMask,
    PaddedTensors,
    PaddedTensorsNoMask,
    pad_batch,
    padder,
    reader_identity,
)

REPO = Path(__file__).resolve().parents[2]
PROPERTY = settings(max_examples=examples(1.5))
# torchdata 0.11 calls a torch function that torch 2.13 deprecates: not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")

# A corpus of 8 chunks of variable-length integer sequences (a stand-in for token ids).
CHUNKS = [
    tuple(tuple([chunk * 100 + line] * (1 + (chunk * 7 + line) % 6)) for line in range(12))
    for chunk in range(8)
]
ALL_SEQUENCES = [sequence for chunk in CHUNKS for sequence in chunk]


def tokens_per_batch(longest: tuple[int, ...]) -> int:
    return max(1, 12 // len(longest))


def training_pipeline(instance_rank: int, num_instances: int) -> CheckpointableIterator[Any]:
    """Infinite, shuffled, bucketed batches of this reader's share of CHUNKS."""
    sequences = chunked_dataset_iterator(
        CHUNKS,
        list,
        buffer_size=10,
        seed=3,
        num_instances=num_instances,
        instance_rank=instance_rank,
    )
    return BucketedReadaheadBatchIterator(
        sequences, read_ahead=9, key=len, batch_size=tokens_per_batch, seed=4
    )


def tagged(instance_rank: int, sequence: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
    return instance_rank, sequence


def evaluation_pipeline(instance_rank: int, num_instances: int) -> CheckpointableIterator[Any]:
    """One ordered pass over this reader's chunks, each item tagged with the reader."""
    sequences = chunked_dataset_iterator(
        CHUNKS,
        list,
        buffer_size=10,
        train=False,
        shuffle=False,
        num_instances=num_instances,
        instance_rank=instance_rank,
    )
    return MapIterator(sequences, functools.partial(tagged, instance_rank))


COLLATE = padder(to="torch", pad_value=-1)
STEPS, CUT = 14, 5


def stateful_loader(
    dataset: CheckpointableDataset[Any], num_workers: int, **options: Any
) -> StatefulDataLoader:
    return StatefulDataLoader(
        dataset, batch_size=None, num_workers=num_workers, collate_fn=COLLATE, **options
    )


def rows(loader: Iterator[PaddedTensors], count: int) -> list[list[list[int]]]:
    return [batch.values.tolist() for batch in islice(loader, count)]


def through_torch_save(state: Any) -> Any:
    """What `torch.load(..., weights_only=True)` gives back for a `torch.save`d state."""
    buffer = io.BytesIO()
    torch.save({"model": {"weight": torch.ones(2)}, "data": state}, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)["data"]


@pytest.fixture(scope="module")
def reference() -> list[list[list[int]]]:
    """STEPS batches of an uninterrupted StatefulDataLoader run with 2 workers."""
    return rows(iter(stateful_loader(CheckpointableDataset(training_pipeline), 2)), STEPS)


# -- imports ---------------------------------------------------------------------------------


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=False
    )


def test_the_package_never_imports_torch() -> None:
    proc = _python(
        "import sys, infinibatch_like, infinibatch_like.iterators, infinibatch_like.datasets\n"
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    assert proc.returncode == 0, proc.stderr


def test_numpy_padding_works_without_torch() -> None:
    proc = _python(
        "import sys\n"
        "sys.modules['torch'] = None  # any import of torch now fails\n"
        "from infinibatch_like.torch import pad_batch\n"
        "values, lengths, mask = pad_batch([[1, 2], [3]], pad_value=9)\n"
        "assert values.tolist() == [[1, 2], [3, 9]], values\n"
        "try:\n"
        "    from infinibatch_like.torch import CheckpointableDataset\n"
        "except ImportError:\n"
        "    print('needs torch')\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert "needs torch" in proc.stdout


# -- readers ---------------------------------------------------------------------------------


def test_each_worker_of_each_rank_is_its_own_reader() -> None:
    assert reader_identity(0, 1, 0, 1) == (0, 1)
    assert [reader_identity(1, 3, worker, 2) for worker in range(2)] == [(2, 6), (3, 6)]
    dataset = CheckpointableDataset(training_pipeline, rank=2, world_size=3)
    assert (dataset.rank, dataset.world_size) == (2, 3)
    assert dataset.current_reader() == (2, 3)  # the main process is the only reader


def test_rank_and_world_size_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert CheckpointableDataset(training_pipeline).current_reader() == (1, 4)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    assert CheckpointableDataset(training_pipeline).current_reader() == (0, 1)


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ({"rank": 1}, ValueError, "give rank and world_size together"),
        ({"rank": 2, "world_size": 2}, ValueError, "rank=2, world_size=2"),
        ({"rank": -1, "world_size": 2}, ValueError, "rank must be >= 0"),
        ({"rank": 0, "world_size": "2"}, TypeError, "world_size must be an int"),
    ],
)
def test_bad_rank_arguments(arguments: dict[str, Any], error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        CheckpointableDataset(training_pipeline, **arguments)


def test_factory_must_be_callable_and_build_an_iterator() -> None:
    with pytest.raises(TypeError, match="factory must be callable"):
        CheckpointableDataset([1, 2])  # type: ignore[arg-type]
    dataset = CheckpointableDataset(lambda rank, count: iter([rank]))  # type: ignore[arg-type,return-value]
    with pytest.raises(TypeError, match=r"factory\(0, 1\) must return a CheckpointableIterator"):
        iter(dataset)


def test_workers_and_ranks_read_disjoint_shares_covering_the_corpus() -> None:
    seen: list[tuple[int, tuple[int, ...]]] = []
    for rank in range(2):
        dataset = CheckpointableDataset(evaluation_pipeline, rank=rank, world_size=2)
        seen += DataLoader(dataset, batch_size=None, num_workers=2)
    by_reader = Counter(reader for reader, _ in seen)
    assert sorted(by_reader) == [0, 1, 2, 3]  # rank r, worker w: reader 2r + w of 4
    assert Counter(tuple(sequence) for _, sequence in seen) == Counter(ALL_SEQUENCES)


def test_every_iter_starts_a_new_pass_and_closes_the_previous_one() -> None:
    dataset = CheckpointableDataset(evaluation_pipeline)
    first = iter(dataset)
    assert [sequence for _, sequence in first] == ALL_SEQUENCES
    second = iter(dataset)
    with pytest.raises(RuntimeError, match="closed"):
        next(first)
    assert next(second) == (0, ALL_SEQUENCES[0])


# -- resuming with torchdata's StatefulDataLoader ---------------------------------------------


@pytest.mark.parametrize("snapshot_every_n_steps", [1, 3])
def test_stateful_dataloader_with_workers_resumes_exactly(
    reference: list[list[list[int]]], snapshot_every_n_steps: int
) -> None:
    interrupted = stateful_loader(
        CheckpointableDataset(training_pipeline),
        2,
        snapshot_every_n_steps=snapshot_every_n_steps,
    )
    batches = iter(interrupted)
    assert rows(batches, CUT) == reference[:CUT]
    state = through_torch_save(interrupted.state_dict())
    assert json.loads(json.dumps(state)) == state  # plain data all through
    worker_states = state["_snapshot"]["_worker_snapshots"]
    dataset_states = [worker_states[key]["dataset_state"] for key in sorted(worker_states)]
    assert [(s["instance_rank"], s["num_instances"]) for s in dataset_states] == [(0, 2), (1, 2)]
    main_process_reader = CheckpointableDataset(training_pipeline)
    main_process_reader.load_state_dict(dataset_states[1])
    with pytest.raises(StateMismatchError, match="belongs to reader 1 of 2, this is reader 0 of 1"):
        iter(main_process_reader)

    resumed = stateful_loader(CheckpointableDataset(training_pipeline), 2)
    resumed.load_state_dict(state)
    assert rows(iter(resumed), STEPS - CUT) == reference[CUT:]


def test_stateful_dataloader_without_workers_resumes_exactly() -> None:
    single = functools.partial(stateful_loader, num_workers=0)
    uninterrupted = rows(iter(single(CheckpointableDataset(training_pipeline))), STEPS)
    interrupted = single(CheckpointableDataset(training_pipeline))
    assert rows(iter(interrupted), CUT) == uninterrupted[:CUT]
    resumed = single(CheckpointableDataset(training_pipeline))
    resumed.load_state_dict(through_torch_save(interrupted.state_dict()))
    assert rows(iter(resumed), STEPS - CUT) == uninterrupted[CUT:]


def test_a_state_of_another_reader_is_refused() -> None:
    # (Checked in the main process: torch takes seconds to stop workers whose iter() raised.)
    single = CheckpointableDataset(training_pipeline)
    next(iter(single))
    two_ranks = CheckpointableDataset(training_pipeline, rank=1, world_size=2)
    two_ranks.load_state_dict(single.state_dict())
    with pytest.raises(StateMismatchError, match="belongs to reader 0 of 1, this is reader 1 of 2"):
        iter(two_ranks)
    with pytest.raises(RuntimeError, match="no pipeline"):
        two_ranks.state_dict()  # the refused state is gone


def test_workers_started_with_spawn_resume_exactly(reference: list[list[list[int]]]) -> None:
    # Under spawn the dataset, with its loaded state, is pickled into each worker.
    interrupted = stateful_loader(CheckpointableDataset(training_pipeline), 2)
    rows(iter(interrupted), CUT)
    resumed = stateful_loader(
        CheckpointableDataset(training_pipeline), 2, multiprocessing_context="spawn"
    )
    resumed.load_state_dict(interrupted.state_dict())
    assert rows(iter(resumed), 3) == reference[CUT : CUT + 3]


# -- the plain torch DataLoader ----------------------------------------------------------------


def test_plain_dataloader_without_workers_resumes_from_the_dataset_state() -> None:
    def loader(dataset: CheckpointableDataset[Any]) -> Iterator[PaddedTensors]:
        return iter(DataLoader(dataset, batch_size=None, num_workers=0, collate_fn=COLLATE))

    uninterrupted = rows(loader(CheckpointableDataset(training_pipeline)), STEPS)
    dataset = CheckpointableDataset(training_pipeline)
    assert rows(loader(dataset), CUT) == uninterrupted[:CUT]
    state = through_torch_save(dataset.state_dict())
    assert json.loads(json.dumps(state)) == state
    assert (state["kind"], state["instance_rank"], state["num_instances"]) == (
        "CheckpointableDataset",
        0,
        1,
    )

    fresh = CheckpointableDataset(training_pipeline)
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state  # until the pipeline is built, the loaded state
    assert rows(loader(fresh), STEPS - CUT) == uninterrupted[CUT:]


def test_plain_dataloader_with_workers_cannot_be_checkpointed() -> None:
    dataset = CheckpointableDataset(training_pipeline)
    loader = DataLoader(dataset, batch_size=None, num_workers=2, collate_fn=COLLATE)
    assert len(rows(iter(loader), 3)) == 3
    # The readers live in the worker processes; the main process has no position to save.
    with pytest.raises(RuntimeError, match="StatefulDataLoader"):
        dataset.state_dict()


def test_a_pickled_dataset_carries_its_loaded_state_but_no_pipeline() -> None:
    dataset = CheckpointableDataset(training_pipeline)
    batches = iter(dataset)
    next(batches)
    state = dataset.state_dict()
    expected = list(islice(batches, 3))
    copy = pickle.loads(pickle.dumps(dataset))
    with pytest.raises(RuntimeError, match="no pipeline"):
        copy.state_dict()
    copy.load_state_dict(state)
    assert list(islice(iter(pickle.loads(pickle.dumps(copy))), 3)) == expected


def test_keys_added_to_a_dataset_state_by_the_caller_are_ignored() -> None:
    dataset = CheckpointableDataset(training_pipeline)
    batches = iter(dataset)
    next(batches)
    state = {**dataset.state_dict(), "epoch": 2, "iterations_in_epoch": 1}
    expected = list(islice(batches, 3))
    resumed = CheckpointableDataset(training_pipeline)
    resumed.load_state_dict(state)
    assert list(islice(iter(resumed), 3)) == expected


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ([1], "expected a dict, got list"),
        ({"stage": "FixedBatchIterator"}, "expected a state of CheckpointableDataset"),
        ({"kind": "CheckpointableDataset", "pipeline": {}},
         r"the state lacks the fields \['instance_rank', 'num_instances'\]"),
        (
            {
                "kind": "CheckpointableDataset",
                "instance_rank": "0",
                "num_instances": 1,
                "pipeline": {},
            },
            "state field 'instance_rank' has type str, expected int: '0'",
        ),
        (
            {
                "kind": "CheckpointableDataset",
                "instance_rank": 0,
                "num_instances": 1,
                "pipeline": None,
            },
            "state field 'pipeline' has type NoneType, expected dict: None",
        ),
        (
            {
                "kind": "CheckpointableDataset",
                "instance_rank": 0,
                "num_instances": 0,
                "pipeline": {},
            },
            "state field 'num_instances' must be >= 1, got 0",
        ),
    ],
)
def test_load_state_dict_refuses_malformed_states(state: Any, message: str) -> None:
    with pytest.raises(StateMismatchError, match=message):
        CheckpointableDataset(training_pipeline).load_state_dict(state)


def test_a_state_of_another_pipeline_names_the_stage_path() -> None:
    other = CheckpointableDataset(
        lambda rank, count: FixedBatchIterator(training_pipeline(rank, count), 2)
    )
    next(iter(other))
    dataset = CheckpointableDataset(training_pipeline)
    dataset.load_state_dict(other.state_dict())
    with pytest.raises(StateMismatchError, match=r"CheckpointableDataset.pipeline > Bucketed"):
        iter(dataset)


# -- pad_batch -----------------------------------------------------------------------------------

sequences = st.lists(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=7), min_size=1, max_size=6)


def check_padded(padded: PaddedArrays, items: list[list[int]], pad_value: int, width: int) -> None:
    values, lengths, mask = padded
    assert mask is not None
    assert values.shape == (len(items), width)
    assert mask.shape == values.shape
    assert lengths.dtype == np.int64
    assert mask.dtype == np.bool_
    assert lengths.tolist() == [min(len(item), width) for item in items]
    assert (mask == (np.arange(width)[None, :] < lengths[:, None])).all()
    for row, item in enumerate(items):
        assert values[row, : lengths[row]].tolist() == item[:width]
    assert (values[~mask] == pad_value).all()


@PROPERTY
@given(items=sequences, pad_value=st.integers(-5, 5), dtype=st.sampled_from(["int64", "float32"]))
def test_padding_keeps_items_and_fills_the_rest(
    items: list[list[int]], pad_value: int, dtype: str
) -> None:
    items = [[value % 1000 for value in item] for item in items]  # exact in float32 too
    padded = pad_batch(items, pad_value=pad_value, dtype=dtype)
    assert padded.values.dtype == np.dtype(dtype)
    check_padded(padded, items, pad_value, max(len(item) for item in items))


@PROPERTY
@given(items=sequences, max_length=st.integers(1, 8), fixed=st.booleans())
def test_truncating_and_fixed_width(items: list[list[int]], max_length: int, fixed: bool) -> None:
    padding = "max_length" if fixed else "longest"
    padded = pad_batch(items, max_length=max_length, truncate=True, padding=padding)
    width = max_length if fixed else min(max_length, max(len(item) for item in items))
    check_padded(padded, items, 0, width)
    if max(len(item) for item in items) > max_length:
        with pytest.raises(ValueError, match=r"length \d+ > max_length=.*truncate=True"):
            pad_batch(items, max_length=max_length)


@settings(max_examples=examples(0.4))
@given(items=sequences, with_mask=st.booleans())
def test_tensors_equal_the_arrays(items: list[list[int]], with_mask: bool) -> None:
    arrays = pad_batch(items, pad_value=-1, with_mask=with_mask)
    tensors = pad_batch(items, pad_value=-1, with_mask=with_mask, to="torch")
    assert isinstance(arrays, PaddedArrays if with_mask else PaddedArraysNoMask)
    assert isinstance(tensors, PaddedTensors if with_mask else PaddedTensorsNoMask)
    assert tensors.values.dtype == torch.from_numpy(arrays.values).dtype  # int64 or float64
    assert tensors.values.tolist() == arrays.values.tolist()
    assert tensors.lengths.tolist() == arrays.lengths.tolist()
    if with_mask:
        assert tensors.mask is not None
        assert arrays.mask is not None
        assert tensors.mask.tolist() == arrays.mask.tolist()
    else:
        assert tensors.mask is None
        assert arrays.mask is None
    for tensor in (tensors.values, tensors.lengths):
        assert tensor.device.type == "cpu"
        assert tensor.is_contiguous()


def test_items_with_element_axes_numpy_and_tensor_inputs() -> None:
    items = [np.ones((3, 2)), torch.zeros(1, 2), np.empty((0, 2))]
    values, lengths, mask = pad_batch(items, pad_value=7.5, dtype=torch.float16, to="torch")
    assert values.shape == (3, 3, 2)
    assert values.dtype == torch.float16
    assert lengths.tolist() == [3, 1, 0]
    assert mask is not None
    assert mask.sum().item() == 4
    assert values[1, 0].tolist() == [0, 0]
    assert values[1, 1:].eq(7.5).all()
    assert pad_batch([[], [1.5]]).values.tolist() == [[0.0], [1.5]]


def test_dtypes_numpy_lacks_are_padded_in_float32_then_converted() -> None:
    values = pad_batch([[1, 2], [3]], dtype=torch.bfloat16, to="torch", pad_value=0.5).values
    assert values.dtype == torch.bfloat16
    assert values.tolist() == [[1.0, 2.0], [3.0, 0.5]]


def test_integer_items_fit_narrower_integer_dtypes_when_in_range() -> None:
    assert pad_batch([[255, 0]], dtype=np.uint8).values.dtype == np.uint8
    with pytest.raises(ValueError, match=r"items\[1\] holds values in \[0, 256\].*uint8"):
        pad_batch([[1], [0, 256]], dtype="uint8")


@pytest.mark.parametrize(
    ("items", "options", "error", "message"),
    [
        ([], {}, ValueError, r"items is empty: .* make a batch of one pad item such as "
         r"\[\[pad_value\]\] and weight its loss 0"),
        ("abc", {}, TypeError, "items must be a sequence"),
        ([[1, 2], [[1], [2, 3]]], {}, ValueError, r"items\[1\] cannot be read as a rectangular"),
        ([[1], ["a", "b"]], {}, TypeError, r"items\[1\] must hold numbers"),
        ([[1], [None]], {}, TypeError, r"items\[1\] must hold numbers"),
        ([[1], 5], {}, ValueError, r"items\[1\] must be a sequence"),
        ([np.ones((2, 3)), np.ones((1, 4))], {}, ValueError, r"items\[1\] has elements of shape"),
        ([[1.5]], {"dtype": "int64"}, TypeError, r"items\[0\] holds float64 values"),
        ([[1]], {"pad_value": 0.5}, ValueError, "pad_value 0.5 does not fit dtype int64"),
        ([[1]], {"pad_value": -1, "dtype": "uint8"}, ValueError, "pad_value -1 does not fit"),
        ([[1]], {"pad_value": "0"}, TypeError, "pad_value must be an int, float or bool"),
        ([[1]], {"to": "jax"}, ValueError, "to must be 'numpy' or 'torch'"),
        ([[1]], {"padding": "max_length"}, ValueError, "padding='max_length' needs max_length"),
        ([[1]], {"padding": "all"}, ValueError, "padding must be 'longest' or 'max_length'"),
        ([[1]], {"max_length": 0}, ValueError, "max_length must be >= 1"),
        ([[1]], {"dtype": torch.int64}, TypeError, "numpy dtype for to='numpy'"),
        ([[1]], {"dtype": "int64", "to": "torch"}, TypeError, "torch.dtype for to='torch'"),
        ([[1]], {"dtype": "U3"}, TypeError, "dtype must be numeric"),
    ],
)
def test_bad_input_is_named(items: Any, options: dict[str, Any], error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        pad_batch(items, **options)


def test_padder_is_pad_batch_with_fixed_options() -> None:
    items = [[3, 4, 5], [6]]
    collate = pickle.loads(pickle.dumps(padder(to="torch", pad_value=-1, with_mask=False)))
    batch = collate(items)
    assert isinstance(batch, PaddedTensorsNoMask)
    assert batch.values.tolist() == [[3, 4, 5], [6, -1, -1]]
    assert batch.mask is None
    moved = batch.to("cpu")
    assert isinstance(moved, PaddedTensorsNoMask)
    assert moved.lengths.tolist() == [3, 1]
    assert moved.mask is None
    padded = padder(padding="max_length", max_length=4)(items)
    assert isinstance(padded, PaddedArrays)
    assert padded.mask.tolist() == [[True, True, True, False], [True, False, False, False]]


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"to": "jax"}, ValueError, "padder: to must be 'numpy' or 'torch', got 'jax'"),
        ({"pad_value": "0"}, TypeError, "padder: pad_value must be an int, float or bool"),
        ({"padding": "max_length"}, ValueError, "padder: padding='max_length' needs max_length"),
        ({"max_length": 0}, ValueError, "padder: max_length must be >= 1, got 0"),
        ({"pad_valu": 0}, TypeError, r"padder: unknown options \['pad_valu'\]"),
    ],
)
def test_padder_refuses_bad_options_at_once(
    options: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        padder(**options)


def test_padding_as_collate_fn_in_worker_processes() -> None:
    loader = DataLoader(
        CheckpointableDataset(training_pipeline),
        batch_size=None,
        num_workers=2,
        collate_fn=COLLATE,
        pin_memory=False,
    )
    batch = next(iter(loader))
    assert isinstance(batch, PaddedTensors)
    assert batch.values.device.type == "cpu"
    assert batch.values.is_contiguous()
    assert batch.to("cpu").values.tolist() == batch.values.tolist()
    if torch.cuda.is_available():  # pinning needs an accelerator
        pinned = batch.pin_memory()
        assert pinned.values.is_pinned()
        assert pinned.mask is not None
        assert pinned.mask.is_pinned()
        from torch.utils.data._utils.pin_memory import pin_memory

        assert pin_memory(batch).lengths.is_pinned()  # what DataLoader(pin_memory=True) calls


# -- background stages inside DataLoader workers (daemonic processes) --------------------------


def _same(item: Any) -> Any:
    return item


def in_the_background(
    kind: str, build: Any, instance_rank: int, num_instances: int
) -> CheckpointableIterator[Any]:
    """`build`'s pipeline behind a parallel map or a process prefetcher (same items).

    Their workers are forked (where possible) even inside spawned DataLoader workers, whose
    default start method is spawn: a spawned worker imports torch again (seconds each).
    """
    pipeline = build(instance_rank, num_instances)
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else None
    if kind == "parallel map":
        return ParallelMapIterator(pipeline, _same, 2, 2, snapshot_every=3, start_method=method)
    return PrefetchIterator(pipeline, 4, snapshot_every=3, start_method=method)


BACKGROUND_KINDS = ["parallel map", "prefetch"]


@pytest.mark.parametrize("kind", BACKGROUND_KINDS)
def test_background_stages_run_inside_dataloader_workers(kind: str) -> None:
    factory = functools.partial(in_the_background, kind, evaluation_pipeline)
    seen = list(DataLoader(CheckpointableDataset(factory), batch_size=None, num_workers=2))
    assert Counter(tuple(sequence) for _, sequence in seen) == Counter(ALL_SEQUENCES)
    assert sorted(Counter(reader for reader, _ in seen)) == [0, 1]


@pytest.mark.parametrize("kind", BACKGROUND_KINDS)
@pytest.mark.parametrize("context", [None, "spawn"])
def test_background_stages_in_stateful_dataloader_workers_resume_exactly(
    reference: list[list[list[int]]], kind: str, context: str | None
) -> None:
    factory = functools.partial(in_the_background, kind, training_pipeline)
    options = {"multiprocessing_context": context}
    interrupted = stateful_loader(CheckpointableDataset(factory), 2, **options)
    assert rows(iter(interrupted), CUT) == reference[:CUT]
    state = through_torch_save(interrupted.state_dict())
    resumed = stateful_loader(CheckpointableDataset(factory), 2, **options)
    resumed.load_state_dict(state)
    assert rows(iter(resumed), STEPS - CUT) == reference[CUT:]
