"""The magics in a real kernel (ipykernel), driven cell by cell with nbclient: display updates in
place, two chat turns sharing the KV cache, a background job, an interrupt, the monitor comm.

One kernel for the module; the tests run in file order and build one notebook.
"""
from __future__ import annotations

import os
import re
import threading
import time
import uuid
from pathlib import Path

import nbformat
import pytest
from jupyter_client import KernelManager
from nbclient import NotebookClient

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
FOOTER = re.compile(r"\[(\d+) tokens generated · (\d+)/(\d+) prompt tokens cached · TTFT \d+ ms")
# 2,000 tokens, EOS or not (--min-tokens): a minute on any CPU, where an interrupt takes milliseconds.
LONG_STORY = "--max-tokens 2000 --min-tokens 2000\nWrite a long story about a lighthouse keeper."


class Kernel:
    def __init__(self, client: NotebookClient, km: KernelManager) -> None:
        self.client, self.km, self.nb = client, km, client.nb

    def execute(self, source: str):
        cell = nbformat.v4.new_code_cell(source)
        self.nb.cells.append(cell)
        self.client.execute_cell(cell, len(self.nb.cells) - 1)
        return cell


def text_of(cell) -> str:
    """Everything a person would read in the cell's output, as plain text."""
    parts = []
    for out in cell.outputs:
        if out.output_type == "stream":
            parts.append(out.text)
        elif out.output_type in ("display_data", "execute_result"):
            parts.append(out.data.get("text/plain", ""))
        elif out.output_type == "error":
            parts.append(f"{out.ename}: {out.evalue}")
    return "\n".join(parts)


def errors(cell) -> list[str]:
    return [f"{o.ename}: {o.evalue}" for o in cell.outputs if o.output_type == "error"]


@pytest.fixture(scope="module")
def kernel():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "TOKENIZERS_PARALLELISM": "false"}
    km = KernelManager(kernel_name="python3")
    # A cell's last outputs may trail its reply on a busy machine: wait for them (120 s), never drop them.
    client = NotebookClient(nbformat.v4.new_notebook(), km=km, timeout=300, allow_errors=True,
                            iopub_timeout=120, raise_on_iopub_timeout=True)
    with client.setup_kernel(env=env):
        k = Kernel(client, km)
        k.execute("%load_ext jupyter_pagedkv")
        yield k


def test_load_prints_one_summary_line(kernel):
    cell = kernel.execute("%pagedkv load --kv-cache-memory 128MiB --dtype float32")
    assert not errors(cell), errors(cell)
    assert re.search(r"loaded SmolLM2-135M-Instruct on cpu \(float32\): [\d,]+ blocks × 16 = [\d,]+ "
                     r"tokens of KV, 737,280 bytes per block", text_of(cell)), text_of(cell)


def test_generate_streams_two_prompts_side_by_side_in_one_display(kernel):
    cell = kernel.execute("%%generate --max-tokens 8 --format text\nName a fruit.\n---\nName an animal.")
    assert not errors(cell), errors(cell)
    displays = [o for o in cell.outputs if o.output_type == "display_data"]
    assert len(displays) == 1            # updated in place, not appended per token
    plain, page = displays[0].data["text/plain"], displays[0].data["text/html"]
    assert "── [1] Name a fruit. ──" in plain and "── [2] Name an animal. ──" in plain
    assert len(FOOTER.findall(plain)) == 2
    assert "display:flex" in page and "Name an animal." in page


def test_markdown_answer_is_one_markdown_display_with_its_footer(kernel):
    cell = kernel.execute("%%generate --max-tokens 8\nName a fruit.")
    assert not errors(cell), errors(cell)
    displays = [o for o in cell.outputs if o.output_type == "display_data"]
    assert len(displays) == 1
    md = displays[0].data["text/markdown"]
    assert len(FOOTER.findall(md.replace("\\", ""))) == 1 and md.rstrip().endswith("*")  # footer in italics
    assert len(FOOTER.findall(displays[0].data["text/plain"])) == 1


def test_markdown_answers_to_two_prompts_stand_in_two_columns(kernel):
    cell = kernel.execute("%%generate --max-tokens 8\nName a fruit.\n---\nName an animal.")
    assert not errors(cell), errors(cell)
    displays = [o for o in cell.outputs if o.output_type == "display_data"]
    assert len(displays) == 1
    view = displays[0].data["application/vnd.jupyter.widget-view+json"]
    state = kernel.client.widget_state
    box = state[view["model_id"]]
    assert box["_model_name"] == "HBoxModel"
    columns = [state[ref.removeprefix("IPY_MODEL_")] for ref in box["children"]]
    shown = [c["outputs"][0]["data"]["text/markdown"] for c in columns]
    assert r"**\[1\] Name a fruit.**" in shown[0] and r"**\[2\] Name an animal.**" in shown[1]
    assert all(len(FOOTER.findall(md.replace("\\", ""))) == 1 for md in shown)


def test_second_chat_turn_reports_the_first_turns_blocks_as_cached(kernel):
    one = kernel.execute("%%chat demo --max-tokens 12\nMy name is Ada and I like prime numbers.")
    two = kernel.execute("%%chat demo --max-tokens 8\nWhat is my name?")
    assert not errors(one) and not errors(two), errors(one) + errors(two)
    generated1, cached1, prompt1 = map(int, FOOTER.search(text_of(one)).groups())
    _, cached2, prompt2 = map(int, FOOTER.search(text_of(two)).groups())
    first_turn_full_blocks = (prompt1 + generated1 - 1) // 16 * 16   # the last token is never computed
    assert cached2 >= first_turn_full_blocks > 0
    assert prompt2 > prompt1 + generated1


def test_background_result_arrives_while_later_cells_run(kernel):
    cell = kernel.execute("%%generate --max-tokens 8 --background --out bg\nName a planet.")
    assert not errors(cell), errors(cell)
    assert any("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in cell.outputs)
    check = kernel.execute("from jupyter_pagedkv.notebook.session import current\n"
                           "assert current().wait_background(120)\n"
                           "print(bg.finish_reason, len(bg.token_ids))\n"
                           "shown = current().jobs[-1].render.widget.outputs[0]['data']['text/plain']\n"
                           "print(shown.startswith(bg.text) and 'tokens generated' in shown)")
    assert text_of(check).split() == ["length", "8", "True"], text_of(check)


def test_interrupt_aborts_the_cell_and_leaves_no_block_referenced(kernel, tmp_path):
    # The kernel says when the request has produced two tokens (a file appears); only then does
    # the test interrupt it, from outside as the front end does: no timing guess on any machine.
    flag = tmp_path / "generating"
    setup = kernel.execute(
        "import pathlib, threading, time\n"
        "from jupyter_pagedkv.notebook.session import current\n"
        "def _watch(engine=current().engine):\n"
        "    while True:\n"
        "        rows = [r for r in engine.request_rows() if not r.finished]\n"
        "        if rows and rows[0].output_tokens >= 2:\n"
        f"            pathlib.Path({str(flag)!r}).touch()\n"
        "            return\n"
        "        time.sleep(0.02)\n"
        "threading.Thread(target=_watch, daemon=True).start()")
    assert not errors(setup), errors(setup)

    def interrupt_once_generating() -> None:
        deadline = time.monotonic() + 300
        while not flag.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        kernel.km.interrupt_kernel()

    threading.Thread(target=interrupt_once_generating, daemon=True).start()
    # LONG_STORY runs for about a minute: still running when the interrupt lands, unless the test
    # thread sends it a minute late.
    cell = kernel.execute(f"%%generate {LONG_STORY}")
    assert flag.exists()
    assert any(e.startswith("KeyboardInterrupt") for e in errors(cell)), cell.outputs
    assert "interrupted: aborted 1 request of this cell and freed its blocks" in text_of(cell)
    shown = next(o for o in cell.outputs if o.output_type == "display_data").data["text/plain"]
    assert re.search(r"\[\d+ tokens generated .* · abort\]$", shown), shown   # final state shown
    after = kernel.execute(
        "engine = current().engine\n"
        "engine.check_invariants()\n"
        "print('live', len(engine.live_requests()), 'referenced', "
        "sum(b.ref_count > 0 for b in engine._pool.blocks))")
    assert not errors(after), errors(after)
    assert text_of(after).strip() == "live 0 referenced 0"
    again = kernel.execute("%%generate --max-tokens 4 --out ok\nHi.\n")
    assert not errors(again) and FOOTER.search(text_of(again))


def test_monitor_comm_answers_a_snapshot_request(kernel):
    kc = kernel.client.kc
    comm_id = uuid.uuid4().hex
    kc.shell_channel.send(kc.session.msg("comm_open", {"comm_id": comm_id, "data": {},
                                                       "target_name": "jupyter_pagedkv.monitor"}))
    kc.shell_channel.send(kc.session.msg("comm_msg", {"comm_id": comm_id, "data": {"request": "snapshot"}}))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        msg = kc.get_iopub_msg(timeout=120)
        if msg["msg_type"] == "comm_msg" and msg["content"]["comm_id"] == comm_id:
            data = msg["content"]["data"]
            break
    else:
        pytest.fail("no answer on the monitor comm")
    assert data["response"] == "snapshot" and data["loaded"] is True
    pool, stats = data["pool"], data["stats"]
    assert len(pool["states"]) == pool["num_blocks"] == stats["num_blocks"]
    assert stats["num_used"] == 0 and stats["num_cached"] > 0
    assert set(pool["states"]) <= {"free", "cached", "used", "shared"}


def test_a_subscribed_monitor_gets_snapshots_while_a_cell_generates(kernel):
    kc = kernel.client.kc
    comm_id = uuid.uuid4().hex
    kc.shell_channel.send(kc.session.msg("comm_open", {"comm_id": comm_id, "data": {},
                                                       "target_name": "jupyter_pagedkv.monitor"}))
    kc.shell_channel.send(kc.session.msg("comm_msg", {"comm_id": comm_id,
                                                      "data": {"request": "subscribe", "interval_ms": 200}}))
    # A request far longer than three intervals (LONG_STORY: a minute on any CPU); once three
    # snapshots showed it running, the test interrupts the cell as the front end would.
    msg_id = kc.execute(f"%%generate {LONG_STORY}")
    running_seen, interrupted = 0, False
    while True:
        msg = kc.get_iopub_msg(timeout=300)
        content = msg["content"]
        if msg["msg_type"] == "comm_msg" and content["comm_id"] == comm_id:
            if content["data"].get("response") == "snapshot" and content["data"]["stats"]["num_running"]:
                running_seen += 1
                if running_seen == 3 and not interrupted:
                    kernel.km.interrupt_kernel()
                    interrupted = True
        if (msg["msg_type"] == "status" and content["execution_state"] == "idle"
                and msg["parent_header"].get("msg_id") == msg_id):
            break
    kc.shell_channel.send(kc.session.msg("comm_close", {"comm_id": comm_id, "data": {}}))
    # Pushed from a kernel thread while the cell held the main thread, before the cell ended.
    assert interrupted and running_seen >= 3
    after = kernel.execute("from jupyter_pagedkv.notebook.session import current\n"
                           "current().engine.check_invariants()\n"
                           "print('live', len(current().engine.live_requests()))")
    assert not errors(after) and text_of(after).strip() == "live 0", text_of(after)


def test_monitor_magic_shows_the_widget_with_a_deterministic_text_repr(kernel):
    cell = kernel.execute("%pagedkv monitor")
    assert not errors(cell), errors(cell)
    shown = next(o for o in cell.outputs if o.output_type == "display_data").data
    assert "application/vnd.jupyter.widget-view+json" in shown       # the live widget
    # nbval compares text/plain: no model id, no changing gauge in it.
    assert re.fullmatch(r"BlockPoolMonitor\('SmolLM2-135M-Instruct': [\d,]+ blocks × 16 tokens\)",
                        shown["text/plain"]), shown["text/plain"]
