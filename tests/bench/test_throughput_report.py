"""The pure arithmetic of `bench throughput`: ratios, the dtype choice, the step breakdown, the JSON.
No model is loaded: these run in well under a second."""
from __future__ import annotations

import json

import pytest
from torch import nn

from jupyter_pagedkv.bench import step_profile, throughput_report as report
from jupyter_pagedkv.worker import loader


def test_per_round_ratios_pair_rounds_and_weigh_tokens():
    # ours: 100 tokens in 1 s and 2 s; peer: 50 tokens in 1 s and 1 s
    assert report.per_round_ratios(100, [1.0, 2.0], 50, [1.0, 1.0]) == [2.0, 1.0]
    # a peer with fewer rounds (vLLM's repeats) pairs only as many
    assert report.per_round_ratios(100, [1.0, 2.0, 4.0], 100, [2.0]) == [2.0]


def test_ratio_line_prints_every_round_and_the_median():
    assert report.ratio_line("HF", [1.70, 1.74]) == "ours / HF per round: 1.70x, 1.74x; median 1.72x"
    assert "no rounds" in report.ratio_line("vLLM", [])


def test_system_row_median_and_ratios():
    row = report.system_row("peer", 200, [4.0, 2.0, 3.0], 100, [1.0, 1.0, 1.0])
    assert row["seconds"] == 3.0
    assert row["tokens_per_s"] == pytest.approx(200 / 3)
    assert row["ours_over_per_round"] == [2.0, 1.0, 1.5]
    assert row["ours_over"] == 1.5
    table = report.throughput_table([row])
    assert table[-1] == "| peer | 200 | 3.0 | 66.7 | 1.50x |"


def test_native_bf16_decides_the_default_dtypes(monkeypatch):
    monkeypatch.setattr(loader, "native_bf16", lambda: "AMX")
    assert report.choose_dtypes(None) == (["float32", "bfloat16"], None)
    monkeypatch.setattr(loader, "native_bf16", lambda: None)
    monkeypatch.setattr(report, "cpu_isa", lambda: "avx2")
    dtypes, note = report.choose_dtypes(None)
    assert dtypes == ["float32"]
    assert "lacks native bf16" in note and "avx2" in note
    # asked for explicitly: run as asked, even without native bf16
    assert report.choose_dtypes(["bfloat16", "bfloat16"]) == (["bfloat16"], None)


def test_step_breakdown_from_a_fake_profiler_table():
    ops = [("mkldnn::_linear_pointwise", 40_000.0), ("aten::addmm", 10_000.0),
           ("aten::_scaled_dot_product_flash_attention_for_cpu", 20_000.0),
           ("aten::index_select", 5_000.0), ("aten::index_copy_", 5_000.0),
           ("aten::add", 8_000.0), ("aten::empty", 2_000.0)]
    out = step_profile.breakdown(ops, wall_s=0.2, steps=2)       # 90 ms of ops in 200 ms
    assert out["profiled_ms_per_step"] == pytest.approx(100.0)
    assert out["gemm_ms"] == pytest.approx(25.0) and out["gemm_pct"] == pytest.approx(25.0)
    assert out["attention_pct"] == pytest.approx(10.0)
    assert out["kv_pct"] == pytest.approx(5.0)
    assert out["other_pct"] == pytest.approx(5.0)
    assert out["overhead_pct"] == pytest.approx(55.0)
    assert sum(out[f"{p}_pct"] for p in step_profile.PARTS) == pytest.approx(100.0)


def test_decode_flops_count_every_linear_once():
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight                                   # tied: counted once, as a Linear
    model = nn.Sequential(emb, nn.Linear(4, 8), nn.Linear(8, 4), head)
    assert step_profile.linear_weight_elements(model) == 32 + 32 + 40
    assert step_profile.decode_flops(model, 32) == 2 * 32 * 104


def test_gemm_entry_fraction_of_peak():
    g = report.gemm_entry(peak_gflops=200.0, peak_rows=512, flops_per_step=10**9, gemm_s_per_step=0.01)
    assert g["decode_gflops"] == pytest.approx(100.0)
    assert g["fraction"] == pytest.approx(0.5)


def test_json_assembly_has_stable_keys_and_serialises():
    row = report.system_row("jupyter-pagedkv", 10, [1.0], 10, [1.0])
    long = report.long_entry([2.0, 4.0], [4.0, 4.0], 7, 7, cached_s=[0.15, 0.3], lone_s=[0.1, 0.1])
    assert long["ratio_per_round"] == [0.5, 1.0] and long["ratio_median"] == 0.75 and long["same_first_token"]
    assert long["cached_over_alone_per_round"] == pytest.approx([1.5, 3.0])
    assert long["cached_over_alone_median"] == pytest.approx(2.25)
    step = step_profile.breakdown([("aten::mm", 1000.0)], 0.01, 1) | {"ms_per_step": 9.0}
    gemm = report.gemm_entry(100.0, 512, 10**8, 0.001)
    doc = report.assemble({"cpu": "x", "isa": "avx2"}, {"float32": [row]}, {"float32": {"2048": long}},
                          {"float32": gemm}, {"float32": step}, {"float32": {"peer": 1}}, ["note"])
    assert list(doc) == ["machine", "throughput", "agreement", "long_prompt", "gemm", "step", "notes"]
    assert set(row) == {"system", "tokens", "round_seconds", "seconds", "tokens_per_s", "ours_over",
                        "ours_over_per_round"}
    assert json.loads(json.dumps(doc))["long_prompt"]["float32"]["2048"]["ratio_median"] == 0.75
    assert any(line.startswith("| float32 | 2048 |") and line.endswith("| 150, 300 | 100, 100 |")
               for line in report.long_table(doc["long_prompt"]))
    assert any(line.startswith("| float32 |") for line in report.step_table(doc["step"], doc["gemm"]))


def test_shape_rows_pair_rounds_and_the_minimum_names_its_shape():
    # ours: 100 tokens in 1 s, 2 s; vLLM: 100 tokens in 2 s, 2 s -> 2.0x, 1.0x, median 1.5x
    a = report.shape_row("0:short-shared-8", 8, 100, [1.0, 2.0], 100, [2.0, 2.0])
    assert a["ours_over_per_round"] == [2.0, 1.0] and a["ours_over"] == 1.5
    assert a["ours_tokens_per_s"] == pytest.approx(100 / 1.5) and a["peer_tokens_per_s"] == 50.0
    b = report.shape_row("1:long-distinct-64", 64, 900, [3.0], 900, [4.0])
    assert report.minimum_ratio([a, b]) == (4.0 / 3.0, "1:long-distinct-64")
    table = report.shapes_table([a, b], "vLLM CPU")
    assert table[2] == "| 0:short-shared-8 | 8 | 100 | 66.7 | 50.0 | 2.00x, 1.00x | 1.50x |"
    # no peer measured: no ratio, no minimum
    lone = report.shape_row("0:short-shared-8", 8, 100, [1.0], None, [])
    assert lone["ours_over"] is None and report.minimum_ratio([lone]) is None
