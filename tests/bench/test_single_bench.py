"""`bench single`'s command line: a misspelt system is refused in one line naming the valid ones,
before any engine loads (a silently dropped system made a run compare nothing)."""
from __future__ import annotations

import pytest

from jupyter_pagedkv.bench import single


@pytest.mark.parametrize("systems", ["packed,llama.cpp", "", "transformers"])
def test_an_unknown_system_is_refused_naming_the_valid_ones(systems, capsys):
    with pytest.raises(SystemExit) as stop:
        single.main(["--systems", systems])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--systems takes a comma-separated subset of dense, packed, hf, llamacpp" in err
