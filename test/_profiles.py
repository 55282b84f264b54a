"""Hypothesis profiles: "quick" for local runs (the default) and "thorough" for CI.

``HYPOTHESIS_PROFILE=thorough`` (or ``CI=true``, as CI services set it) selects the thorough
one. A test that needs more or fewer examples than most asks for a multiple of the active
profile's budget with `examples`, so that both profiles scale it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from hypothesis import settings

PROFILES = {"quick": 25, "thorough": 100}
"""Each profile's max_examples: the budget of a test that asks for no other."""

for _name, _budget in PROFILES.items():
    settings.register_profile(_name, max_examples=_budget, deadline=None, print_blob=True)


def selected_profile(environ: Mapping[str, str]) -> str:
    """The profile an environment asks for: HYPOTHESIS_PROFILE, else "thorough" under CI."""
    name = environ.get("HYPOTHESIS_PROFILE")
    if name is None:
        ci = environ.get("CI", "").strip().lower() in ("1", "true", "yes")
        name = "thorough" if ci else "quick"
    if name not in PROFILES:
        raise ValueError(f"HYPOTHESIS_PROFILE={name!r}: expected one of {sorted(PROFILES)}")
    return name


def load_selected_profile() -> None:
    settings.load_profile(selected_profile(os.environ))


def examples(times: float) -> int:
    """`times` the active profile's max_examples (at least 1)."""
    return max(1, round(settings.default.max_examples * times))
