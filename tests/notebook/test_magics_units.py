"""The magics' pure parts, without a model: prompt splitting, interpolation, renderers, the comm."""
from __future__ import annotations

import time

import pytest
from IPython.core.error import UsageError

from jupyter_pagedkv.notebook.magics import PagedKVMagics
from jupyter_pagedkv.notebook.options import interpolate, parse_line, split_prompts, unescape as _unescape
from jupyter_pagedkv.notebook.text_views import block_map
from jupyter_pagedkv.monitor.channel import TARGET, handle_message, open_comm, register
from jupyter_pagedkv.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jupyter_pagedkv.notebook.session import ChatSession, KernelSession
from jupyter_pagedkv.notebook.streaming import DisplayRenderer, Panel, PrintRenderer, footer


def output(text: str, n: int = 3) -> RequestOutput:
    m = RequestMetrics(arrival_time=0.0, first_token_time=0.25, finish_time=0.45, num_generated_tokens=n)
    return RequestOutput("req-1", None, list(range(40)), [CompletionOutput(0, text, list(range(n)), "length")],
                         True, 32, m)


def test_dash_lines_separate_prompts():
    assert split_prompts("a\n---\nb\n  ---  \nc --- d") == ["a", "b", "c --- d"]


def test_an_empty_prompt_between_separators_is_a_usage_error():
    with pytest.raises(UsageError, match="empty prompt next to a `---`"):
        split_prompts("a\n---\n---\nb")
    with pytest.raises(UsageError, match="the cell is empty"):
        split_prompts("  \n")


def test_interpolation_reads_names_and_attributes_and_leaves_other_braces():
    class Box:
        size = 3
    ns = {"x": "cats", "box": Box()}
    assert interpolate('{x} {box.size} {{x}} {"k": 1} {1}', ns) == 'cats 3 {x} {"k": 1} {1}'
    with pytest.raises(UsageError, match="box.width does not exist"):
        interpolate("{box.width}", ns)


def test_footer_states_tokens_cache_ttft_and_speed():
    assert footer(output("hi")) == ("[3 tokens generated · 32/40 prompt tokens cached · TTFT 250 ms · "
                                    "10.0 tok/s · length]")


def test_terminal_renderer_prints_panels_in_order_as_they_complete():
    written: list[str] = []
    r = PrintRenderer(written.append)
    a, b = Panel("r1", "[1] a"), Panel("r2", "[2] b")
    b.text = "world"                       # the second prompt runs ahead, but prints after the first
    a.text = "hel"
    r.update([a, b], final=False)
    a.text, a.output = "hello", output("hello")
    r.update([a, b], final=False)
    b.output = output("world")
    r.update([a, b], final=True)
    text = "".join(written)
    assert text.index("── [1] a ──\nhel") < text.index("lo\n[3 tokens") < text.index("── [2] b ──\nworld")
    assert text.count("tokens generated") == 2


def test_notebook_renderer_displays_once_then_updates_in_place():
    calls = []

    class Handle:
        def update(self, data, raw):
            calls.append(("update", data))

    def display(data, raw, display_id):
        calls.append(("display", data))
        return Handle()

    r = DisplayRenderer(display)
    p = Panel("r1", "[1] a", "x")
    r.update([p], final=False)
    p.text, p.output = "xy", output("xy")
    r.update([p], final=True)
    assert [c[0] for c in calls] == ["display", "update"]
    assert calls[-1][1]["text/plain"].startswith("xy\n[3 tokens generated")
    assert "▌" in calls[0][1]["text/html"] and "▌" not in calls[-1][1]["text/html"]


def test_block_map_draws_one_character_per_block():
    text = block_map({"states": ["free", "cached", "used", "shared"] * 20}, width=64)
    first, second = text.splitlines()[:2]
    assert first == ".cus" * 16 and second == ".cus" * 4


def test_block_map_groups_large_pools_showing_the_busiest_state():
    states = ["free"] * 1000 + ["used"] + ["cached"] * 23
    text = block_map({"states": states}, width=64, max_chars=512)   # 1024 blocks: 2 per character
    assert text.splitlines()[:8] == ["." * 64] * 7 + ["." * 52 + "u" + "c" * 11]
    assert "one character per 2 blocks" in text


def test_monitor_answers_snapshot_and_rejects_other_requests():
    session = KernelSession()
    assert handle_message({"request": "snapshot"}, session.engine) == {"response": "snapshot", "loaded": False}
    assert handle_message({"request": "reboot"}, session.engine)["response"] == "error"


class FakeComm:
    def __init__(self) -> None:
        self.sent: list[dict] = []

    def on_msg(self, f):
        self.handler = f
        return f

    def on_close(self, f):
        self.closer = f

    def send(self, data):
        self.sent.append(data)

    def message(self, data: dict) -> None:
        self.handler({"content": {"data": data}})


def test_monitor_comm_sends_an_answer_per_message():
    comm = FakeComm()
    open_comm(comm, {}, get_engine=lambda: None)
    comm.message({"request": "snapshot"})
    assert comm.sent == [{"response": "snapshot", "loaded": False}]


def wait_for(condition, timeout: float = 120.0) -> None:
    """Wait for a state, with a generous ceiling: no test depends on how fast this machine is."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the expected state never came"
        time.sleep(0.02)


def test_monitor_comm_pushes_snapshots_while_subscribed_until_closed():
    comm = FakeComm()
    open_comm(comm, {}, get_engine=lambda: None)
    snapshots = lambda: [m for m in comm.sent if m.get("response") == "snapshot"]
    comm.message({"request": "subscribe", "interval_ms": 100})
    assert comm.sent[0] == {"response": "subscribed", "interval_ms": 100}
    wait_for(lambda: len(snapshots()) >= 3)                   # it keeps pushing on its own
    comm.message({"request": "unsubscribe"})                  # returns once the pusher has stopped
    pushed = len(snapshots())
    assert comm.sent[-1] == {"response": "unsubscribed"}
    time.sleep(0.3)
    assert len(snapshots()) == pushed                         # nothing after unsubscribing
    comm.message({"request": "subscribe", "interval_ms": 100})
    comm.closer({})                                           # closing stops the pushes the same way
    closed = len(comm.sent)
    time.sleep(0.3)
    assert len(comm.sent) == closed


def test_the_comm_target_is_registered_only_inside_a_kernel():
    class Shell:
        kernel = None
    assert register(Shell(), lambda: None) is False
    assert TARGET == "jupyter_pagedkv.monitor"


def test_options_use_shell_quoting_and_stop_strings_understand_escapes():
    args = parse_line(PagedKVMagics.generate, """--system "Be brief." --stop "\\n" --stop '.'""")
    assert args.system == "Be brief."
    assert [_unescape(s) for s in args.stop] == ["\n", "."]


class Tok:
    """A character-level stand-in tokenizer whose template may rewrite earlier assistant turns."""

    chat_template = "x"

    def __init__(self, strip_replies: bool) -> None:
        self.strip_replies = strip_replies

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, return_dict=False):
        text = "".join(f"<{m['role']}>" + (m["content"].strip() if self.strip_replies else m["content"])
                       + "|" for m in messages) + ("<assistant>" if add_generation_prompt else "")
        return [ord(c) for c in text] if tokenize else text

    def decode(self, ids, **kw):
        return "".join(map(chr, ids))

    def __call__(self, text, add_special_tokens=True):
        class Enc:
            input_ids = [ord(c) for c in text]
        return Enc()


class ChatEngine:
    """The engine's own chat_prompt over a stand-in tokenizer."""

    def __init__(self, tok) -> None:
        self.tokenizer = tok

    def chat_prompt(self, messages, previous=None):
        from jupyter_pagedkv.engine.engine import Engine
        return Engine.chat_prompt(self, messages, previous)

    def apply_chat_template(self, messages):
        return self.tokenizer.apply_chat_template(messages, True, True)


def turn(chat: ChatSession, engine: ChatEngine, message: str, reply_ids: list[int]) -> list[int]:
    ids = chat.prompt_ids(engine, message)
    out = RequestOutput("r", None, ids, [CompletionOutput(0, "".join(map(chr, reply_ids)).rstrip("|"),
                                                         reply_ids, "stop")], True, 0, RequestMetrics(0.0))
    chat.record(message, out)
    return ids


def test_next_chat_prompt_extends_the_tokens_the_model_saw():
    engine, chat = ChatEngine(Tok(strip_replies=False)), ChatSession("s")
    first = turn(chat, engine, "hi", [ord(c) for c in "yo|"])
    second = chat.prompt_ids(engine, "more")
    assert chat.reused_tokens and second[:len(first) + 3] == first + [ord(c) for c in "yo|"]


def test_chat_falls_back_to_the_template_when_it_rewrites_earlier_turns():
    engine, chat = ChatEngine(Tok(strip_replies=True)), ChatSession("s")
    turn(chat, engine, "hi", [ord(c) for c in " yo |"])      # the template strips the reply's spaces
    second = chat.prompt_ids(engine, "more")
    assert not chat.reused_tokens
    assert "".join(map(chr, second)) == "<user>hi|<assistant>yo|<user>more|<assistant>"
