"""The server's API key stays out of notebooks and output (remote/api_key.py): it comes from the
environment (--api-key-env NAME, VLLM_API_KEY, OPENAI_API_KEY), an inline key warns once, a key
bound for another machine over http:// warns, and no output path ever shows it."""
from __future__ import annotations

import logging
import warnings

import pytest
from IPython.core.error import UsageError

from jupyter_pagedkv import Engine, SamplingParams
from jupyter_pagedkv.remote import api_key
from jupyter_pagedkv.remote.client import RemoteError
from jupyter_pagedkv.remote.peer_server import ServerConfig, redacted

from fake_vllm import fake, magic_shell  # noqa: F401  (fixtures)

SECRET = "sk-do-not-print-4242"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in (*api_key.ENV_NAMES, "MY_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(api_key, "_warned_inline", False)


@pytest.mark.parametrize("env, given, expected", [
    ({"VLLM_API_KEY": "a", "OPENAI_API_KEY": "b"}, {}, ("a", "VLLM_API_KEY")),
    ({"OPENAI_API_KEY": "b"}, {}, ("b", "OPENAI_API_KEY")),
    ({"VLLM_API_KEY": "a", "MY_KEY": "c"}, {"env_name": "MY_KEY"}, ("c", "MY_KEY")),
    ({}, {}, None),
])
def test_the_key_comes_from_the_environment_in_order(monkeypatch, env, given, expected):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with warnings.catch_warnings():
        warnings.simplefilter("error")       # none of these warns
        key = api_key.resolve(**given)
    assert (key.secret, key.source) == expected if expected else key is None


def test_a_named_variable_that_is_not_set_is_one_line():
    with pytest.raises(ValueError, match="^environment variable MY_KEY is not set"):
        api_key.resolve(env_name="MY_KEY")
    with pytest.raises(ValueError, match="not both"):
        api_key.resolve("x", "MY_KEY")


def test_an_inline_key_works_and_warns_once(fake):
    handler, url = fake
    handler.key = SECRET
    with pytest.warns(api_key.KeyWarning, match="saved in the notebook and its history"):
        assert Engine.connect(url, api_key=SECRET).model == "m"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Engine.connect(url, api_key=SECRET)   # once per kernel


@pytest.mark.parametrize("url, warns", [
    ("http://10.1.2.3:8000", True), ("http://gpu-box:8000", True), ("https://gpu-box:8000", False),
    ("http://127.0.0.1:8000", False), ("http://localhost:8000", False), ("http://[::1]:8000", False),
])
def test_a_key_bound_over_plain_http_to_another_machine_warns(url, warns):
    from jupyter_pagedkv.remote.client import _base_url
    scheme, host, _, _ = _base_url(url)
    key = api_key.ApiKey(SECRET, "VLLM_API_KEY")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        api_key.warn_if_exposed(key, scheme, host)
    assert bool(seen) == warns
    if warns:
        assert "unencrypted over http://" in str(seen[0].message) and SECRET not in str(seen[0].message)


def test_the_key_is_never_printed_logged_or_shown(fake, magic_shell, monkeypatch, capsys, caplog):
    """Every output path: stdout, stderr, log records (with tracebacks), warnings, exception
    messages, the client's repr and its attributes' reprs, the peer server's printed command."""
    handler, url = fake
    handler.key = SECRET
    monkeypatch.setenv("VLLM_API_KEY", SECRET)
    caplog.set_level(logging.DEBUG)
    seen: list[str] = []
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        client = Engine.connect(url)
        seen += [repr(client), str(client), repr(vars(client)), str(client.api_key), repr(client.api_key)]
        assert client.generate("ok", SamplingParams(max_tokens=2))[0].text == "Hello world"
        with pytest.raises(RemoteError) as err:
            client.generate("garbled", SamplingParams(max_tokens=2))   # logs its traceback too
        seen.append(str(err.value))
        monkeypatch.setenv("VLLM_API_KEY", SECRET + "-wrong")
        with pytest.raises(RemoteError) as err:
            Engine.connect(url)
        seen.append(str(err.value))
        monkeypatch.setenv("MY_KEY", SECRET)
        magic_shell.run_line_magic("pagedkv", f"connect {url} --api-key-env MY_KEY")
        magic_shell.run_cell_magic("generate", "--max-tokens 2 --raw", "ok")
        with pytest.raises(UsageError) as err:
            magic_shell.run_cell_magic("generate", "--max-tokens 2 --raw", "drop")
        seen.append(str(err.value))
        magic_shell.run_line_magic("pagedkv", "status")
        magic_shell.run_line_magic("pagedkv", "requests")
        magic_shell.run_line_magic("pagedkv", f"connect {url} --api-key {SECRET}")   # inline: warns
        magic_shell.run_line_magic("pagedkv", "disconnect")
    seen += [str(w.message) for w in warned]
    assert any("saved in the notebook" in text for text in seen)
    out = capsys.readouterr()
    seen += [out.out, out.err]
    seen += [r.getMessage() + (r.exc_text or "") for r in caplog.records]
    seen.append(" ".join(redacted(ServerConfig("/m", api_key=SECRET).argv("python"))))
    leaks = [text for text in seen if SECRET in text]
    assert not leaks, leaks
