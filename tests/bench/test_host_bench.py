"""`bench host` runs through the package's command line and prints one row per batch size; the
host's part per request is (schedule + prepare + sample) / batch."""
from __future__ import annotations

from package_command import run_command


def test_the_smoke_run_prints_a_row_whose_host_part_is_its_phases_over_the_batch():
    code, out = run_command(["bench", "host", "--smoke"])
    assert code == 0, out
    assert out.startswith("CPU: ") and "padded decode buckets" in out
    row = next(line for line in out.splitlines() if line.startswith("| 8 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    requests, steps, schedule, prepare, forward, sample, step, per_request = cells
    assert int(steps) > 0
    assert float(step) > 0 and float(schedule) + float(prepare) + float(sample) > 0
    # From the unrounded medians: the printed ones (0.01 ms) put it within 2 us of this.
    assert abs(float(per_request) - (float(schedule) + float(prepare) + float(sample)) * 1e3 / 8) < 2.5
