"""The ring of a fan-out's replies (infinibatch_like/background/shm_arena.py): a held
message keeps its bytes whatever is written after it, receivers read it in place and
cannot write, and the ring is gone once its sender closes it."""

from __future__ import annotations

import os
import secrets

import pytest
from _profiles import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from infinibatch_like.background import segments, shm_arena

pytestmark = pytest.mark.skipif(not segments.ENABLED, reason="no /dev/shm")

CAPACITY = 4096


def ring(capacity: int = CAPACITY) -> shm_arena.Ring:
    return shm_arena.Ring(f"ibl_{os.getpid()}_{secrets.token_hex(4)}_test_ring", capacity)


def message(number: int, size: int) -> bytes:
    return bytes([number % 251]) * size


operations = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.integers(1, CAPACITY // 4)),
        st.tuples(st.just("let go"), st.integers(0, 1 << 16)),
    ),
    max_size=120,
)


@settings(max_examples=examples(1), deadline=None)
@given(operations=operations)
def test_a_held_message_keeps_its_bytes_whatever_is_written_after_it(
    operations: list[tuple[str, int]],
) -> None:
    sender = ring()
    view = shm_arena.Ring.attach(sender.name, CAPACITY)
    held: list[tuple[shm_arena.Span, bytes]] = []
    try:
        for number, (operation, value) in enumerate(operations):
            if operation == "let go":
                if held:
                    span, _ = held.pop(value % len(held))
                    shm_arena.Ring.let_go(span)
                continue
            data = message(number, value)
            span = sender.put(data)
            if span is None:  # no room: only while messages are held
                assert held
                continue
            assert span.offset >= 0
            assert span.offset + span.length <= CAPACITY
            held.append((span, data))
            for kept, kept_data in held:  # every message held reads as it was written
                assert view[kept.offset : kept.offset + kept.length] == kept_data
        for span, _ in held:
            shm_arena.Ring.let_go(span)
        assert sender.in_use() == 0
        assert sender.put(message(0, CAPACITY // 4)) is not None  # all of it usable again
    finally:
        sender.close()


def test_a_message_is_let_go_by_its_sender_and_by_each_receiver_it_was_sent_to() -> None:
    sender = ring()
    try:
        first = sender.put(message(1, CAPACITY // 4))
        assert first is not None
        shm_arena.Ring.hold(first)  # sent to a receiver
        for number in range(2, 5):  # the rest of the ring
            assert sender.put(message(number, CAPACITY // 4)) is not None
        assert sender.put(message(5, 10)) is None  # the first is held twice
        shm_arena.Ring.let_go(first)  # its message is no longer sent
        assert sender.put(message(5, 10)) is None  # its receiver has not read it
        shm_arena.Ring.let_go(first)
        assert sender.put(message(5, 10)) is not None
    finally:
        sender.close()


def test_a_message_larger_than_a_quarter_of_the_ring_gets_no_span() -> None:
    sender = ring()
    try:
        assert sender.put(message(1, CAPACITY // 4 + 1)) is None
        assert sender.put(b"") is None
        assert sender.in_use() == 0
    finally:
        sender.close()


def test_receivers_read_in_place_and_cannot_write() -> None:
    sender = ring()
    try:
        span = sender.put(b"abc")
        assert span is not None
        view = shm_arena.Ring.attach(sender.name, CAPACITY)
        assert view.readonly
        assert bytes(view[span.offset : span.offset + span.length]) == b"abc"
        with pytest.raises(TypeError):
            view[span.offset] = 0
    finally:
        sender.close()


def test_closing_unlinks_the_ring_and_leaves_receivers_their_view() -> None:
    sender = ring()
    span = sender.put(b"kept")
    assert span is not None
    view = shm_arena.Ring.attach(sender.name, CAPACITY)
    sender.close()
    sender.close()  # idempotent
    assert not os.path.exists(f"{segments.SHM_DIR}/{sender.name}")
    assert bytes(view[span.offset : span.offset + span.length]) == b"kept"
    assert sender.put(b"more") is None  # a closed ring takes nothing
