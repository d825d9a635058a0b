"""`bench structured` runs end to end and prints what the lead reads on a quiet machine: the ISA,
the step with and without a JSON schema on every request, and the grammar mask's share of the
step. A tiny random model with the embedded model's vocabulary and tokenizer stands in for the
embedded model (the figures are the lead's; here only that they are measured and printed)."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("xgrammar")

from conftest import tiny_model  # noqa: E402
from jupyter_pagedkv.engine.engine import Engine  # noqa: E402
from package_command import run_command  # noqa: E402


def test_bench_structured_prints_both_steps_and_the_mask_share(monkeypatch, tmp_path):
    from transformers import AutoTokenizer

    from jupyter_pagedkv.worker.loader import embedded_model_dir
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir())
    model = tiny_model("llama", vocab=49152, seed=3)

    def tiny_engine(cls, model_name=None, device="cpu", dtype="float32", **options):
        return Engine(model, tokenizer, kv_cache_memory="64MiB", **options)

    monkeypatch.setattr(Engine, "from_pretrained", classmethod(tiny_engine))
    code, printed = run_command(["bench", "structured", "--batch", "4", "--max-tokens", "6", "--rounds", "1",
                                 "--json", str(tmp_path / "r.json")])
    assert code == 0, printed
    assert "CPU: " in printed and "batch 4" in printed
    assert "% of the step" in printed and "a JSON schema on every request: step" in printed
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["plain"]["steps"] > 0 and result["schema"]["steps"] > 0
    # No request of the plain run has a grammar: its mask costs nothing; every schema step has one.
    assert result["plain"]["mask_ms"] == 0 and result["plain"]["mask_share"] == 0
    assert result["schema"]["mask_ms"] > 0 and 0 < result["schema"]["mask_share"] < 1
