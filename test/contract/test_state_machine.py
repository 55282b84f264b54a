"""A hypothesis state machine over randomly composed pipelines.

Each run draws a recipe (a source and up to four wrapper stages with random parameters),
builds the pipeline under test and, once, an uninterrupted reference run of the same
recipe. The rules advance the pipeline, take checkpoints (kept as returned and as a JSON
round-tripped copy), restore them into the same instance or a freshly built one, reset it
and pickle it; every item yielded must be the reference's item at the tracked position,
and the pipeline must end exactly where the reference ends, and stay ended.

Everything a recipe needs is a module-level function or a ``functools.partial`` of one, so
that pipelines pickle.
"""

from __future__ import annotations

import json
import pickle
import random
from dataclasses import dataclass
from typing import Any
from unittest import mock

from _profiles import examples
from _recipes import (
    REFERENCE_CAP,
    Recipe,
    build,
    recipes,
)
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

import infinibatch_like.iterators as it


class FixedSystemRandom:
    """Stands in for ``random.SystemRandom`` while a seed=None recipe is first built.

    seed=None stages draw their seed from the operating system; drawing fixed seeds
    instead makes a failing example replay exactly. (If the library draws its seeds in
    another way, the test still holds; a failure may just not replay.)
    """

    def __init__(self) -> None:
        self._rng = random.Random(20_240_601)

    def __call__(self) -> FixedSystemRandom:
        return self

    def getrandbits(self, k: int) -> int:
        return self._rng.getrandbits(k)


# -- the machine ---------------------------------------------------------------------------


def same(a: Any, b: Any) -> bool:
    """Equal, with equal types all the way down (1 != 1.0, [1] != (1,))."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(same, a, b))
    return bool(a == b)


def dumped(state: Any) -> str:
    return json.dumps(state, sort_keys=True)


@dataclass(frozen=True)
class Checkpoint:
    position: int
    state: dict[str, Any]
    json_state: dict[str, Any]
    text: str

    def __repr__(self) -> str:
        return f"Checkpoint(position={self.position}, state={self.text})"


class PipelineMachine(RuleBasedStateMachine):
    checkpoints = Bundle("checkpoints")

    def __init__(self) -> None:
        super().__init__()
        self.recipe: Recipe | None = None
        self.pipeline: it.CheckpointableIterator[Any] | None = None
        self.reference_run: it.CheckpointableIterator[Any] | None = None
        self.reference: list[Any] = []
        self.reference_ended = False
        self.position = 0

    # -- the reference run, extended lazily --

    def reference_has(self, position: int) -> bool:
        """Whether the reference has an item at `position` (extending it as needed)."""
        assert self.reference_run is not None
        while len(self.reference) <= position and not self.reference_ended:
            try:
                self.reference.append(next(self.reference_run))
            except StopIteration:
                self.reference_ended = True
        return position < len(self.reference)

    def replace(self, pipeline: it.CheckpointableIterator[Any]) -> None:
        assert self.pipeline is not None
        if pipeline is not self.pipeline:
            self.pipeline.close()
        self.pipeline = pipeline

    # -- rules --

    @initialize(recipe=recipes())
    def start(self, recipe: Recipe) -> None:
        self.recipe = recipe
        if recipe.unseeded:
            with mock.patch.object(random, "SystemRandom", FixedSystemRandom()):
                self.pipeline = build(recipe)
        else:
            self.pipeline = build(recipe)
        self.reference_run = build(recipe)
        if recipe.unseeded:
            # A seed=None stage adopts the seed of the state it is given (pickled and
            # freshly built pipelines do too), so the reference replays the same stream.
            self.reference_run.setstate(json.loads(dumped(self.pipeline.getstate())))

    @rule(n=st.integers(1, 60))
    def advance(self, n: int) -> None:
        assert self.pipeline is not None
        for _ in range(n):
            if self.position >= REFERENCE_CAP:
                return
            if not self.reference_has(self.position):
                for attempt in range(2):
                    try:
                        item = next(self.pipeline)
                    except StopIteration:
                        continue
                    raise AssertionError(
                        f"the reference ended after {self.position} items, but the pipeline "
                        f"then yields {item!r} (attempt {attempt + 1})"
                    )
                return
            expected = self.reference[self.position]
            try:
                item = next(self.pipeline)
            except StopIteration:
                raise AssertionError(
                    f"the pipeline ended at item {self.position}; the reference yields "
                    f"{expected!r} there"
                ) from None
            assert same(item, expected), (
                f"item {self.position}: got {item!r}, expected {expected!r}"
            )
            self.position += 1

    @rule(target=checkpoints)
    def checkpoint(self) -> Checkpoint:
        assert self.pipeline is not None
        state = self.pipeline.getstate()
        text = dumped(state)
        return Checkpoint(self.position, state, json.loads(text), text)

    def check_restored(self, checkpoint: Checkpoint) -> None:
        assert self.pipeline is not None
        got = dumped(self.pipeline.getstate())
        assert got == checkpoint.text, (
            f"getstate() right after setstate() differs:\n{got}\n!=\n{checkpoint.text}"
        )
        self.position = checkpoint.position

    @staticmethod
    def chosen_state(checkpoint: Checkpoint, use_json: bool) -> dict[str, Any]:
        # C1: neither later iteration nor earlier restores may have changed a state.
        assert dumped(checkpoint.state) == checkpoint.text, (
            f"the state taken at item {checkpoint.position} changed afterwards:\n"
            f"{dumped(checkpoint.state)}\n!=\n{checkpoint.text}"
        )
        assert dumped(checkpoint.json_state) == checkpoint.text, "a restore changed the state"
        return checkpoint.json_state if use_json else checkpoint.state

    @rule(checkpoint=checkpoints, use_json=st.booleans())
    def restore_same(self, checkpoint: Checkpoint, use_json: bool) -> None:
        assert self.pipeline is not None
        self.pipeline.setstate(self.chosen_state(checkpoint, use_json))
        self.check_restored(checkpoint)

    @rule(checkpoint=checkpoints, use_json=st.booleans())
    def restore_fresh(self, checkpoint: Checkpoint, use_json: bool) -> None:
        assert self.recipe is not None
        fresh = build(self.recipe)
        fresh.setstate(self.chosen_state(checkpoint, use_json))
        self.replace(fresh)
        self.check_restored(checkpoint)

    @rule()
    def reset(self) -> None:
        # A stage built with seed=None keeps the seed it drew (or adopted from a restored
        # checkpoint), so a reset replays the reference's stream in every case.
        assert self.pipeline is not None
        self.pipeline.setstate(None)
        self.position = 0

    @rule()
    def pickle_roundtrip(self) -> None:
        assert self.pipeline is not None
        before = dumped(self.pipeline.getstate())
        copied = pickle.loads(pickle.dumps(self.pipeline))
        after = dumped(copied.getstate())
        assert after == before, f"the unpickled pipeline's state differs:\n{after}\n!=\n{before}"
        self.replace(copied)

    # -- invariants and teardown --

    @invariant()
    def state_is_plain_data(self) -> None:
        if self.pipeline is None:
            return
        state = self.pipeline.getstate()
        assert json.loads(json.dumps(state)) == state, f"state is not plain data: {state!r}"

    def teardown(self) -> None:
        for pipeline in (self.pipeline, self.reference_run):
            if pipeline is not None:
                pipeline.close()


PipelineMachine.TestCase.settings = settings(
    max_examples=examples(6),
    stateful_step_count=40,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.filter_too_much],
)
TestPipelineMachine = PipelineMachine.TestCase
