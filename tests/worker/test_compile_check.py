"""The compile check: Triton's real compiler on the CPU, for the GPUs the engine targets.

Compiling needs Triton imported with its interpreter off, and this session imports it with
TRITON_INTERPRET=1 on a CPU (tests/conftest.py), so what binds or compiles runs in a fresh Python
process; the checking logic itself is tested in this one.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from jupyter_pagedkv.worker.kernels_bridge import kernel_module

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]

PRELUDE = """
import json, sys, torch
from triton.backends.compiler import GPUTarget
from jupyter_pagedkv.worker.kernels_bridge import kernel_module
check = kernel_module("compile_check")
variants = kernel_module("variants")
attention = kernel_module("paged_attention")
def key(launch, arch=90):
    return check._binding(launch, GPUTarget("cuda", arch, 32))[0]
"""


def run_compiled(code: str, tmp_path) -> tuple[dict, subprocess.CompletedProcess]:
    """Run `code` (after PRELUDE) with Triton's interpreter off; it prints one JSON object last."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
               TRITON_CACHE_DIR=str(tmp_path / "triton-cache"))     # really compile, no cache hit
    proc = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(code)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    lines = proc.stdout.strip().splitlines()
    assert lines, proc.stderr[-3000:]
    return json.loads(lines[-1]), proc


@pytest.fixture(scope="module")
def facts(tmp_path_factory):
    """Binder keys of launches that differ only in runtime values, variant counts, and one small
    variant compiled for sm_90: one fresh process (a few seconds of imports) for all of them."""
    found, proc = run_compiled("""
        import dataclasses
        keys = set()
        for group, block_size, seqs, width, splits in [(1, 16, 1, 1, 2), (3, 32, 16, 16, 7),
                                                       (8, 16, 37, 50, 64), (4, 32, 2, 3, 3)]:
            meta = torch.device("meta")
            query = torch.empty(seqs, 2 * group, 64, dtype=torch.bfloat16, device=meta)
            cache = torch.empty(9, block_size, 2, 64, dtype=torch.bfloat16, device=meta)
            launches = attention.attention_launches(
                query, cache, cache, torch.empty(seqs, width, dtype=torch.int32, device=meta),
                torch.empty(seqs, dtype=torch.int32, device=meta),
                torch.empty(seqs + 1, dtype=torch.int32, device=meta), 0.125, torch.empty_like(query),
                max_seq_len=4096, num_splits=splits, interpreted=False)
            keys.add(repr((key(launches[0]), key(launches[1]))))
            # step inputs as views at a 4-byte offset of one staging buffer (input_staging.py)
            words = torch.empty(seqs * width + 2 * seqs + 9, dtype=torch.int32, device=meta)
            staged = attention.attention_launches(
                query, cache, cache, words[3:3 + seqs * width].view(seqs, width), words[1:1 + seqs],
                words[2:3 + seqs], 0.125, torch.empty_like(query),
                max_seq_len=4096, num_splits=splits, interpreted=False)
            keys.add(repr((key(staged[0]), key(staged[1]))))
        roles = dict(variants.model_launches(variants.AttentionShape(8, 2, 64, torch.bfloat16, 16),
                                             "meta", interpreted=False))
        small = dict(variants.model_launches(variants.AttentionShape(4, 2, 16, torch.float32, 16),
                                             "meta", interpreted=False))["decode"]
        compiled = check.compile_launch(small, 90)
        # the quantized cache's write for sm_90 (the interpreter runs Python: only the compiler
        # refuses what Triton cannot lower, and only the compiler counts its registers)
        writes = [check.compile_launch(dict(variants.model_launches(
                      variants.AttentionShape(heads, kv_heads, head_dim, torch.bfloat16, 16, kv_dtype=codes),
                      "meta", interpreted=False))["write_kv"], 90)
                  for heads, kv_heads, head_dim in [(9, 3, 64), (32, 8, 128)]
                  for codes in (torch.int8, torch.float8_e4m3fn)]
        # the fp8 write's PTX: which min/max instructions its clamps became
        import re, triton
        fp8_write = dict(variants.model_launches(variants.AttentionShape(9, 3, 64, torch.bfloat16, 16,
                                                                         kv_dtype=torch.float8_e4m3fn),
                                                 "meta", interpreted=False))["write_kv"]
        _, src, options = check._binding(fp8_write, GPUTarget("cuda", 90, 32))
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options.__dict__).asm["ptx"]
        print(json.dumps({"keys": len(keys),
                          "writes": [[w.dtype, w.config, check.failures(w)] for w in writes],
                          "write_min_max": sorted(set(re.findall(r"(?:min|max)[.a-zA-Z0-9]*f32", ptx))),
                          "split_differs": key(roles["decode"]) != key(roles["decode split"]),
                          "per_model": len({repr(key(l)) for l in roles.values()}),
                          "after": [check.variants_after(m) for m in check.NAMED],
                          "before": [check.variants_before(m) for m in check.NAMED],
                          "compiled": {**dataclasses.asdict(compiled), "failures": check.failures(compiled)}}))
        """, tmp_path_factory.mktemp("compile"))
    return found


def test_the_quantized_caches_write_compiles_for_sm90_without_spilling(facts):
    """int8 and fp8 codes at the embedded model's heads (3 x 64) and Llama-3-8B's (8 x 128); fp8's
    scale search keeps 16 candidates' errors per row, which a program per token spilled at 8 x 128."""
    assert [dtype for dtype, _, _ in facts["writes"]] == ["bfloat16/int8", "bfloat16/fp8"] * 2
    assert all(failures == [] for _, _, failures in facts["writes"]), facts["writes"]


def test_the_quantized_caches_write_keeps_a_nan_on_a_gpu_as_torch_does(facts):
    """A GPU's plain max.f32/min.f32 return the other operand for a NaN; torch's amax and clamp keep
    it. The fp8 write's clamps must be the NaN-propagating forms, and its absmax is flagged by a
    separate NaN test, so its one plain max.f32 (the reduction) cannot hide a NaN row."""
    assert facts["write_min_max"] == ["max.NaN.f32", "max.f32", "min.NaN.f32"], facts["write_min_max"]


def test_split_count_batch_group_block_size_and_input_offsets_do_not_change_the_compiled_kernel(facts):
    assert facts["keys"] == 1             # one attention kernel and one merge for all of them
    assert facts["split_differs"]         # SPLIT stays a constexpr: the unsplit path stays lean


def test_one_model_needs_seven_variants_where_it_needed_dozens(facts):
    assert facts["per_model"] == 7        # decode/prefill x split or not, merge, write_kv, copy_blocks
    assert facts["after"] == [7, 7, 7] and min(facts["before"]) > 20


def test_one_small_variant_compiles_for_sm90_and_reports_its_resources(facts):
    compiled = facts["compiled"]
    assert compiled["error"] is None
    assert compiled["registers"] > 0 and compiled["spill_bytes"] == 0 and compiled["shared"] > 0
    assert compiled["failures"] == []


def test_main_streams_one_json_row_per_variant_and_fails_on_a_spill(tmp_path):
    # the interface the GPU check calls: main(["--quick", "--arch", "90", "--jsonl", PATH]); the
    # compiler is replaced so that only the merge kernel "spills"
    path = tmp_path / "compile.jsonl"
    facts, proc = run_compiled(f"""
        def fake_compile(launch, arch):
            config, dtype = check._describe(launch)
            spill = 16 if launch.name == "_merge_splits_kernel" else 0
            return check.Variant(launch.name, arch, config, dtype, registers=40, spill_bytes=spill,
                                 shared=512, seconds=0.0)
        check.compile_launch = fake_compile
        rc = check.main(["--quick", "--arch", "90", "--jsonl", {str(path)!r}])
        print(json.dumps({{"rc": rc}}))
        """, tmp_path)
    assert facts["rc"] == 1
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows and {r["arch"] for r in rows} == {90}
    assert {r["kernel"] for r in rows} == {"_paged_attention_kernel", "_merge_splits_kernel",
                                           "_write_kv_kernel", "_copy_blocks_kernel", "_write_kv_quant_kernel",
                                           "_quant_matmul"}     # weights="packed" on CUDA: every model's
    assert {r["dtype"] for r in rows if r["kernel"] == "_quant_matmul"} == {"bfloat16", "float16", "float32"}
    assert {r["dtype"] for r in rows if r["kernel"] == "_write_kv_quant_kernel"} >= {"bfloat16/fp8", "bfloat16/int8"}
    assert "variants per model" in proc.stdout and "largest registers" in proc.stdout
    fails = [ln for ln in proc.stderr.splitlines() if ln.startswith("FAIL")]
    assert len(fails) == sum(r["kernel"] == "_merge_splits_kernel" for r in rows) > 0


def test_spills_shared_memory_over_the_limit_and_compile_errors_are_failures():
    check = kernel_module("compile_check")
    ok = check.Variant("_k", 90, "X=1", "bfloat16", registers=128, spill_bytes=0, shared=232448)
    assert check.failures(ok) == []
    spilled = check.Variant("_k", 80, "X=1", "bfloat16", registers=255, spill_bytes=48, shared=1024)
    assert check.failures(spilled) == ["_k sm_80 X=1: spills 48 bytes per thread"]
    big = check.Variant("_k", 80, "X=1", "bfloat16", registers=64, spill_bytes=0, shared=166913)
    assert "above the sm_80 limit 166912 B" in check.failures(big)[0]
    broken = check.Variant("_k", 90, "X=1", "bfloat16", error="CompilationError: boom")
    assert check.failures(broken) == ["_k sm_90 X=1: compile error: CompilationError: boom"]
