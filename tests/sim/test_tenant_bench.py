"""`bench tenants`: the noisy neighbour, FCFS against fair share, at a small simulated scale."""
from __future__ import annotations

import json

import pytest

from conftest import tiny_model
from figure_checks import check_figure
from jupyter_pagedkv import SamplingParams
from jupyter_pagedkv.sim.tenant_comparison import RATIO_TARGET_SIM, TenantedEngine, compare, sim_runs, tenants_figure
from package_command import run_command
from jupyter_pagedkv.sim.serve import TimedPrompt, serve
from jupyter_pagedkv.sim.tenant_workload import NOISY, QUIET, TenantMix, noisy_neighbour

SMALL = TenantMix(quiet_requests=60, noisy_requests=12, noisy_at=5.0)
WEIGHTS = {QUIET: 1.0, NOISY: 1.0}
PRESET = dict(model="Llama-3-70B", gpu="H100-80GB", num_gpus=2)


@pytest.fixture(scope="module")
def small_runs():
    return sim_runs(SMALL, 0, WEIGHTS, **PRESET)


def test_the_workload_is_seeded_and_the_burst_alone_overfills_the_pool(small_runs):
    a, b = noisy_neighbour(SMALL, 3), noisy_neighbour(SMALL, 3)
    assert a == b and a != noisy_neighbour(SMALL, 4)
    noisy = [r for r in a if r.tenant == NOISY]
    assert len(noisy) == 12 and min(r.arrival_s for r in noisy) >= SMALL.noisy_at
    need = sum(-(-(r.prompt_len + r.output_len) // 16) for r in noisy)
    assert need > 2 * small_runs["fcfs"].num_blocks


def test_the_replayed_pool_matches_the_simulators_block_steps(small_runs):
    # sim_runs already checks every finish time of the replay against the run's own timings.
    for run in small_runs.values():
        assert len(run.series.times) == len(run.series.durations) > 0
        assert 0 < run.series.utilisation(run.num_blocks) <= 1
        assert max(sum(b[i] for b in run.series.blocks.values()) for i in range(len(run.series.times))) \
            <= run.num_blocks


def test_fair_share_cuts_the_quiet_tail_to_a_third_and_keeps_the_noisy_tenants_share(small_runs):
    cmp = compare(small_runs, WEIGHTS)
    assert cmp["fcfs"]["quiet"]["ttft_tail_s"] > 5.0          # the burst really congests FCFS
    assert cmp["quiet_ttft_tail_ratio"] <= RATIO_TARGET_SIM
    nt = cmp["noisy_throughput"]
    assert nt["share"] == 0.5 and nt["ok"] and nt["fair_tokens_per_s"] >= nt["floor_tokens_per_s"]


def test_the_json_has_stable_keys(tmp_path):
    out = tmp_path / "t.json"
    assert run_command(["bench", "tenants", "--scale", "sim", "--seeds", "0", "1", "--sim-quiet-requests", "40", "--sim-noisy-requests", "10",
                 "--sim-noisy-at", "5", "--plot-dir", str(tmp_path), "--json", str(out)])[0] == 0
    data = json.loads(out.read_text())
    assert set(data) == {"cpu_isa", "sim"}
    sim = data["sim"]
    assert {"label", "num_blocks", "workload", "weights", "seeds", "quiet_ttft_tail_ratio_median",
            "quiet_ttft_tail_ratio_max", "ratio_ok", "noisy_throughput_ok"} <= set(sim)
    assert [s["seed"] for s in sim["seeds"]] == [0, 1]
    seed = sim["seeds"][0]
    assert {"fcfs", "fair", "quiet_ttft_tail_ratio", "noisy_throughput"} <= set(seed)
    assert set(seed["fcfs"]) == {"quiet", "noisy", "pool_utilisation", "noisy_block_share", "preemptions", "steps",
                                  "mean_step_ms"}
    assert set(seed["fcfs"]["quiet"]) == {"requests", "ttft_p50_s", "ttft_tail_s", "e2e_tail_s", "tokens_per_s",
                                          "tail"}
    assert set(seed["noisy_throughput"]) == {"fcfs_tokens_per_s", "fair_tokens_per_s", "share",
                                             "floor_tokens_per_s", "kept", "ok"}
    assert (tmp_path / "bench_tenants_sim.png").exists()


def test_the_figure_is_readable(small_runs):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = tenants_figure(small_runs, "simulated")
    try:
        check_figure(fig, expect_labels=("(s)", "(% of pool)"))
    finally:
        plt.close(fig)


def test_the_command_line_names_its_options_and_refuses_a_bad_one():
    code, text = run_command(["bench", "tenants", "--help"])
    assert code == 0 and all(o in text for o in ("--scale", "--seeds", "--quick", "--noisy-weight", "--plot-dir"))
    code, text = run_command(["bench", "tenants", "--scale", "everything"])
    assert code == 2 and "invalid choice: 'everything'" in text
    assert "tenants" in run_command(["bench", "--help"])[1]


def test_the_real_run_sends_each_request_under_its_tenant(make_engine):
    engine = make_engine(tiny_model("llama", seed=3), num_blocks=64, scheduling_policy="fair")
    tagged = TenantedEngine(engine, (QUIET, NOISY), 0.0)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [TimedPrompt(f"{t}-{i}", 0.0, [5 + i, 6, 7, 8], params) for i, t in enumerate((QUIET, NOISY, QUIET))]
    summary, outs = serve(tagged, prompts)
    assert {o.tenant for o in outs.values()} == {QUIET, NOISY}
    assert all(outs[p.request_id].tenant == p.request_id.split("-")[0] for p in prompts)
    assert len(tagged.series.times) == len(tagged.series.blocks[NOISY]) > 0
    assert max(tagged.series.blocks[QUIET]) >= 2    # two quiet requests of one block each, at once


def test_a_block_two_tenants_hold_is_counted_once_in_its_own_band():
    from jupyter_pagedkv.sim.tenant_workload import SHARED, blocks_by_owner

    held = blocks_by_owner({0: [QUIET, NOISY], 1: [NOISY], 2: [NOISY], 5: [QUIET]})
    assert held == {SHARED: 1, NOISY: 2, QUIET: 1}
    assert sum(held.values()) == 4                  # the blocks in use, so a stack never passes the pool
