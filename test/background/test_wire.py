"""Frames on pipes and sockets (infinibatch_like/background/wire.py): what is written
arrives whole, in order, however the bytes are cut on the way; a closed writer is an end."""

from __future__ import annotations

import os
import pickle
import socket
import threading

import pytest
from _profiles import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from infinibatch_like.background import wire

HEADER = 8


def framed(bodies: list[bytes]) -> bytes:
    return b"".join(len(body).to_bytes(HEADER, "little") + body for body in bodies)


def write_in_pieces(fd: int, data: bytes, cuts: list[int]) -> None:
    """Write `data` to `fd` cut at `cuts` (each piece one write), then close it."""
    ends = [*sorted(cut % (len(data) + 1) for cut in cuts), len(data)]
    try:
        for start, end in zip([0, *ends[:-1]], ends, strict=True):
            view = memoryview(data)[start:end]
            while view:
                view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def read_all(reader: wire.FrameReader) -> list[bytes]:
    frames: list[bytes] = []
    while True:
        try:
            frame = reader.read(10.0)
        except EOFError:
            return frames
        assert frame is not None, "no frame within 10 s"
        frames.append(bytes(frame))


bodies_strategy = st.lists(
    st.one_of(st.binary(max_size=40), st.integers(0, 200_000).map(lambda n: bytes([n % 251]) * n)),
    max_size=12,
)


@settings(max_examples=examples(0.6), deadline=None)
@given(bodies=bodies_strategy, cuts=st.lists(st.integers(0, 1 << 20), max_size=30))
def test_frames_cut_anywhere_arrive_whole_and_in_order(
    bodies: list[bytes], cuts: list[int]
) -> None:
    read_fd, write_fd = os.pipe()
    writer = threading.Thread(target=write_in_pieces, args=(write_fd, framed(bodies), cuts))
    writer.start()
    try:
        assert read_all(wire.FrameReader(read_fd)) == bodies
    finally:
        writer.join()
        os.close(read_fd)


def test_frames_queued_up_are_read_one_system_call_each(monkeypatch: pytest.MonkeyPatch) -> None:
    """A body's read also takes the next frame's length."""
    read_fd, write_fd = os.pipe()
    bodies = [b"a" * 100, b"", b"b" * 5000, b"c"]
    os.write(write_fd, framed(bodies))
    os.close(write_fd)
    calls = []
    real_readv = os.readv

    def counting_readv(fd: int, buffers: list[memoryview]) -> int:
        calls.append(fd)
        return real_readv(fd, buffers)

    monkeypatch.setattr(os, "readv", counting_readv)
    reader = wire.FrameReader(read_fd)
    got = [reader.read_ready() for _ in bodies]
    assert [None if frame is None else bytes(frame) for frame in got] == bodies
    assert len(calls) == 1 + len(bodies)  # the first length, then each body with the next length
    with pytest.raises(EOFError):
        reader.read_ready()
    os.close(read_fd)


def test_a_writer_gone_mid_frame_is_an_end_not_a_hang() -> None:
    read_fd, write_fd = os.pipe()
    os.write(write_fd, framed([b"whole"]) + (100).to_bytes(HEADER, "little") + b"part")
    os.close(write_fd)
    reader = wire.FrameReader(read_fd)
    assert bytes(reader.read(1.0) or b"?") == b"whole"
    with pytest.raises(EOFError):
        reader.read(1.0)
    os.close(read_fd)


def test_messages_sent_on_a_socket_are_read_as_frames() -> None:
    left, right = socket.socketpair()
    messages = [("ok", list(range(1000))), pickle.dumps(("end",)), ("items", 3)]
    sender = threading.Thread(target=wire.send_frames, args=(left, *messages))
    sender.start()
    reader = wire.FrameReader(right.fileno())
    got = [pickle.loads(reader.read(10.0) or b"") for _ in messages]
    sender.join()
    assert got == [("ok", list(range(1000))), ("end",), ("items", 3)]
    left.close()
    with pytest.raises(EOFError):
        reader.read(1.0)
    right.close()
