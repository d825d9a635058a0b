"""`%%chat` sessions, Ctrl-C and `--background` in an InteractiveShell (terminal mode), on the
embedded model: a second turn hits the prefix cache, `%pagedkv why`, separate sessions and
`--reset`; an interrupt aborts only the cell's requests; background requests share the engine.

One engine is loaded for the module (magics_shell.py); every test leaves it with no live request.
"""
from __future__ import annotations

import _thread
import signal
import threading
import time

import pytest
from IPython.core.error import UsageError

from jupyter_pagedkv.notebook.session import current

from magics_shell import GEN, engine_left_clean, greedy_alone, ip, run  # noqa: F401  (fixtures)

pytestmark = pytest.mark.slow


# -- %%chat -----------------------------------------------------------------------------------------

def test_second_chat_turn_hits_the_first_turn_in_the_prefix_cache(ip, capsys):
    run(ip, "%%chat t --max-tokens 12 --out one\nMy name is Ada and I like prime numbers. Remember that.")
    first = ip.user_ns["one"]
    run(ip, "%%chat t --max-tokens 8 --out two\nWhat is my name?")
    printed = capsys.readouterr().out
    second = ip.user_ns["two"]
    chat = current().chats["t"]
    assert chat.reused_tokens                                  # the reply's tokens were kept as generated
    assert second.prompt_token_ids[:len(first.prompt_token_ids) + len(first.token_ids)] == \
        first.prompt_token_ids + first.token_ids
    computed = len(first.prompt_token_ids) + len(first.token_ids) - 1   # the last token never ran
    assert second.num_cached_tokens >= computed // 16 * 16 > 0
    assert f"{second.num_cached_tokens}/{len(second.prompt_token_ids)} prompt tokens cached" in printed
    assert "TTFT" in printed and "tok/s" in printed


def test_why_explains_a_request_and_a_chat_turn_that_recomputed_what_was_cached(ip, capsys):
    run(ip, "%%chat why --max-tokens 8\nMy name is Ada and I like prime numbers. Remember that.")
    capsys.readouterr()
    run(ip, "%pagedkv why")                                     # the last request: that turn
    assert "prompt blocks hit the prefix cache" in capsys.readouterr().out
    run(ip, "%pagedkv reset-cache")
    run(ip, "%%chat why --max-tokens 4 --out two\nWhat is my name?")
    printed = capsys.readouterr().out
    report = current().engine.why(ip.user_ns["two"].request_id)
    assert report.num_reusable > 1 and report.line() in printed and "reset_prefix_cache()" in printed
    with pytest.raises(UsageError, match="no request 'nope'"):
        run(ip, "%pagedkv why nope")


def test_chat_sessions_are_separate_and_listed(ip, capsys):
    run(ip, "%%chat alpha --max-tokens 4\nHello.")
    run(ip, "%%chat beta --max-tokens 4\nBonjour.")
    assert current().chats["alpha"].messages[0]["content"] == "Hello."
    assert current().chats["beta"].messages[0]["content"] == "Bonjour."
    capsys.readouterr()
    run(ip, "%pagedkv requests")
    table = capsys.readouterr().out
    assert "alpha: 1 turn" in table and "beta: 1 turn" in table and "chat alpha" in table


def test_chat_reset_forgets_and_unknown_sessions_are_a_usage_error(ip):
    run(ip, "%%chat gamma --max-tokens 4\nHello.")
    run(ip, "%chat gamma --reset")
    assert "gamma" not in current().chats
    with pytest.raises(UsageError, match="no chat session 'nobody' to reset"):
        run(ip, "%chat nobody --reset")
    with pytest.raises(UsageError, match="no message"):
        run(ip, "%chat gamma")


# -- interrupt, background ---------------------------------------------------------------------------

@pytest.fixture
def sigint_raises():
    """Python's own SIGINT handler, whatever this process inherited: a test runner started in the
    background of a non-interactive shell ignores SIGINT, and `interrupt_main` then does nothing."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


def interrupt_once_generating(origin: str) -> None:
    """Ctrl-C (SIGINT to the main thread) once a request of `origin` has produced two tokens."""
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, "use the sigint_raises fixture"
    engine = current().engine

    def watch():
        deadline = time.monotonic() + 600   # a starved machine; past it the cell ends unaborted and fails
        while time.monotonic() < deadline:
            mine = [r for r in engine.live_requests() if current().origins.get(r.request_id) == origin]
            if mine and mine[0].seqs[0].num_output_tokens >= 2:
                _thread.interrupt_main()
                return
            time.sleep(0.02)

    threading.Thread(target=watch, daemon=True).start()


def test_ctrl_c_aborts_the_cells_requests_and_frees_their_blocks(ip, capsys, sigint_raises):
    engine = current().engine
    run(ip, "%%generate --max-tokens 40 --background --out survivor\nTell me about the sea.")
    interrupt_once_generating("generate")
    with pytest.raises(KeyboardInterrupt):
        run(ip, "%%generate --max-tokens 400\nWrite a long story.\n---\nWrite a long poem.")
    assert "interrupted: aborted 2 requests of this cell" in capsys.readouterr().err
    # Only the background job may still run (a fast machine may have finished its 40 tokens).
    assert [current().origins[r.request_id] for r in engine.live_requests()] in ([], ["background"])
    assert current().wait_background(120)
    assert ip.user_ns["survivor"].finish_reason == "length"     # the background job kept running
    assert not engine.live_requests()
    engine.check_invariants()
    assert all(b.ref_count == 0 for b in engine._pool.blocks)
    run(ip, f"{GEN} --out after\nStill there?")                    # the engine keeps serving
    assert ip.user_ns["after"].finish_reason == "length"


def test_ctrl_c_in_a_chat_drops_the_turn_and_keeps_the_session(ip, capsys, sigint_raises):
    run(ip, "%%chat calm --max-tokens 4\nHello.")
    before = list(current().chats["calm"].messages)
    interrupt_once_generating("chat calm")
    with pytest.raises(KeyboardInterrupt):
        run(ip, "%%chat calm --max-tokens 400\nTell me a very long story.")
    assert "interrupted: aborted 1 request of this cell" in capsys.readouterr().err
    assert current().chats["calm"].messages == before
    engine = current().engine
    assert not engine.live_requests() and all(b.ref_count == 0 for b in engine._pool.blocks)
    run(ip, "%%chat calm --max-tokens 4 --out o\nStill there?")
    assert len(current().chats["calm"].messages) == len(before) + 2


def test_background_requests_share_the_engine_with_a_foreground_cell(ip, capsys):
    prompts = ["Name a planet.", "Name a river.", "Name a mountain."]
    run(ip, f"{GEN} --background --out bg1\n{prompts[0]}")
    run(ip, f"{GEN} --background --out bg2\n{prompts[1]}")
    assert "running; the result prints here when done" in capsys.readouterr().out
    run(ip, f"{GEN} --out fg\n{prompts[2]}")
    assert current().wait_background(120)
    outs = [ip.user_ns["bg1"], ip.user_ns["bg2"], ip.user_ns["fg"]]
    assert [o.finish_reason for o in outs] == ["length"] * 3
    assert [o.text for o in outs] == [greedy_alone(p, 8) for p in prompts]
    assert "background req-" in capsys.readouterr().out
