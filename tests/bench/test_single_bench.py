"""`bench single`'s command line: a misspelt system is refused in one line naming the valid ones,
before any engine loads (a silently dropped system made a run compare nothing)."""
from __future__ import annotations

import pytest

from package_command import run_command


@pytest.mark.parametrize("systems", ["packed,llama.cpp", "", "transformers"])
def test_an_unknown_system_is_refused_naming_the_valid_ones(systems):
    code, out = run_command(["bench", "single", "--systems", systems])
    assert code == 2
    assert out.strip().splitlines()[-1].endswith(
        f"--systems takes a comma-separated subset of dense, packed, hf, llamacpp; got {systems!r}")
