"""The segments of a fan-out's owner (`shm_broadcast`): registered with the owner's
resource tracker, and what a receiver does with those of a dead owner."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from infinibatch_like.background import segments, shm_broadcast

pytestmark = pytest.mark.skipif(not segments.ENABLED, reason="no /dev/shm")


def test_segments_of_a_dead_sender_are_left_to_the_tracker_they_are_registered_with() -> None:
    prefix = f"ibl_{os.getpid()}_feedbeef_t1_b"  # registered with a tracker that is not ours
    left = Path(segments.SHM_DIR, f"{prefix}0")
    left.write_bytes(b"x")
    try:
        shm_broadcast.remove_left(prefix)
        assert left.exists()  # unregistering it here would make our tracker complain
    finally:
        left.unlink()


def test_segments_of_a_dead_sender_sharing_this_tracker_are_unlinked_and_unregistered() -> None:
    # In an interpreter of its own, whose resource tracker reports on its stderr (after
    # the interpreter exits) whatever is left registered or cannot be unlinked.
    script = textwrap.dedent(
        """
        import os
        import numpy as np
        from infinibatch_like.background import segments, shm_broadcast

        sender = shm_broadcast.Broadcast()
        _, names = sender.encode([np.zeros(1 << 16), np.ones(1 << 16)])
        assert len(names) == 2
        assert all(os.path.exists(f"{segments.SHM_DIR}/{name}") for name in names)
        shm_broadcast.remove_left(sender.prefix)  # as a receiver that saw the sender die
        assert not any(os.path.exists(f"{segments.SHM_DIR}/{name}") for name in names)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(entry for entry in sys.path if entry)},
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # no leak, no name it did not know or could not unlink
