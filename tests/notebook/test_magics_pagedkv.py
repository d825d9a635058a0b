"""The extension and the `%pagedkv` line magic in an InteractiveShell (terminal mode), on the
embedded model: loading the extension, load/status/monitor/requests/reset-cache, bad lines, bench,
plan, tenants (`--tenant`, `%pagedkv tenant(s)`), then reload and unload.

One engine is loaded for the module (magics_shell.py); every test leaves it with no live request.
The reload and unload tests come last: they take the module's engine away.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from IPython.core.error import UsageError

from jupyter_pagedkv.notebook import session as session_mod
from jupyter_pagedkv.notebook.session import current

from magics_shell import GEN, engine_left_clean, ip, run  # noqa: F401  (fixtures)

pytestmark = pytest.mark.slow


# -- the extension itself -------------------------------------------------------------------------

def test_loading_the_extension_does_not_import_torch_or_transformers():
    code = ("import sys\nfrom IPython.testing.globalipapp import start_ipython\nip = start_ipython()\n"
            "ip.run_line_magic('load_ext', 'jupyter_pagedkv')\n"
            "assert 'pagedkv' in ip.magics_manager.magics['line']\n"
            "assert 'generate' in ip.magics_manager.magics['cell']\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("[]")


def test_every_magic_documents_its_options(ip):
    assert "--kv-cache-memory" in ip.find_line_magic("pagedkv").__doc__
    doc = ip.find_cell_magic("generate").__doc__
    for option in ("--max-tokens", "--temperature", "--top-p", "--top-k", "--seed", "--n", "--beams",
                   "--system", "--raw", "--stop", "--speculative", "--out", "--no-stream", "--background"):
        assert option in doc, option
    assert "--reset" in ip.find_cell_magic("chat").__doc__


def test_without_an_engine_magics_say_to_load_one(ip, monkeypatch, capsys):
    monkeypatch.setattr(session_mod, "_current", session_mod.KernelSession())
    for cell in (f"{GEN}\nhello", "%%chat\nhello", "%pagedkv requests", "%pagedkv reset-cache"):
        with pytest.raises(UsageError, match=r"no model loaded: run `%pagedkv load`"):
            run(ip, cell)
    run(ip, "%pagedkv status")
    assert "no model loaded" in capsys.readouterr().out


# -- %pagedkv ---------------------------------------------------------------------------------------

def test_load_summary_line_states_the_kv_geometry(ip):
    line = "loaded " + current().summary_line()
    engine = current().engine
    assert f"{engine._pool.num_blocks:,} blocks × 16 = {engine._pool.num_blocks * 16:,} tokens" in line
    assert f"{46080 * 16:,} bytes per block" in line
    assert "SmolLM2-135M-Instruct on cpu (float32)" in line
    # %pagedkv load owns its model: each weight is held once, packed (no second copy).
    assert engine._hold_weights and engine._runner.packed.extra_bytes == 0
    native = engine._runner.plan.prefill_attention.choice == "native"
    kind = ("prefill attention in C++ (prefill_attention.cpp)" if native
            else "prefill attention by torch's SDPA (this CPU lacks AVX-512)")
    assert line.endswith("GEMMs on packed weights (each weight held once), steps in the lean loop "
                         f"(decode steps in C++), {kind}")


def test_status_monitor_and_requests_show_the_pool(ip, capsys):
    run(ip, f"{GEN} --out o\nSay hi.")
    capsys.readouterr()
    run(ip, "%pagedkv status")
    status = capsys.readouterr().out
    assert "blocks:" in status and "prefix cache:" in status and "engine thread: running" in status
    plan = current().engine._runner.plan
    assert f"execution plan:\n  backend: {plan.backend}\n  decode steps: {plan.decode_steps}\n" in status
    assert f"  forward: native ({plan.forward.reason})\n" in status      # the embedded model: C++ decode steps
    run(ip, "%pagedkv monitor")
    assert "legend (one character per block): . free  c cached" in capsys.readouterr().out
    run(ip, "%pagedkv requests")
    table = capsys.readouterr().out
    rid = ip.user_ns["o"].request_id
    row = next(line for line in table.splitlines() if line.startswith(rid + " "))
    assert "generate" in row and "done (length)" in row and " ms" in row
    assert table.splitlines()[0].split() == ["id", "source", "state", "prompt", "output", "blocks",
                                             "cached", "TTFT"]


def test_reset_cache_drops_cached_blocks(ip, capsys):
    run(ip, f"{GEN}\nName a colour.")
    assert current().engine.stats().num_cached > 0
    run(ip, "%pagedkv reset-cache")
    assert "prefix cache cleared" in capsys.readouterr().out
    assert current().engine.stats().num_cached == 0


@pytest.mark.parametrize("line, message", [
    ("%pagedkv load --num-blocks 10 --kv-cache-memory 1MiB", "not both"),
    ("%pagedkv load /no/such/model", "cannot load: no model folder at /no/such/model"),
    ("%pagedkv load nobody/no-such-model", "not in the local Hugging Face cache"),
    ("%pagedkv load --dtype float13", "unknown dtype 'float13'"),
    pytest.param("%pagedkv load --device cuda", "no CUDA device here",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")),
    ("%pagedkv load --weights packed --dtype bfloat16", r"weights='packed' computes in float32 on the CPU"),
    ("%pagedkv load docs --weights packed", r"weights='packed' reads a GGUF file"),
    ("%pagedkv status --block-size 8", "only applies to `%pagedkv load`"),
    ("%pagedkv frobnicate", "invalid choice"),
])
def test_bad_pagedkv_lines_are_one_usage_error(ip, line, message):
    engine = current().engine
    with pytest.raises(UsageError, match=message) as err:
        run(ip, line)
    assert current().engine is engine and engine.is_running   # a typo does not cost the engine
    assert "unloaded" not in str(err.value) and "\n" not in str(err.value)

def test_pagedkv_bench_runs_the_bench_module_in_a_subprocess(ip, capsys):
    run(ip, "%pagedkv bench --help")
    assert "usage: python -m jupyter_pagedkv.bench" in capsys.readouterr().out
    with pytest.raises(UsageError, match="the benchmark exited with status 2"):
        run(ip, "%pagedkv bench no-such-bench")


def test_pagedkv_bench_tail_shows_its_plot(ip, capsys, tmp_path, monkeypatch):
    import IPython.display
    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda obj: shown.append(obj))
    run(ip, f"%pagedkv bench tail --scale sim --sim-requests 40 --sim-rates 1 4 --sim-scale-check 0 "
            f"--plot-dir {tmp_path}")
    out = capsys.readouterr().out
    assert "P99 end-to-end latency reaches 60 s (interpolated" in out and "P99 TTFT reaches 5 s" in out
    assert "swap vs recompute" in out
    assert len(shown) == 1 and isinstance(shown[0], IPython.display.Image)
    assert (tmp_path / "tail_sim.png").read_bytes()[:4] == b"\x89PNG"


def test_pagedkv_plan_prints_the_arithmetic_and_plots_concurrency(ip, capsys, monkeypatch):
    import IPython.display
    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda obj: shown.append(obj))
    run(ip, "%pagedkv plan Llama-3-70B --gpu H100-80GB --num-gpus 2")
    out = capsys.readouterr().out
    assert "327,680 bytes (320 KiB)" in out and "concurrent requests" in out
    # a PNG, so it renders whatever matplotlib backend the kernel has (a Figure showed as text)
    assert len(shown) == 1 and isinstance(shown[0], IPython.display.Image)
    assert shown[0].data[:4] == b"\x89PNG"


def test_pagedkv_plan_bad_input_is_one_line(ip):
    with pytest.raises(UsageError, match="invalid choice: 'Z80'"):
        run(ip, "%pagedkv plan Llama-3-70B --gpu Z80")
    with pytest.raises(UsageError, match="arguments are required: model"):
        run(ip, "%pagedkv plan")


def test_generate_and_chat_carry_a_tenant(ip):
    """--tenant reaches the request (RequestOutput.tenant); a chat session belongs to the tenant of
    its first turn; a bad name is one UsageError line, nothing left running."""
    run(ip, f"{GEN} --tenant alice --out t_out\nName a colour.")
    assert ip.user_ns["t_out"].tenant == "alice"
    run(ip, "%%chat tenant_s --max-tokens 4 --tenant bob --out t_chat\nHi!")
    assert ip.user_ns["t_chat"].tenant == "bob"
    run(ip, "%%chat tenant_s --max-tokens 4 --out t_chat\nAnd again?")          # continues as bob
    assert ip.user_ns["t_chat"].tenant == "bob"
    with pytest.raises(UsageError, match=r"chat session 'tenant_s' belongs to tenant 'bob': .* for 'carol'"):
        run(ip, "%%chat tenant_s --max-tokens 4 --tenant carol\nMine now?")
    with pytest.raises(UsageError, match=r"^tenant must be a non-empty string such as 'alice'"):
        run(ip, f'{GEN} --tenant " "\nName a colour.')
    run(ip, "%chat tenant_s --reset")


def test_pagedkv_tenants_table_and_tenant_settings(ip, capsys):
    """`%pagedkv tenant` sets a weight and cap (one line back, one line for bad input);
    `%pagedkv tenants` prints a row per tenant; `%pagedkv status` a line per tenant."""
    capsys.readouterr()
    run(ip, "%pagedkv tenant alice --weight 2 --max-blocks 64")
    assert capsys.readouterr().out.startswith("tenant alice: weight 2, at most 64 blocks; holds 0 blocks")
    run(ip, f"{GEN} --tenant alice\nName a colour.")
    capsys.readouterr()
    run(ip, "%pagedkv tenants")
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("policy: fcfs; pool: ")
    assert out[1].split()[:4] == ["tenant", "weight", "cap", "share"]
    alice = next(line.split() for line in out if line.startswith("alice "))
    assert alice[1:3] == ["2", "64"]
    run(ip, "%pagedkv status")
    assert "  alice: 0 blocks (cap 64)" in capsys.readouterr().out
    run(ip, "%pagedkv requests")
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:4] == ["id", "source", "tenant", "state"]
    assert any(line.split()[2] == "alice" for line in table[1:] if line.strip())
    with pytest.raises(UsageError, match=r"^tenant 'alice': weight must be a positive number"):
        run(ip, "%pagedkv tenant alice --weight -1")
    with pytest.raises(UsageError, match=r"^usage: %pagedkv tenant NAME"):
        run(ip, "%pagedkv tenant")
    run(ip, "%pagedkv tenant alice --max-blocks 1")
    with pytest.raises(UsageError, match=r"^tenant 'alice' may hold at most 1 blocks \(max_blocks\)"):
        run(ip, f"{GEN} --tenant alice\nName a colour.")
    current().engine.set_tenant("alice", max_blocks=None)


# -- reload, unload (last: they take the module's engine away) ------------------------------------------

def test_loading_again_replaces_the_engine_cleanly(ip, capsys):
    run(ip, "%%chat keep --max-tokens 4\nHello.")
    old = current().engine
    run(ip, "%pagedkv load --kv-cache-memory 64MiB --block-size 8 --dtype float32")
    new = current().engine
    assert new is not old and not old.is_running and old.model is None   # shut down, weights dropped
    assert new.block_size == 8 and new.is_running
    assert current().chats["keep"].token_ids == []     # old token ids are re-templated on the new model
    run(ip, "%%chat keep --max-tokens 4 --out o\nAgain.")
    assert [m["content"] for m in current().chats["keep"].messages][::2] == ["Hello.", "Again."]


def test_unload_gives_the_memory_back(ip, capsys):
    """After `%pagedkv unload` nothing holds the engine, its model or its KV tensors any more, so
    their memory is free (what the process's RSS then does is up to the allocator, not a test)."""
    import weakref

    run(ip, "%pagedkv load --kv-cache-memory 128MiB --dtype float32")
    run(ip, f"{GEN}\nHello.")
    engine = current().engine
    refs = [weakref.ref(x) for x in (engine, engine.model, engine._kv_cache.k, engine._kv_cache.v,
                                      next(engine.model.parameters()))]
    del engine
    run(ip, "%pagedkv unload")
    out = capsys.readouterr().out
    assert "unloaded SmolLM2-135M-Instruct: process memory" in out and "→" in out
    assert current().engine is None
    import gc
    gc.collect()
    assert [r() is None for r in refs] == [True] * len(refs)
