"""What registering a fan-out owner's segments with the resource tracker costs the owner.

Each large array of an item that a `FanOut` serves to consumer processes gets a segment
of its own (`shm_broadcast.Broadcast`), registered with the owner's resource tracker
before it is created and unregistered once it is unlinked. Timed, in CPU time of this
process (the best of `--reps`):

(a) one item of one 128 KiB array: `Broadcast.encode` then `shm_broadcast.unlink`;
(b) a segment of 128 KiB created and unlinked, registered (as the owner does) and not;
(c) the two messages to the tracker alone, sent back to back, and with 100 us of other
    work before each pair (as between items: the tracker sleeps then, and each message
    wakes it).

Run ``python bench/bench_segment_registration.py``; results go to
``bench/results/segment_registration.json``. Linux only.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import time
from collections.abc import Callable

import numpy as np
from _util import RESULTS_DIR, machine_info

from infinibatch_like.background import segments, shm_broadcast

NAME = f"ibl_{os.getpid()}_bench_b"
SIZE = 128 * 1024


def cost_us(action: Callable[[], object], count: int, reps: int, gap_us: float = 0.0) -> float:
    """CPU microseconds of one `action()` (the best mean of `reps` runs of `count`), each
    after `gap_us` of busy waiting that is not counted."""
    best = float("inf")
    for _ in range(reps):
        spent = 0.0
        for _ in range(count):
            end = time.perf_counter() + gap_us / 1e6
            while time.perf_counter() < end:
                pass
            start = time.process_time()
            action()
            spent += time.process_time() - start
        best = min(best, spent / count * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    sender = shm_broadcast.Broadcast()  # starts the tracker
    item = {"i": 0, "array": np.zeros(SIZE // 4, dtype=np.int32)}
    flags = os.O_CREAT | os.O_EXCL | os.O_RDWR

    def item_round_trip() -> None:
        shm_broadcast.unlink(sender.encode(item)[1])

    def registered() -> None:
        segments.Segment(f"{NAME}0", SIZE)
        segments.unlink_name(f"{NAME}0")

    def unregistered() -> None:
        fd = os.open(f"{segments.SHM_DIR}/{NAME}1", flags, 0o600)
        segments._mapping(fd, segments.HEADER + SIZE, mmap.MAP_SHARED, creating=True)
        segments.unlink_name(f"{NAME}1", tracked=False)

    fd = segments._tracker_fd()
    assert fd is not None
    register = segments._tracker_message("REGISTER", f"{NAME}2")
    unregister = segments._tracker_message("UNREGISTER", f"{NAME}2")

    def messages() -> None:
        os.write(fd, register)
        os.write(fd, unregister)

    count, reps = args.count, args.reps
    results = {
        "item of one 128 KiB array, encode + unlink": cost_us(item_round_trip, count, reps),
        "segment of 128 KiB, registered": cost_us(registered, count, reps),
        "segment of 128 KiB, not registered": cost_us(unregistered, count, reps),
        "register + unregister, back to back": cost_us(messages, count, reps),
        "register + unregister, 100 us apart": cost_us(messages, count, reps, 100),
    }
    for what, us in results.items():
        print(f"{what:45} {us:7.1f} us")
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / "segment_registration.json").write_text(
        json.dumps({"machine": machine_info(), "us": results}, indent=1)
    )


if __name__ == "__main__":
    main()
