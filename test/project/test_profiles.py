"""The suite's hypothesis profiles: quick by default, thorough under CI, budgets scaled."""

from __future__ import annotations

import os

import pytest
from _profiles import PROFILES, examples, selected_profile
from hypothesis import settings


@pytest.mark.parametrize(
    ("environ", "profile"),
    [
        ({}, "quick"),
        ({"CI": "true"}, "thorough"),
        ({"CI": "1"}, "thorough"),
        ({"CI": "false"}, "quick"),
        ({"HYPOTHESIS_PROFILE": "thorough"}, "thorough"),
        ({"HYPOTHESIS_PROFILE": "quick", "CI": "true"}, "quick"),
    ],
)
def test_the_environment_selects_the_profile(environ: dict[str, str], profile: str) -> None:
    assert selected_profile(environ) == profile


def test_the_suite_runs_under_the_selected_profile() -> None:
    assert settings.get_current_profile_name() == selected_profile(os.environ)


def test_an_unknown_profile_is_refused_naming_the_known_ones() -> None:
    expected = r"HYPOTHESIS_PROFILE='slow': expected one of \['quick', 'thorough'\]"
    with pytest.raises(ValueError, match=expected):
        selected_profile({"HYPOTHESIS_PROFILE": "slow"})


def test_the_thorough_profile_runs_more_examples_than_the_quick_one() -> None:
    assert PROFILES["quick"] < PROFILES["thorough"]


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_budgets_are_multiples_of_the_active_profile(profile: str) -> None:
    active = settings.get_current_profile_name()
    settings.load_profile(profile)
    try:
        assert settings().max_examples == PROFILES[profile]
        assert settings().deadline is None
        assert examples(2) == 2 * PROFILES[profile]
        assert examples(0.4) == round(0.4 * PROFILES[profile])
        assert examples(0.001) == 1
    finally:
        settings.load_profile(active)
