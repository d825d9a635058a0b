"""`bench throughput --shapes` keeps one vLLM process up and runs it shape by shape beside ours.
No vLLM here: the peer's serve loop runs on a fake LLM, the session talks to a fake peer script,
and the interleaving runs on fake engines; each in well under a few seconds."""
from __future__ import annotations

import json
import os
import re
import sys
import time
import textwrap
from types import SimpleNamespace

import pytest

from jupyter_pagedkv.bench import peer_vllm, throughput_shapes
from jupyter_pagedkv.bench.vllm_session import PeerFailed, VllmSession


class FakeLLM:
    """generate() answers max_tokens copies of the prompt's first token; counts its calls."""

    def __init__(self):
        self.calls, self.resets = [], 0

    def reset_prefix_cache(self):
        self.resets += 1
        return True

    def generate(self, prompts, sampling, use_tqdm=False):
        self.calls.append(len(prompts))
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[p["prompt_token_ids"][0]] * s)])
                for p, s in zip(prompts, sampling)]


def test_serve_answers_each_set_once_warms_once_and_survives_a_bad_line():
    llm, answers, warmed = FakeLLM(), [], []
    lines = [json.dumps({"name": "a", "requests": [{"prompt_token_ids": [5, 6], "max_tokens": 3}]}),
             "not json", "",
             json.dumps({"name": "b", "requests": [{"prompt_token_ids": [], "max_tokens": 3}]}),
             json.dumps({"name": "d", "requests": [7]}),
             json.dumps({"name": "c", "requests": [{"prompt_token_ids": [7], "max_tokens": 2}] * 2})]
    served = peer_vllm.serve(llm, lambda m: m, lines, answers.append, warmed.append)
    assert served == 2 and len(warmed) == 1 and llm.resets == 2       # cold before every timed set
    assert all(a.startswith(peer_vllm.RESULT) for a in answers)
    docs = [json.loads(a[len(peer_vllm.RESULT):]) for a in answers]
    assert docs[0]["name"] == "a" and docs[0]["outputs"] == [[5, 5, 5]] and docs[0]["generated_tokens"] == 3
    assert "bad command" in docs[1]["error"]
    assert "needs prompt_token_ids" in docs[2]["error"]
    assert "request 0 needs" in docs[3]["error"]
    assert docs[4]["name"] == "c" and docs[4]["requests"] == 2 and len(docs[4]["round_seconds"]) == 1


FAKE_PEER = textwrap.dedent("""
    import json, os, subprocess, sys, time
    print("INFO a log line vLLM prints on stdout", flush=True)
    if "--die" in sys.argv:
        print("boom: cannot load", file=sys.stderr); sys.exit(3)
    if "--not-ready" in sys.argv:
        print("PEER_RESULT " + json.dumps({"name": "early"}), flush=True)
    print("PEER_RESULT " + json.dumps({"ready": True, "version": "0.fake", "startup_seconds": 1.5}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        name = cmd["name"]
        if name == "bad":
            print("PEER_RESULT " + json.dumps({"error": "bad command: no"}), flush=True); continue
        if name == "crash":
            print("crashed on " + name, file=sys.stderr); sys.exit(1)
        if name == "hang":
            time.sleep(60)
        if name == "garbled":
            print("PEER_RESULT {not json", flush=True); continue
        if name == "other":
            name = "someone else"
        if name == "orphan":   # a child (vLLM's engine core) keeps stdout open after the peer dies
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            print("child", child.pid, file=sys.stderr, flush=True); os._exit(1)
        print("x" * 70000, file=sys.stderr)      # more than a pipe holds, were stderr a pipe
        print("INFO noise between answers", flush=True)
        n = sum(r["max_tokens"] for r in cmd["requests"])
        print("PEER_RESULT " + json.dumps({"name": name, "seconds": 0.5, "generated_tokens": n,
                                           "outputs": [[7] * 20000]}), flush=True)
""")


@pytest.fixture
def fake_peer(tmp_path):
    path = tmp_path / "fake_peer.py"
    path.write_text(FAKE_PEER)
    return path


def session(fake_peer, tmp_path, *extra, run_timeout=30.0):
    return VllmSession(sys.executable, tmp_path, "float32", script=fake_peer, extra=extra, run_timeout=run_timeout)


def test_session_runs_sets_in_one_process_skipping_log_lines(fake_peer, tmp_path):
    with session(fake_peer, tmp_path) as peer:
        assert peer.version == "0.fake" and peer.startup_seconds == 1.5
        pid = peer._proc.pid
        first = peer.run("x", [{"prompt_token_ids": [1], "max_tokens": 4}])
        assert first["generated_tokens"] == 4 and len(first["outputs"][0]) == 20000     # a long answer line
        assert peer.run("y", [{"prompt_token_ids": [1], "max_tokens": 2}] * 3)["generated_tokens"] == 6
        assert peer._proc.pid == pid
        with pytest.raises(PeerFailed, match="bad command"):
            peer.run("bad", [])
        with pytest.raises(PeerFailed, match="not JSON"):
            peer.run("garbled", [])
        with pytest.raises(PeerFailed, match="answered 'someone else' for 'other'"):
            peer.run("other", [{"prompt_token_ids": [1], "max_tokens": 1}])
        with pytest.raises(PeerFailed, match=r"(?s)exited \(1\).*crashed on crash"):
            peer.run("crash", [])
        with pytest.raises(PeerFailed, match="no longer reads"):
            peer.run("after", [{"prompt_token_ids": [1], "max_tokens": 1}] * 2000)
    assert peer._proc.returncode is not None


def test_a_hung_peer_is_stopped_at_the_deadline(fake_peer, tmp_path):
    peer = session(fake_peer, tmp_path, run_timeout=1.0)
    with pytest.raises(PeerFailed, match="no answer in 1 s; stopped it"):
        peer.run("hang", [])
    assert peer._proc.poll() is not None


def test_a_child_holding_stdout_neither_hangs_the_bench_nor_outlives_it(fake_peer, tmp_path):
    peer = session(fake_peer, tmp_path, run_timeout=5.0)     # time to start the child and say so
    with pytest.raises(PeerFailed, match=r"(?s)no answer in 5 s.*child (\d+)") as err:
        peer.run("orphan", [])
    child = int(re.search(r"child (\d+)", str(err.value)).group(1))
    deadline = time.monotonic() + 60
    while True:                 # SIGKILLed with the group; gone once its parent (init) reaps it
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline, f"the peer's child {child} outlived close()"
        time.sleep(0.05)


def test_a_peer_that_cannot_start_says_why(fake_peer, tmp_path):
    with pytest.raises(PeerFailed, match=r"(?s)exited \(3\).*boom: cannot load"):
        session(fake_peer, tmp_path, "--die")
    with pytest.raises(PeerFailed, match="not its ready line"):
        session(fake_peer, tmp_path, "--not-ready")


class FakeSession:
    """Records when it ran; its k-th run takes 10 + k seconds; its outputs are the prompt's first
    token, except shape s0's first request, which differs."""

    def __init__(self, log, fail_on=None):
        self.log, self.fail_on, self.version, self.closed = log, fail_on, "0.fake", False

    def run(self, name, requests):
        if (name, sum(1 for who, _ in self.log if who == "vllm")) == self.fail_on:
            raise PeerFailed("vLLM peer exited (1)")
        self.log.append(("vllm", name))
        outputs = [[r["prompt_token_ids"][0]] * r["max_tokens"] for r in requests]
        if name == "s0":
            outputs[0] = [0] * len(outputs[0])
        return {"seconds": 10.0 + len(self.log), "generated_tokens": sum(r["max_tokens"] for r in requests),
                "outputs": outputs}

    def close(self):
        self.closed = True


def _interleave(monkeypatch, rounds, fail_on=None):
    log: list = []
    fake = FakeSession(log, fail_on)
    monkeypatch.setattr(throughput_shapes, "_start_vllm", lambda *a: fake)
    monkeypatch.setattr("jupyter_pagedkv.worker.loader.load_model",
                        lambda *a, **k: SimpleNamespace(model=object()))

    def fake_ours(model, tokenizer, prompts, limits, step_log, served=None, **options):
        if served is not None:      # the warm-up passes no `served`, and is not logged
            log.append(("ours", len(prompts)))
            served.append(float(len(log)))          # ours' k-th entry in the log takes k seconds
        return [[p[0]] * m for p, m in zip(prompts, limits)]

    monkeypatch.setattr(throughput_shapes, "run_ours", fake_ours)
    work = {"s0": ([[1, 2]] * 2, [3, 3]), "s1": ([[4]] * 3, [1, 1, 1]), "s2": ([[9]], [2])}
    args = SimpleNamespace(rounds=rounds, skip=[])
    notes: list[str] = []
    ours, peer = throughput_shapes._run_interleaved(
        "float32", [(throughput_shapes.LIKE_FOR_LIKE, "dense", {})], None, None, work, args, notes)
    return log, fake, ours, peer, notes, work


def test_shapes_alternate_who_goes_first_and_rounds_pair(monkeypatch):
    log, fake, ours, peer, notes, work = _interleave(monkeypatch, rounds=2)
    sizes = {2: "s0", 3: "s1", 1: "s2"}
    order = [(who, sizes[x] if who == "ours" else x) for who, x in log]
    assert order == [("ours", "s0"), ("vllm", "s0"), ("vllm", "s1"), ("ours", "s1"), ("ours", "s2"), ("vllm", "s2"),
                     ("vllm", "s0"), ("ours", "s0"), ("ours", "s1"), ("vllm", "s1"), ("vllm", "s2"), ("ours", "s2")]
    assert fake.closed and not notes
    times, outputs = ours[throughput_shapes.LIKE_FOR_LIKE]
    # log positions 1..12: ours took its position in seconds, vLLM 10 + its position
    assert times == {"s0": [1.0, 8.0], "s1": [4.0, 9.0], "s2": [5.0, 12.0]}
    assert peer["version"] == "0.fake"
    assert {n: w["round_seconds"] for n, w in peer["workloads"].items()} == {
        "s0": [12.0, 17.0], "s1": [13.0, 20.0], "s2": [16.0, 21.0]}
    shapes = [SimpleNamespace(name=n, requests=len(w[0])) for n, w in work.items()]
    table = throughput_shapes._table(shapes, work, (times, outputs), peer)
    # tokens/s ratio = vLLM's seconds / ours, round i against round i
    assert [r["ours_over_per_round"] for r in table["rows"]] == [
        pytest.approx([12.0, 17.0 / 8]), pytest.approx([13.0 / 4, 20.0 / 9]), pytest.approx([16.0 / 5, 21.0 / 12])]
    assert table["agreement"] == {"s0": "1/2", "s1": "3/3", "s2": "1/1"}


def test_a_peer_failing_midway_drops_every_vllm_figure(monkeypatch):
    log, fake, ours, peer, notes, work = _interleave(monkeypatch, rounds=2, fail_on=("s1", 4))
    assert fake.closed and any("failed during s1" in n for n in notes)
    assert peer is None                                         # no half-filled vLLM column
    assert [who for who, _ in log].count("vllm") == 4           # round 1's three, round 2's s0
    assert [who for who, _ in log].count("ours") == 6           # ours still ran every shape, twice
