"""Benchmarks' command lines: a misspelt system or a bad count is refused in one line naming the valid ones,
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


@pytest.mark.parametrize("argv, message", [
    (["single", "--rounds", "0"], "argument --rounds: must be at least 1, got 0"),
    (["kvquant", "--chunk", "1"], "argument --chunk: must be at least 2, got 1"),
    (["kvquant", "--shifts", "128", "0"], "argument --shifts: must be at least 1, got 0"),
    (["throughput", "--shapes", "1", "--kv-cache-dtype", "fp8"], "argument --kv-cache-dtype: invalid choice: 'fp8'"),
    (["throughput", "--weights", "packed"], "error: --weights only act with --shapes N"),
])
def test_a_bad_count_or_option_is_one_argparse_line_before_any_work(argv, message):
    """Benchmarks' counts are checked as they are parsed: a zero or a misspelt KV dtype used to
    surface as a traceback, some after minutes of engines (and a vLLM start-up)."""
    code, out = run_command(["bench", *argv])
    assert code == 2 and message in out.strip().splitlines()[-1]
