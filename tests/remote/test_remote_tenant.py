"""`tenant=` on the server client: sent as vLLM's `cache_salt` (0.9 and later), named on the output,
checked as the local engine checks it, and refused in one line, before anything is sent, by a
server that would ignore the salt (fake_vllm.py models the salted prefix cache)."""
from __future__ import annotations

import threading

import pytest

from jupyter_pagedkv import Engine
from jupyter_pagedkv.core.sampling_params import SamplingParams
from jupyter_pagedkv.engine.intake import check_tenant
from jupyter_pagedkv.remote.cache_salt import release
from jupyter_pagedkv.remote.errors import RemoteError, UnsupportedByServer

from fake_vllm import fake, magic_shell  # noqa: F401  (the fixtures)

TWO = SamplingParams(max_tokens=2)


def request_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("pagedkv-remote-")}


@pytest.fixture
def vllm(fake):
    """The fake server reporting a vLLM release that takes cache_salt."""
    handler, url = fake
    handler.version = "0.9.2"
    return handler, url


def test_tenant_is_sent_as_cache_salt_and_named_on_the_output(vllm):
    handler, url = vllm
    client = Engine.connect(url)
    out = client.generate("ok", TWO, tenant="alice")[0]
    assert handler.bodies[-1]["cache_salt"] == "alice"
    assert out.tenant == "alice" and out.text == "Hello world"
    last = list(client.stream("ok", TWO, tenant="bob"))[-1]
    assert handler.bodies[-1]["cache_salt"] == "bob" and last.output.tenant == "bob"
    client.chat([{"role": "user", "content": "hi"}], TWO, tenant="carol")
    assert handler.bodies[-1]["cache_salt"] == "carol" and "messages" in handler.bodies[-1]
    plain = client.generate("ok", TWO)[0]
    assert "cache_salt" not in handler.bodies[-1] and plain.tenant is None
    assert not client.live_requests()


def test_a_tenant_hits_only_the_prefixes_its_own_salt_cached(vllm):
    _, url = vllm
    client = Engine.connect(url)
    cached = lambda tenant: client.generate("ok", TWO, tenant=tenant)[0].num_cached_tokens
    assert [cached("alice"), cached("alice"), cached("bob"), cached(None)] == [0, 2, 0, 2]


@pytest.mark.parametrize("bad", ["", "   ", 5, ["alice"]])
def test_a_bad_tenant_is_the_local_engines_line_and_nothing_is_sent(vllm, bad):
    handler, url = vllm
    client = Engine.connect(url)
    with pytest.raises(ValueError) as local:
        check_tenant(bad)
    with pytest.raises(ValueError) as remote:
        client.generate("ok", TWO, tenant=bad)
    assert str(remote.value) == str(local.value) and "\n" not in str(remote.value)
    assert handler.bodies == [] and not client.live_requests()


@pytest.mark.parametrize("version, message", [
    ("0.8.5", r"runs vLLM 0\.8\.5, which ignores cache_salt \(added in 0\.9\), so tenant= would not "
              r"isolate prefixes there: upgrade vLLM to >= 0\.9, or leave tenant= out"),
    (None, r"reports no vLLM version \(/version\), so tenant= cannot be sent: only vLLM >= 0\.9"),
    ("fake", r"reports version 'fake', not a vLLM release: cannot tell whether it honours cache_salt"),
])
def test_a_server_that_would_ignore_the_salt_is_refused_before_sending(fake, version, message):
    handler, url = fake
    handler.version = version
    client = Engine.connect(url)
    before = request_threads()
    with pytest.raises(RemoteError, match=message) as info:
        client.generate("ok", TWO, tenant="alice")
    assert "\n" not in str(info.value) and url in str(info.value)
    assert isinstance(info.value, UnsupportedByServer) and isinstance(info.value, ValueError)
    assert handler.bodies == [] and request_threads() <= before     # none started (an old one may end)
    assert not client.live_requests() and not client.finished_requests
    assert client.generate("ok", TWO)[0].text == "Hello world"   # without tenant= it still serves


def test_a_400_naming_cache_salt_is_one_line_and_ends_only_that_request(fake):
    handler, url = fake
    handler.version = "0.9.0"
    handler.refuse_salt = ("Parameter 'cache_salt' is not supported with this instance of vLLM, "
                           "which uses engine V0.")
    client = Engine.connect(url)
    with pytest.raises(RemoteError, match=r"\(vLLM 0\.9\.0\) refused tenant= as cache_salt: Parameter "
                                          r".* engine V0\.; run vLLM >= 0\.9 on its V1 engine, or "
                                          r"leave tenant= out") as info:
        client.generate("ok", TWO, tenant="alice")
    assert "\n" not in str(info.value)
    failed = client.finished_requests[-1]
    assert failed.finish[0] == "error" and failed.tenant == "alice"
    failed.thread.join(600)
    assert not failed.thread.is_alive() and not client.live_requests()
    assert client.generate("ok", TWO)[0].text == "Hello world"


@pytest.mark.parametrize("version, parsed", [
    ("0.9.2", (0, 9)), ("0.10.1rc1", (0, 10)), ("0.9.1.dev238+g0a1b2c3.cpu", (0, 9)),
    ("v1.0.0", (1, 0)), ("fake", None), (None, None),
])
def test_release_reads_major_and_minor(version, parsed):
    assert release(version) == parsed


def test_later_releases_take_the_salt(fake):
    handler, url = fake
    handler.version = "0.10.1"       # compared as numbers: "0.10" < "0.9" as text
    client = Engine.connect(url)
    assert client.generate("ok", TWO, tenant="alice")[0].tenant == "alice"
    assert handler.bodies[-1]["cache_salt"] == "alice"


def test_generate_magic_sends_the_tenant_or_says_in_one_line_why_it_cannot(fake, magic_shell, capsys):
    from IPython.core.error import UsageError

    handler, url = fake
    ip = magic_shell
    ip.run_line_magic("pagedkv", f"connect {url}")      # reports version 'fake'
    with pytest.raises(UsageError, match="not a vLLM release: cannot tell whether it honours"):
        ip.run_cell_magic("generate", "--max-tokens 2 --raw --tenant alice", "ok")
    assert handler.bodies == []
    handler.version = "0.9.2"
    ip.run_line_magic("pagedkv", f"connect {url}")
    ip.run_cell_magic("generate", "--max-tokens 2 --raw --tenant alice", "ok")
    assert "Hello world" in capsys.readouterr().out and handler.bodies[-1]["cache_salt"] == "alice"
    ip.run_line_magic("pagedkv", "disconnect")


def test_a_server_refuses_tenant_weights_block_tables_and_why_in_one_line_that_says_what_to_do(vllm, magic_shell):
    """The server client implements the whole EngineClient: what a server cannot give is refused
    as the user's one-line mistake (a ValueError), never faked, and the magic shows that line."""
    from IPython.core.error import UsageError

    _, url = vllm
    client = Engine.connect(url)
    for call in (lambda: client.set_tenant("alice", weight=2), client.block_tables, client.why):
        with pytest.raises(UnsupportedByServer, match=r"%pagedkv disconnect") as err:
            call()
        assert isinstance(err.value, ValueError) and "\n" not in str(err.value)
    magic_shell.run_line_magic("pagedkv", f"connect {url}")
    with pytest.raises(UsageError, match="takes no tenant weights or caps"):
        magic_shell.run_line_magic("pagedkv", "tenant alice --weight 2")
    with pytest.raises(UsageError, match="why a prompt missed is not available from a server"):
        magic_shell.run_line_magic("pagedkv", "why")
    magic_shell.run_line_magic("pagedkv", "disconnect")


def test_a_server_failure_is_an_engine_unavailable_error_for_every_front_end():
    from jupyter_pagedkv.protocol import EngineUnavailable

    assert issubclass(RemoteError, EngineUnavailable) and issubclass(UnsupportedByServer, EngineUnavailable)
    assert not issubclass(EngineUnavailable, ValueError)      # not the user's mistake, unlike a bad argument
