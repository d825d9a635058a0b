"""The Triton kernels agree with their torch references.

On a machine without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1), switched
on by the `kernels` fixture only while this module runs, with the kernel modules loaded fresh and
dropped again afterwards, so no other test module sees interpreted kernels or the variable.
`PAGEDKV_KERNEL_TEST_DEVICE=cuda` runs the same tests natively on a GPU (`make gpu-check`).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from jupyter_pagedkv.worker import kernels_bridge
from jupyter_pagedkv.worker.kernels_bridge import KERNELS_PACKAGE, kernel_module
from jupyter_pagedkv.worker.plan import BACKEND_ENV, resolve_backend

ROOT = Path(__file__).resolve().parents[2]
DEVICE = torch.device(os.environ.get("PAGEDKV_KERNEL_TEST_DEVICE", "cpu"))
# Per dtype, a few times the largest error measured against the fp32 oracle (TRITON_INTERPRET=1,
# 2026-11-30): fp32 8e-7, fp16 6e-4, bf16 8.7e-3. Loose enough for reduction order, too tight for a
# wrong key or a missed block on a long context to hide.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


def _forget_kernel_modules() -> None:
    for name in [n for n in sys.modules if n.startswith(KERNELS_PACKAGE + ".")]:
        del sys.modules[name]


@pytest.fixture(scope="module")
def kernels():
    """The kernel modules, loaded under the interpreter on the CPU, natively on CUDA."""
    saved = os.environ.get("TRITON_INTERPRET")
    if DEVICE.type == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    _forget_kernel_modules()
    try:
        yield SimpleNamespace(attention=kernel_module("paged_attention"),
                              cache=kernel_module("cache_ops"), reference=kernel_module("reference"))
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved
        _forget_kernel_modules()


def make_batch(q_lens, ctx_lens, heads=4, kv_heads=2, head_dim=64, block_size=16,
               dtype=torch.float32, seed=0, spare_blocks=5):
    """A varlen batch over a paged cache whose physical blocks are a random permutation, with
    unused blocks in between; block tables are padded with 0 like the engine's."""
    g = torch.Generator().manual_seed(seed)
    per_seq = [-(-c // block_size) for c in ctx_lens]
    num_blocks = sum(per_seq) + spare_blocks
    perm = torch.randperm(num_blocks, generator=g)
    block_tables = torch.zeros(len(ctx_lens), max(per_seq + [1]), dtype=torch.int32)
    used = 0
    for i, n in enumerate(per_seq):
        block_tables[i, :n] = perm[used:used + n]
        used += n
    shape = (num_blocks, block_size, kv_heads, head_dim)
    query_start_loc = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    batch = SimpleNamespace(
        query=torch.randn(sum(q_lens), heads, head_dim, generator=g).to(dtype),
        k_cache=torch.randn(shape, generator=g).to(dtype),
        v_cache=torch.randn(shape, generator=g).to(dtype),
        block_tables=block_tables,
        seq_lens=torch.tensor(ctx_lens, dtype=torch.int32),
        query_start_loc=query_start_loc,
        scale=head_dim ** -0.5)
    for name in ("query", "k_cache", "v_cache", "block_tables", "seq_lens", "query_start_loc"):
        setattr(batch, name, getattr(batch, name).to(DEVICE))
    return batch


def run_kernel(kernels, b, **options):
    return kernels.attention.paged_attention(b.query, b.k_cache, b.v_cache, b.block_tables,
                                             b.seq_lens, b.query_start_loc, b.scale, **options)


def reference(kernels, b, sliding_window=None):
    """The oracle in fp32 on the CPU, from exactly the (possibly 16-bit) inputs the kernel saw."""
    return kernels.reference.paged_attention(
        b.query.cpu().float(), b.k_cache.cpu().float(), b.v_cache.cpu().float(),
        b.block_tables.cpu(), b.seq_lens.cpu(), b.query_start_loc.cpu(), b.scale,
        sliding_window=sliding_window)


def max_error(out, expected) -> float:
    return (out.cpu().float() - expected).abs().max().item()


# --- paged attention -------------------------------------------------------------------------

@pytest.mark.parametrize("group", [1, 3, 8])
def test_decode_matches_reference_for_each_gqa_ratio(kernels, group):
    b = make_batch([1, 1, 1], [1, 37, 70], heads=group * 2 if group < 8 else 8,
                   kv_heads=2 if group < 8 else 1, seed=group)
    out = run_kernel(kernels, b)
    assert out.shape == b.query.shape and out.dtype == b.query.dtype
    assert max_error(out, reference(kernels, b)) <= TOLERANCE[torch.float32]


def test_mixed_prefill_and_decode_batch_matches_reference(kernels):
    # decode, a first chunk, a sequence with nothing scheduled, a one-token sequence, and a
    # later chunk of a longer prompt (causal inside the chunk, full view of the earlier context)
    b = make_batch([1, 7, 0, 1, 29], [50, 7, 4, 1, 90], heads=6, kv_heads=2)
    out = run_kernel(kernels, b)
    assert max_error(out, reference(kernels, b)) <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_every_block_size_reads_the_right_slots(kernels, block_size):
    b = make_batch([1, 9, 1], [45, 20, 130], block_size=block_size, seed=block_size)
    assert max_error(run_kernel(kernels, b), reference(kernels, b)) <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype,head_dim", [(torch.float16, 128), (torch.bfloat16, 64),
                                            (torch.bfloat16, 128), (torch.float32, 128)])
def test_dtypes_and_head_dims_accumulate_in_fp32(kernels, dtype, head_dim):
    b = make_batch([1, 5, 1], [33, 21, 60], heads=6, kv_heads=2, head_dim=head_dim, dtype=dtype)
    out = run_kernel(kernels, b)
    assert out.dtype == dtype
    assert max_error(out, reference(kernels, b)) <= TOLERANCE[dtype]


def test_split_k_decode_matches_reference(kernels):
    b = make_batch([1, 1], [300, 45], heads=4, kv_heads=1, seed=7)
    out = run_kernel(kernels, b, num_splits=4, max_seq_len=300)
    assert max_error(out, reference(kernels, b)) <= TOLERANCE[torch.float32]


def test_split_counts_are_runtime_arguments_of_one_compiled_kernel(kernels):
    # decode rows and a prefill chunk, split 2, 3, 5 and 8 ways by the same kernel variant
    b = make_batch([1, 1, 3], [300, 45, 130], heads=6, kv_heads=2, seed=12)
    expected = reference(kernels, b)
    variants = set()
    for splits in (2, 3, 5, 8):
        out = run_kernel(kernels, b, num_splits=splits, max_seq_len=300)
        assert max_error(out, expected) <= TOLERANCE[torch.float32], splits
        launches = kernels.attention.attention_launches(
            b.query, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.query_start_loc, b.scale,
            torch.empty_like(b.query), max_seq_len=300, num_splits=splits)
        assert [launch.args[-2] for launch in launches[:1]] == [splits]   # a runtime argument
        variants.add(tuple((launch.name, tuple(launch.constexprs.items())) for launch in launches))
    assert len(variants) == 1


def test_offsets_past_2_to_the_31_elements_are_int64(kernels):
    """Query, output, key and value rows and cache blocks placed 2**31 elements (and more) into one
    fp16 storage: an int32 token x stride or block x stride would wrap negative. The storage is
    reserved, not filled: only the few rows written here become resident memory."""
    span = 2 ** 31 + 2 ** 14
    try:
        big = torch.empty(span, dtype=torch.float16, device=DEVICE)
    except (RuntimeError, MemoryError) as err:       # no 4 GiB of address space to reserve
        pytest.skip(f"cannot reserve a 4 GiB storage: {err}")
    g = torch.Generator().manual_seed(13)
    far = lambda shape, strides, offset: big.as_strided(shape, strides, offset)   # noqa: E731
    query = far((3, 4, 64), (2 ** 30, 64, 1), 0)                 # token 2 at 2**31
    out = far((3, 4, 64), (2 ** 30, 64, 1), 1024)
    k_cache = far((2, 16, 2, 64), (2 ** 31, 128, 64, 1), 4096)    # block 1 at 2**31 + 4096
    v_cache = far((2, 16, 2, 64), (2 ** 31, 128, 64, 1), 8192)
    key = far((3, 2, 64), (2 ** 30, 64, 1), 12288)                 # token 2 at 2**31 + 12288
    for view in (query, k_cache, v_cache, key):
        view.copy_(torch.randn(view.shape, generator=g).half().to(DEVICE))
    out.zero_()
    small = {name: t.cpu().clone() for name, t in
             dict(query=query, k_cache=k_cache, v_cache=v_cache, key=key).items()}
    slots = torch.tensor([16 + 3, 5, 16 + 15], device=DEVICE)      # two rows into block 1
    kernels.cache.write_kv(k_cache, v_cache, key, key, slots)
    kernels.reference.write_kv(small["k_cache"], small["v_cache"], small["key"], small["key"], slots.cpu())
    assert torch.equal(k_cache.cpu(), small["k_cache"]) and torch.equal(v_cache.cpu(), small["v_cache"])
    tables = torch.tensor([[1, 0], [1, 0]], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor([20, 5], dtype=torch.int32, device=DEVICE)
    starts = torch.tensor([0, 1, 3], dtype=torch.int32, device=DEVICE)
    expected = kernels.reference.paged_attention(small["query"].float(), small["k_cache"].float(),
                                                 small["v_cache"].float(), tables.cpu(), seq_lens.cpu(),
                                                 starts.cpu(), 0.125)
    for splits in (1, 2):
        out.zero_()
        kernels.attention.paged_attention(query, k_cache, v_cache, tables, seq_lens, starts, 0.125,
                                          max_seq_len=20, num_splits=splits, out=out)
        assert max_error(out, expected) <= TOLERANCE[torch.float16], splits
    del big, query, out, k_cache, v_cache, key


def test_split_k_with_prefill_rows_whose_splits_see_no_keys(kernels):
    # the chunk's first rows see only the first split's keys; later splits hold nothing for them
    b = make_batch([40, 1], [40, 100], heads=2, kv_heads=2, seed=8)
    out = run_kernel(kernels, b, num_splits=3)
    assert max_error(out, reference(kernels, b)) <= TOLERANCE[torch.float32]


def test_split_k_is_chosen_only_for_few_programs_over_long_contexts(kernels):
    choose = kernels.attention.choose_num_splits
    cpu = torch.device("cpu")
    assert choose(num_programs=2, max_seq_len=32768, device=cpu, tile_n=64) > 1
    assert choose(num_programs=2, max_seq_len=128, device=cpu, tile_n=64) == 1
    assert choose(num_programs=10_000, max_seq_len=32768, device=cpu, tile_n=64) == 1


def test_sliding_window_hides_keys_older_than_the_window(kernels):
    b = make_batch([1, 30], [120, 77], heads=4, kv_heads=2, seed=9)
    out = run_kernel(kernels, b, sliding_window=20)
    expected = reference(kernels, b, sliding_window=20)
    assert max_error(out, expected) <= TOLERANCE[torch.float32]
    assert max_error(out, reference(kernels, b)) > 1e-2          # the window really cut something


@pytest.mark.parametrize("window", [None, 24])
def test_chunks_after_long_prefixes_match_reference(kernels, window):
    # Chunks after unaligned (138, 97) and block-aligned (112) prefixes, beside a first chunk and a
    # decode: bottom-right causal, each query seeing the whole prefix (or the window's part of it).
    b = make_batch([1, 20, 13, 2, 16], [130, 20, 151, 99, 128], heads=6, kv_heads=2, seed=11)
    out = run_kernel(kernels, b, sliding_window=window)
    assert max_error(out, reference(kernels, b, sliding_window=window)) <= TOLERANCE[torch.float32]


def test_a_batch_without_tokens_returns_an_empty_output(kernels):
    b = make_batch([0, 0], [5, 9])
    assert run_kernel(kernels, b).shape == (0, 4, 64)


def test_bridge_adapts_paged_metadata_and_strided_queries(kernels):
    from jupyter_pagedkv.worker.paged_metadata import PagedMetadata
    b = make_batch([1, 6], [40, 6], heads=6, kv_heads=2)
    strided_q = b.query.transpose(0, 1).contiguous().transpose(0, 1)     # [T, heads, d] view
    meta = PagedMetadata(kv_cache=None, slot_mapping=torch.full((7,), -1, device=DEVICE),
                         query_start_loc=b.query_start_loc, seq_lens=b.seq_lens,
                         block_tables=b.block_tables, max_seq_len=40, backend="triton")
    out = kernels_bridge.paged_attention_triton(strided_q, b.k_cache, b.v_cache, meta, b.scale, None)
    assert out.shape == b.query.shape
    assert max_error(out, reference(kernels, b)) <= TOLERANCE[torch.float32]


def test_warm_up_launches_every_variant_one_engine_can_hit(kernels):
    from jupyter_pagedkv.worker.kv_cache import KVSpec
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.float32)
    roles = kernels_bridge.warm_up_kernels(spec, num_heads=6, block_size=16, window=48, device=DEVICE)
    assert roles == ["decode", "decode split", "merge", "prefill", "prefill split", "write_kv", "copy_blocks"]
    listed = kernels_bridge.kernel_variants(spec, num_heads=6, block_size=16, window=48)
    assert [line.split(":")[0] for line in listed] == roles
    assert all("USE_WINDOW=True" in line for line in listed if "_paged_attention_kernel" in line)


# --- cache operations ------------------------------------------------------------------------

def test_write_kv_stores_rows_in_their_slots_and_skips_minus_one(kernels):
    g = torch.Generator().manual_seed(3)
    k_cache = torch.zeros(6, 16, 2, 64, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    # [1, kv_heads, T, d] transposed to [T, kv_heads, d], as the attention hook receives it
    key = torch.randn(1, 2, 5, 64, generator=g).to(DEVICE)[0].transpose(0, 1)
    value = torch.randn(1, 2, 5, 64, generator=g).to(DEVICE)[0].transpose(0, 1)
    slots = torch.tensor([17, -1, 95, 0, -1], device=DEVICE)
    expected_k, expected_v = k_cache.cpu().clone(), v_cache.cpu().clone()
    kernels.reference.write_kv(expected_k, expected_v, key.cpu(), value.cpu(), slots.cpu())
    kernels.cache.write_kv(k_cache, v_cache, key, value, slots)
    assert torch.equal(k_cache.cpu(), expected_k) and torch.equal(v_cache.cpu(), expected_v)
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 3                 # skipped rows wrote nothing


def test_write_kv_copies_16_bit_rows_bit_exactly(kernels):
    k_cache = torch.zeros(2, 16, 1, 64, dtype=torch.bfloat16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(2, 1, 64, device=DEVICE).bfloat16()
    kernels.cache.write_kv(k_cache, v_cache, key, -key, torch.tensor([3, 20], device=DEVICE))
    assert torch.equal(k_cache[0, 3], key[0]) and torch.equal(v_cache[1, 4], -key[1])


def test_copy_blocks_copies_every_layer_and_leaves_other_blocks(kernels):
    g = torch.Generator().manual_seed(4)
    k = torch.randn(3, 8, 16, 2, 64, generator=g).to(DEVICE)   # [layers, blocks, ...]
    v = torch.randn(3, 8, 16, 2, 64, generator=g).to(DEVICE)
    expected_k, expected_v = k.cpu().clone(), v.cpu().clone()
    pairs = [(1, 5), (2, 0), (1, 7)]                              # one source, two forks
    kernels.reference.copy_blocks(expected_k, expected_v, pairs)
    kernels.cache.copy_blocks(k, v, pairs)
    assert torch.equal(k.cpu(), expected_k) and torch.equal(v.cpu(), expected_v)


def test_swap_blocks_out_and_back_in_restores_the_contents(kernels):
    g = torch.Generator().manual_seed(5)
    device_cache = torch.randn(2, 6, 16, 1, 64, generator=g).to(DEVICE)
    host_cache = torch.zeros(2, 4, 16, 1, 64)
    original = device_cache.cpu().clone()
    kernels.cache.swap_blocks(device_cache, host_cache, [(4, 0), (1, 3)])
    assert torch.equal(host_cache[:, 0], original[:, 4]) and torch.equal(host_cache[:, 3], original[:, 1])
    device_cache.zero_()
    kernels.cache.swap_blocks(host_cache, device_cache, [(0, 2), (3, 5)])
    assert torch.equal(device_cache[:, 2].cpu(), original[:, 4])
    assert torch.equal(device_cache[:, 5].cpu(), original[:, 1])
    assert int(device_cache.count_nonzero()) == 2 * 2 * 16 * 64


# --- dispatch, packaging, benchmark ----------------------------------------------------------

def test_auto_backend_is_torch_on_the_cpu_and_either_can_be_forced(kernels, monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert resolve_backend("cpu") == "torch"
    assert resolve_backend("cpu", "torch") == "torch"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend("cpu", "triton") == "triton"
    monkeypatch.setenv(BACKEND_ENV, "triton")
    assert resolve_backend("cpu") == "triton"


def test_forcing_triton_where_it_cannot_run_is_an_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="Triton backend cannot run"):
        resolve_backend("cpu", "triton")
    with pytest.raises(ValueError, match="must be one of"):
        resolve_backend("cpu", "cuda-graphs")


def test_kernels_package_is_loaded_under_its_own_name_and_the_wheel_ships_it_so():
    package = kernels_bridge.load_kernels()
    assert package.__name__ == "jupyter_pagedkv_kernels"
    assert kernel_module("cache_ops").__name__ == "jupyter_pagedkv_kernels.cache_ops"
    tomllib = pytest.importorskip("tomllib")      # Python >= 3.11
    wheel = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["hatch"]["build"]["targets"]["wheel"]
    assert wheel["force-include"] == {"kernels": "jupyter_pagedkv_kernels"}


def test_the_checkout_never_shadows_an_installed_kernels_distribution(tmp_path):
    # the checkout root comes first on sys.path (as the current directory does), an installed
    # regular package named `kernels` later: the installed one must win
    fake = tmp_path / "site" / "kernels"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("ORIGIN = 'installed'\n")
    code = (f"import sys; sys.path[:0] = [{str(ROOT)!r}, {str(tmp_path / 'site')!r}]; "
            "import kernels; print(getattr(kernels, 'ORIGIN', 'checkout'))")
    proc = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True)
    assert proc.stdout.strip() == "installed", proc.stderr


def test_benchmark_smoke_run_prints_every_column():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)       # the bench switches it on by itself without CUDA
    proc = subprocess.run([sys.executable, "-m", "jupyter_pagedkv.worker.kernels_bridge", "--smoke",
                           "--batches", "1", "2", "--contexts", "40"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for text in ("triton", "copy bandwidth", "paged_GB/s", "of_copy", "sdpa_ms", "paged/sdpa"):
        assert text in proc.stdout
    header = next(line.split() for line in proc.stdout.splitlines() if "max_diff" in line.split())
    rows = [line.split() for line in proc.stdout.splitlines() if line.split()[:1] in (["1"], ["2"])]
    at = header.index("max_diff")           # on CUDA, the eager launch's time follows it
    assert len(rows) == 2 and all(float(row[at]) < 2e-2 for row in rows)   # paged == contiguous


def test_engine_on_the_triton_backend_generates_what_the_torch_backend_does(kernels):
    """End to end: mixed prefill (chunked) + decode steps, prefix hits, preemption and a forked
    request, every attention call, KV write and block copy going through the kernels
    (interpreted on the CPU)."""
    from conftest import tiny_model
    from jupyter_pagedkv import Engine, SamplingParams

    model = tiny_model("llama", seed=4).to(DEVICE)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [30, 31, 32],
               [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 40, 41]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    forked = SamplingParams(n=2, max_tokens=6, temperature=0.0, ignore_eos=True)   # copy-on-write
    outs = {}
    for backend in ("torch", "triton"):
        engine = Engine(model, None, block_size=4, num_blocks=10, max_num_batched_tokens=12,
                        attention_backend=backend)
        outs[backend] = [[c.token_ids for c in o.outputs]
                         for o in engine.generate(prompts, [params, forked, params])]
        engine.check_invariants()
        assert engine._runner.backend == backend
    assert outs["triton"] == outs["torch"]


def test_triton_backend_is_exact_for_a_chunked_prompt_and_over_a_cached_prefix_with_a_window():
    """A 56-token prompt in chunks of 37 and 19 (the second starts after an unaligned prefix),
    then the prompt plus five tokens over its 56 cached positions, through the kernels (interpreted
    on the CPU) with a sliding window of 48 that cuts, against
    transformers' generate (the torch path's version: tests/engine/test_exactness_prefill.py)."""
    from conftest import assert_same_or_near_tie, hf_greedy, tiny_model
    from jupyter_pagedkv import Engine, SamplingParams
    from jupyter_pagedkv.testing.models import random_prompts

    model = tiny_model("mistral-window48", seed=23).to(DEVICE)
    prompt = random_prompts(1, 256, seed=5, lo=56, hi=57)[0]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine = Engine(model, None, block_size=4, num_blocks=40, max_num_batched_tokens=37, attention_backend="triton")
    for p in (prompt, prompt + [7, 8, 9, 10, 11]):
        out = engine.generate([p], params)[0]
        assert assert_same_or_near_tie(model, p, out.outputs[0].token_ids, hf_greedy(model, p, 1, stop_at_eos=False))
    assert out.num_cached_tokens == 56
    engine.check_invariants()
