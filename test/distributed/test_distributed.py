"""Many ranks: rank discovery, one gathered checkpoint, equal-length finite passes.

The first part runs in this process (ranks simulated by threads that agree through a
stand-in for ``all_reduce``); the second launches real jobs with ``torchrun`` (gloo on
CPU, 2 and 3 ranks) running ``test/_torchrun_worker.py``, and a chain of elastic jobs on
2, 3, 2, 4 and 1 ranks, each killed mid-pass and resumed by the next, running
``test/_torchrun_elastic.py``.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from itertools import cycle, islice
from pathlib import Path
from typing import Any

import pytest
import torch
from _profiles import examples
from _ranks import Member, ThreadGroup, run_ranks
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

import infinibatch_like.distributed.ranks as distributed
import infinibatch_like.iterators as it
from infinibatch_like import StateMismatchError
from infinibatch_like._core.protocol import GATHERED_FORMAT
from infinibatch_like.datasets import chunked_dataset_iterator
from infinibatch_like.distributed import (
    EqualLengthIterator,
    gather_state,
    rank_and_world_size,
    restore_state,
)
from infinibatch_like.distributed.elastic import elastic_state
from infinibatch_like.distributed.sharded import ShardedIterator, owned_shards

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "test" / "_torchrun_worker.py"
ELASTIC_WORKER = REPO / "test" / "_torchrun_elastic.py"
DDP_WORKER = REPO / "test" / "_torchrun_ddp_padding.py"
LAUNCH_TIMEOUT_S = 120

# -- rank_and_world_size, gather_state and restore_state in one process -----------------


@pytest.fixture
def no_rank_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def test_rank_and_world_size_sources(no_rank_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    assert rank_and_world_size() == (0, 1)
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert rank_and_world_size() == (2, 3)
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(ValueError, match=r"need 0 <= \$RANK < \$WORLD_SIZE"):
        rank_and_world_size()
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ValueError, match=r"\$RANK must be an integer, got 'x'"):
        rank_and_world_size()
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="must be set together"):
        rank_and_world_size()


def test_gather_and_restore_with_one_rank(no_rank_env: None) -> None:
    pipeline = it.FixedBatchIterator(it.NativeCheckpointableIterator(list(range(50))), 4)
    next(pipeline)
    gathered = gather_state(pipeline)
    assert gathered == {
        "format": GATHERED_FORMAT,
        "world_size": 1,
        "ranks": [pipeline.getstate()],
    }
    expected = [next(pipeline) for _ in range(3)]
    buffer = io.BytesIO()
    torch.save({"data": gathered}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)["data"]
    fresh = it.FixedBatchIterator(it.NativeCheckpointableIterator(list(range(50))), 4)
    restore_state(fresh, loaded)
    assert [next(fresh) for _ in range(3)] == expected
    with pytest.raises(StateMismatchError, match="expected a state of MapIterator"):
        restore_state(it.MapIterator(fresh, str), loaded)


def test_restore_state_rejects_foreign_and_corrupt_checkpoints(no_rank_env: None) -> None:
    pipeline = it.NativeCheckpointableIterator([1, 2, 3])
    gathered = gather_state(pipeline)
    with pytest.raises(
        ValueError,
        match=r"gather_state \(with 'format'.*\), got one with keys "
        r"\['consumed', 'fingerprint', 'stage'\]",
    ):
        restore_state(pipeline, pipeline.getstate())
    with pytest.raises(ValueError, match="expected a dict made by gather_state, got list"):
        restore_state(pipeline, [gathered])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"corrupt: .* got world_size=2 and 1 states"):
        restore_state(pipeline, {**gathered, "world_size": 2})
    two_ranks = {**gathered, "world_size": 2, "ranks": gathered["ranks"] * 2}
    with pytest.raises(
        ValueError,
        match="states of 2 ranks, but this job has 1, and NativeCheckpointableIterator cannot",
    ):
        restore_state(pipeline, two_ranks)


def test_collectives_without_a_process_group_refuse_several_ranks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    pipeline = it.NativeCheckpointableIterator([1, 2, 3])
    message = "WORLD_SIZE is 2 but no torch.distributed process group is initialized"
    with pytest.raises(RuntimeError, match="gather_state: .*" + message):
        gather_state(pipeline)
    with pytest.raises(RuntimeError, match="EqualLengthIterator: .*" + message):
        next(EqualLengthIterator(pipeline))


def test_importing_the_package_does_not_import_torch() -> None:
    code = (
        "import sys, infinibatch_like, infinibatch_like.distributed.ranks as d, "
        "infinibatch_like.iterators; "
        "assert 'torch' not in sys.modules, 'torch imported'; "
        "assert d.rank_and_world_size() == (0, 1); print('ok')"
    )
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.stdout.strip() == "ok", proc.stderr


# -- EqualLengthIterator over simulated ranks ---------------------------------------------


@pytest.fixture
def thread_collectives(monkeypatch: pytest.MonkeyPatch) -> None:
    def reduce(flags: list[int], member: Member) -> list[int]:
        return member.group.reduce(member.rank, flags)

    monkeypatch.setattr(distributed, "all_reduce_max", reduce)


def shares_of(lengths: list[int]) -> list[list[str]]:
    return [[f"r{rank}-{index}" for index in range(n)] for rank, n in enumerate(lengths)]


def empty_batch() -> list[str]:
    return []


def wrapper(share: list[str], member: Any, policy: str, use_fill: bool) -> EqualLengthIterator[Any]:
    source = it.NativeCheckpointableIterator(share)
    return EqualLengthIterator(source, policy, fill=empty_batch if use_fill else None, group=member)


def drain(pipeline: EqualLengthIterator[Any]) -> Iterator[tuple[Any, bool, dict[str, Any]]]:
    """(item, is padding, state before the item) for each item; the end's state last."""
    while True:
        state = json.loads(json.dumps(pipeline.getstate()))
        try:
            item = next(pipeline)
        except StopIteration:
            yield None, False, state
            return
        yield item, pipeline.last_is_padding, state


EQUAL = settings(
    max_examples=examples(0.6),
    # The fixture only swaps the collective for a thread barrier: nothing to reset.
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@EQUAL
@given(
    lengths=st.lists(st.integers(0, 7), min_size=1, max_size=4),
    policy=st.sampled_from(["pad", "drop"]),
    use_fill=st.booleans(),
    data=st.data(),
)
def test_every_rank_yields_the_same_number_of_items_and_restores_exactly(
    thread_collectives: None,
    lengths: list[int],
    policy: str,
    use_fill: bool,
    data: st.DataObject,
) -> None:
    group, shares = ThreadGroup(len(lengths)), shares_of(lengths)

    def work(rank: int) -> tuple[list[Any], dict[str, int], str]:
        pipeline = wrapper(shares[rank], Member(group, rank), policy, use_fill)
        return list(drain(pipeline)), pipeline.counts, pipeline.getstate()["phase"]

    results = run_ranks(work, len(lengths))
    stuck = policy == "pad" and not use_fill and 0 in lengths and max(lengths) > 0
    if stuck:
        for result in results:
            assert isinstance(result, RuntimeError)
            assert "nothing to repeat as padding; pass fill=" in str(result)
        return
    steps = max(lengths) if policy == "pad" else min(lengths)
    for rank, (records, counts, phase) in enumerate(results):
        items = [item for item, _, _ in records[:-1]]
        padding = [is_padding for _, is_padding, _ in records[:-1]]
        share = shares[rank]
        assert len(items) == steps
        assert items[: len(share)] == share[:steps]
        assert padding == [index >= len(share) for index in range(steps)]
        if policy == "pad":
            missing = steps - len(share)
            pads: list[Any] = [[]] * missing if use_fill else list(islice(cycle(share), missing))
            assert items[len(share) :] == pads
        expected_counts = {
            "real": min(len(share), steps),
            "padded": max(0, steps - len(share)),
            "dropped": len(share) - steps if policy == "drop" else 0,
        }
        assert counts == expected_counts
        assert phase == "ended"

    # All ranks restored from the states of one step continue exactly.
    point = data.draw(st.integers(0, steps))
    again = ThreadGroup(len(lengths))

    def resume(rank: int) -> list[Any]:
        pipeline = wrapper(shares[rank], Member(again, rank), policy, use_fill)
        pipeline.setstate(results[rank][0][point][2])
        return list(drain(pipeline))

    for rank, records in enumerate(run_ranks(resume, len(lengths))):
        assert records == results[rank][0][point:]


def test_statistics_paths_name_real_attributes(no_rank_env: None) -> None:
    from infinibatch_like import stats

    pipeline = EqualLengthIterator(
        it.FixedBatchIterator(
            it.MapIterator(it.ZipIterator(it.NativeCheckpointableIterator([1, 2, 3]),
                                          it.NativeCheckpointableIterator("abc")), str),
            2,
        ),
        fill=list,
    )
    stats.enable(pipeline)
    assert len(list(pipeline)) == 2
    paths = [entry["path"] for entry in stats.collect(pipeline)]
    assert paths[-1] == (
        "EqualLengthIterator.source > FixedBatchIterator.source > MapIterator.source > "
        "ZipIterator.sources[1] > NativeCheckpointableIterator"
    )
    for path in paths:  # each step of a path is an attribute of the stage before it
        stage: Any = pipeline
        for step in path.split(" > ")[:-1]:
            attribute = step.split(".", 1)[1]
            name, _, index = attribute.partition("[")
            stage = getattr(stage, name)
            if index:
                stage = stage[int(index.rstrip("]"))]
        assert type(stage).__name__ == path.rsplit(" > ", 1)[-1]
    with pytest.raises(AttributeError, match="ZipIterator has 2 sources, not one: see its"):
        pipeline.source.source.source.source  # noqa: B018


def test_equal_length_iterator_rejects_bad_arguments_and_states() -> None:
    source = it.NativeCheckpointableIterator([1, 2])
    with pytest.raises(ValueError, match=r"EqualLengthIterator: policy must be one of"):
        EqualLengthIterator(source, "truncate")
    with pytest.raises(TypeError, match="EqualLengthIterator: fill must be callable, got 0"):
        EqualLengthIterator(source, fill=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="source_iterator must be a CheckpointableIterator"):
        EqualLengthIterator([1, 2])  # type: ignore[arg-type]
    state = EqualLengthIterator(source).getstate()
    with pytest.raises(
        StateMismatchError,
        match=r"state field 'phase' must be one of \['running', 'padding', 'ended'\], got 'paused'",
    ):
        EqualLengthIterator(source).setstate({**state, "phase": "paused"})
    with pytest.raises(StateMismatchError, match="state field 'padded' must be >= 0, got -1"):
        EqualLengthIterator(source).setstate({**state, "padded": -1})


# -- EqualLengthIterator over a ShardedIterator, resumed on another number of ranks ------


def equal_shards(corpus: list[list[str]], member: Any, policy: str, use_fill: bool) -> Any:
    """EqualLengthIterator over this rank's shards, each a finite shuffled pass (epochs=1)."""

    def shard(index: int, num_shards: int) -> Any:
        chunks = list(range(index, len(corpus), num_shards))
        if not chunks:  # chunked_dataset_iterator refuses an empty list of chunks
            return it.NativeCheckpointableIterator([])
        return chunked_dataset_iterator(chunks, corpus.__getitem__, 2, seed=index, epochs=1)

    rank, world_size = member.rank, member.group.size
    sharded = ShardedIterator(shard, EQUAL_SHARDS, rank, world_size)
    return EqualLengthIterator(sharded, policy, empty_batch if use_fill else None, member)


EQUAL_SHARDS = 5


def steps_of(pipeline: Any, count: int | None) -> list[tuple[Any, bool]]:
    """(item, is padding) of `count` steps (None: to the end)."""
    return [(item, pipeline.last_is_padding) for item in islice(pipeline, count)]


@settings(EQUAL, max_examples=examples(0.3))
@given(
    sizes=st.lists(st.integers(0, 4), min_size=1, max_size=9),
    old=st.integers(1, 4),
    new=st.integers(1, 4),
    cut=st.integers(0, 8),
    policy=st.sampled_from(["pad", "drop"]),
    use_fill=st.booleans(),
)
# New rank 0 takes shard 0, read to its end before the switch: it pads by repeating it.
@example(sizes=[1, 4], old=1, new=2, cut=2, policy="pad", use_fill=False)
def test_an_equal_length_pass_resumed_on_another_number_of_ranks(
    thread_collectives: None,
    sizes: list[int],
    old: int,
    new: int,
    cut: int,
    policy: str,
    use_fill: bool,
) -> None:
    corpus = [[f"c{chunk}-{line}" for line in range(size)] for chunk, size in enumerate(sizes)]
    old_group, new_group = ThreadGroup(old), ThreadGroup(new)

    def before(rank: int) -> tuple[list[tuple[Any, bool]], Any, dict[str, int]]:
        pipeline = equal_shards(corpus, Member(old_group, rank), policy, use_fill)
        steps = steps_of(pipeline, cut)
        state = json.loads(json.dumps(pipeline.getstate()))
        steps_of(pipeline, 2)  # lost in the "crash"
        return steps, state, pipeline.counts

    old_results = run_ranks(before, old)
    assume(not any(isinstance(result, Exception) for result in old_results))  # stuck before
    states = [state for _, state, _ in old_results]

    def after(rank: int) -> tuple[list[tuple[Any, bool]], dict[str, int]]:
        pipeline = equal_shards(corpus, Member(new_group, rank), policy, use_fill)
        pipeline.setstate(elastic_state(pipeline, states, rank, new))
        return steps_of(pipeline, None), pipeline.counts

    new_results = run_ranks(after, new)
    shares = [
        [
            item
            for shard in owned_shards(EQUAL_SHARDS, rank, new)
            for item in flat_shard(corpus, shard)
        ]
        for rank in range(new)
    ]
    real_before = [item for steps, _, _ in old_results for item, padding in steps if not padding]
    remaining = sorted(set(item for chunk in corpus for item in chunk) - set(real_before))
    left = [len([item for item in share if item in remaining]) for share in shares]
    if policy == "pad" and not use_fill and max(left) > 0 and min(map(len, shares)) == 0:
        for result in new_results:  # a new rank has nothing to repeat
            assert isinstance(result, RuntimeError), result
            assert "nothing to repeat as padding" in str(result)
        return
    assert not any(isinstance(result, Exception) for result in new_results), new_results
    lengths = {len(steps) for steps, _ in new_results}
    assert len(lengths) == 1, "every new rank takes the same number of steps"
    real_after = [item for steps, _ in new_results for item, padding in steps if not padding]
    dropped = sum(counts["dropped"] for _, counts in new_results)
    dropped += sum(state["dropped"] for state in states)  # a pass that had ended
    assert [counts["real"] for _, counts in new_results] == [
        sum(not padding for _, padding in steps) for steps, _ in new_results
    ]
    # Each real item of the pass exactly once, before or after (or dropped at the end).
    delivered = real_before + real_after
    assert len(delivered) == len(set(delivered))
    assert set(delivered) <= set(item for chunk in corpus for item in chunk)
    assert len(delivered) + dropped == sum(sizes)
    if policy == "pad":
        assert dropped == 0
        assert lengths == {max(left)} or all(state["phase"] == "ended" for state in states)
    for rank, (steps, _) in enumerate(new_results):  # items of the new share, or fill
        for item, padding in steps:
            assert item == [] if padding and use_fill else item in shares[rank]


def flat_shard(corpus: list[list[str]], shard: int) -> list[str]:
    return [item for chunk in corpus[shard::EQUAL_SHARDS] for item in chunk]


# -- real jobs under torchrun ---------------------------------------------------------------


def torchrun(
    ranks: int,
    mode: str,
    out: Path,
    worker: Path = WORKER,
    extra: tuple[str, ...] = (),
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """Launch `ranks` gloo workers on CPU (in `cwd`, default this process's); kill the
    whole job if it outlives the timeout."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={ranks}",
        str(worker),
        mode,
        str(out),
        *extra,
    ]
    with subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        cwd=cwd,
    ) as launcher:
        try:
            output, _ = launcher.communicate(timeout=LAUNCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            output = stop_job(launcher)
            pytest.fail(f"torchrun {mode} with {ranks} ranks hung:\n{output}")
        finally:
            if launcher.poll() is None:
                stop_job(launcher)
    return subprocess.CompletedProcess(command, launcher.returncode, output, "")


def stop_job(launcher: subprocess.Popen[str]) -> str:
    """Stop a torchrun job and its workers; the output so far.

    torchrun starts each worker in a session of its own, so a SIGKILL of torchrun's
    process group would leave the workers running (and holding the output pipe open).
    SIGTERM makes torchrun stop its workers first; SIGKILL is the last resort.
    """
    launcher.terminate()
    try:
        output, _ = launcher.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(launcher.pid, signal.SIGKILL)
        output, _ = launcher.communicate(timeout=30)
    return output


def results(out: Path, mode: str, ranks: int, proc: subprocess.CompletedProcess[str]) -> Any:
    files = [out / f"{mode}-rank{rank}.json" for rank in range(ranks)]
    missing = [path.name for path in files if not path.exists()]
    assert not missing, f"workers wrote no {missing}; exit {proc.returncode}:\n{proc.stdout}"
    return [json.loads(path.read_text()) for path in files]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Three launches: 2 ranks (checks, checkpoint, crash), 2 ranks (resume), 3 ranks."""
    out = tmp_path_factory.mktemp("torchrun")
    crashed = torchrun(2, "first", out)
    first = results(out, "first", 2, crashed)
    resumed_proc = torchrun(2, "resume", out)
    assert resumed_proc.returncode == 0, resumed_proc.stdout
    three_proc = torchrun(3, "three", out)
    assert three_proc.returncode == 0, three_proc.stdout
    return {
        "crashed": crashed,
        "first": first,
        "resume": results(out, "resume", 2, resumed_proc),
        "three": results(out, "three", 3, three_proc),
    }


@pytest.fixture(params=["first", "three"])
def job(request: pytest.FixtureRequest, jobs: dict[str, Any]) -> list[dict[str, Any]]:
    ranks: list[dict[str, Any]] = jobs[request.param]
    return ranks


@pytest.mark.slow
def test_ranks_see_their_own_rank_and_world_size(job: list[dict[str, Any]]) -> None:
    assert [rank["rank_and_world_size"] for rank in job] == [
        [rank, len(job)] for rank in range(len(job))
    ]


@pytest.mark.slow
def test_training_ranks_read_disjoint_data_covering_every_chunk(
    job: list[dict[str, Any]],
) -> None:
    corpus = job[0]["train_corpus"]
    for pass_index in range(2):
        seen = [item for rank in job for item in rank["train_passes"][pass_index]]
        assert sorted(seen) == sorted(corpus), f"pass {pass_index}"
        assert len(set(seen)) == len(seen)


@pytest.mark.slow
def test_eval_ranks_cover_the_corpus_once_in_rank_order(job: list[dict[str, Any]]) -> None:
    corpus = job[0]["eval_corpus"]
    assert [item for rank in job for item in rank["eval_items"]] == corpus


@pytest.mark.slow
def test_eval_passes_have_equal_lengths_on_every_rank(job: list[dict[str, Any]]) -> None:
    corpus = job[0]["eval_corpus"]
    for policy in ("pad", "drop"):
        lengths = {len(rank[f"equal_{policy}"]["batches"]) for rank in job}
        assert len(lengths) == 1, (policy, lengths)
    real = [
        item
        for rank in job
        for batch, padding in zip(
            rank["equal_pad"]["batches"], rank["equal_pad"]["padding"], strict=True
        )
        if not padding
        for item in batch
    ]
    assert real == corpus
    for rank in job:
        batches = rank["eval_batches"]
        pad, drop = rank["equal_pad"], rank["equal_drop"]
        assert pad["counts"]["real"] == len(batches)
        assert pad["counts"]["padded"] == pad["padding"].count(True)
        assert drop["batches"] == batches[: len(drop["batches"])]
        assert drop["counts"]["dropped"] == len(batches) - len(drop["batches"])
        assert pad["resumed"] == pad["batches"][pad["resumed_at"] :]
    assert any(rank["equal_drop"]["counts"]["dropped"] for rank in job)
    assert any(rank["equal_pad"]["counts"]["padded"] for rank in job)


@pytest.mark.slow
def test_gathered_state_is_identical_on_every_rank(job: list[dict[str, Any]]) -> None:
    gathered = job[0]["gathered"]
    assert gathered["format"] == GATHERED_FORMAT
    assert gathered["world_size"] == len(job)
    assert all(rank["gathered"] == gathered for rank in job)


@pytest.mark.slow
def test_a_killed_job_resumes_exactly_on_every_rank(jobs: dict[str, Any]) -> None:
    assert jobs["crashed"].returncode != 0, "the first job should have been killed"
    for before, after in zip(jobs["first"], jobs["resume"], strict=True):
        step = before["checkpoint_step"]
        assert after["resumed_from"] == step
        assert after["batches"] == before["reference"][step:]
        assert before["after_checkpoint"] == before["reference"][step : step + 3]
    # The ranks mixed differently-weighted sources, and their batches differ.
    assert jobs["first"][0]["reference"] != jobs["first"][1]["reference"]


@pytest.mark.slow
def test_whole_training_checkpoint_of_the_docs_resumes_exactly_on_two_ranks(
    tmp_path: Path,
) -> None:
    """The checkpoints how-to's script (DDP model, StatefulDataLoader, gather_state, data
    file as the commit point): stopped, restarted, equal to an uninterrupted run."""
    from _markdown import python_blocks

    code = {title: code for title, _, code in python_blocks("howto/checkpoints.md")}
    script = tmp_path / "train_checkpointed.py"
    script.write_text(code["train_checkpointed.py"], encoding="utf-8")
    proc = torchrun(2, "", tmp_path, worker=script, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout
    assert sorted(path.name for path in (tmp_path / "checkpoints").iterdir()) == [
        "data-30.json",
        "data-40.json",
        "model-30.pt",
        "model-40.pt",
    ]


@pytest.mark.slow
def test_restoring_a_non_elastic_pipeline_on_another_number_of_ranks_fails_clearly(
    jobs: dict[str, Any],
) -> None:
    for rank in jobs["three"]:
        assert (
            "holds the data states of 2 ranks, but this job has 3, and FixedBatchIterator "
            "cannot be elastic (a batch in progress holds this rank's items)"
        ) in rank["mismatch"]


@pytest.mark.slow
def test_a_finite_ddp_epoch_pads_with_zero_weighted_steps(tmp_path: Path) -> None:
    """DDP over unequal shares ends on every rank; a padding step (a one-item fill batch,
    loss weighted 0) runs forward and backward and adds exactly nothing to the update."""
    sys.path.insert(0, str(DDP_WORKER.parent))
    try:
        import _torchrun_ddp_padding as job
    finally:
        sys.path.remove(str(DDP_WORKER.parent))
    from infinibatch_like.torch import pad_batch

    proc = torchrun(2, "ddp", tmp_path, worker=DDP_WORKER)
    assert proc.returncode == 0, proc.stdout
    ranks = results(tmp_path, "ddp", 2, proc)
    # rank 0 has 2 batches, rank 1 has 4: rank 0 pads twice, and both run 4 steps
    assert [rank["counts"] for rank in ranks] == [
        {"real": 2, "padded": 2, "dropped": 0},
        {"real": 4, "padded": 0, "dropped": 0},
    ]
    assert [[batch is None for batch in rank["trained"]] for rank in ranks] == [
        [False, False, True, True],
        [False, False, False, False],
    ]
    assert ranks[0]["weights"] == ranks[1]["weights"]
    # The same updates in one process, from the real batches alone: each step's gradient
    # is the sum of the real batches' gradients over the number of ranks (DDP's average,
    # with the padding rank's gradient exactly zero).
    torch.manual_seed(0)
    model = job.TinyModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        optimizer.zero_grad()
        real = [rank["trained"][step] for rank in ranks if rank["trained"][step] is not None]
        for batch in real:
            loss = job.loss_of(model, pad_batch(batch, to="torch", pad_value=job.PAD)) / 2
            loss.backward()
        optimizer.step()
    for name, value in model.state_dict().items():
        assert torch.allclose(torch.tensor(ranks[0]["weights"][name]), value, atol=1e-6), name


# -- elastic jobs: killed mid-pass, resumed on another number of ranks -----------------------

ELASTIC_CORPUS = [f"c{chunk:02d}-{line}" for chunk in range(30) for line in range(chunk % 7 + 1)]
ELASTIC_SHARDS = 12
ELASTIC_CHAIN = [2, 3, 2, 4, 1]
"""The numbers of ranks of successive jobs: switches 2 -> 3, 3 -> 2, 2 -> 4 and 4 -> 1."""


@pytest.fixture(scope="module")
def elastic_chain(tmp_path_factory: pytest.TempPathFactory) -> list[list[dict[str, Any]]]:
    """Jobs on ELASTIC_CHAIN's numbers of ranks, each killed after a checkpoint that the
    next one restores (the last one reads the rest of the pass): each job's rank reports."""
    out = tmp_path_factory.mktemp("elastic")
    jobs = []
    for step, ranks in enumerate(ELASTIC_CHAIN):
        last = step == len(ELASTIC_CHAIN) - 1
        proc = torchrun(ranks, str(step), out, ELASTIC_WORKER, ("last",) if last else ())
        assert (proc.returncode == 0) == last, (
            f"step {step}, exit {proc.returncode}:\n{proc.stdout}"
        )
        jobs.append(results(out, f"step{step}", ranks, proc))
    return jobs


@pytest.mark.slow
def test_a_pass_resumed_on_other_numbers_of_ranks_delivers_every_item_once(
    elastic_chain: list[list[dict[str, Any]]],
) -> None:
    assert [[rank["world_size"] for rank in job] for job in elastic_chain] == [
        [ranks] * ranks for ranks in ELASTIC_CHAIN
    ]
    delivered = []
    for job in elastic_chain:
        batches = [batch for rank in job for batch in rank["finite"]]
        assert batches, "every job reads part of the pass"
        delivered += [item for batch in batches for item in batch]
        # Each shard runs on exactly one rank of each job.
        owned = sorted(shard for rank in job for shard in rank["shards"])
        assert owned == list(range(ELASTIC_SHARDS))
    assert sorted(delivered) == sorted(ELASTIC_CORPUS)
    assert any(rank["lost"] for job in elastic_chain[:-1] for rank in job)


@pytest.mark.slow
def test_an_endless_stream_continues_the_same_whatever_the_number_of_ranks(
    elastic_chain: list[list[dict[str, Any]]],
) -> None:
    def by_shard(items: list[str]) -> dict[int, list[str]]:
        shards: dict[int, list[str]] = {shard: [] for shard in range(ELASTIC_SHARDS)}
        for item in items:
            shards[int(item[1:3]) % ELASTIC_SHARDS].append(item)
        return shards

    for job in elastic_chain[1:]:
        single = by_shard(job[0]["single"])
        for rank in job:
            seen = by_shard(rank["endless"])
            for shard in rank["shards"]:
                assert seen[shard], shard
                assert seen[shard] == single[shard][: len(seen[shard])], shard
            assert not any(seen[shard] for shard in set(seen) - set(rank["shards"]))
