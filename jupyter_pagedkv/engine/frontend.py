"""GenerationFront: `generate`, `chat` and `stream` on top of `add_request` / `abort`, shared by
the local engine and the server client so both behave the same to a caller.

A host provides `add_request(prompt, params, request_id=None, priority=0, listener=None, tenant=None)`,
`abort(request_id)`, `is_running` (a loop steps it in the background), `step()` (called by the
caller's thread otherwise, through `_advance()`, which a host may make cheaper by not building the
step's outputs), `_handle(request_id)` (an object with a `done` Event and an `error`),
`_result(handle)` (its RequestOutput) and `apply_chat_template(messages)`; one that steps in a
background thread sets `_loop` (its StepLoop), which `admission()` holds.
"""
from __future__ import annotations

import contextlib
import queue
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Iterator, Sequence as Seq

from ..core.sampling_params import SamplingParams, is_int, show
from .outputs import RequestOutput, StreamDelta

if TYPE_CHECKING:
    from .background import StepLoop


def is_single_prompt(prompt: Any) -> bool:
    """Text, one list of token ids, or a conversation the server templates (`.messages`)."""
    if isinstance(prompt, str) or hasattr(prompt, "messages"):
        return True
    return isinstance(prompt, (list, tuple)) and bool(prompt) and all(is_int(t) for t in prompt)


def prompt_list(prompts: Any) -> list:
    """One prompt as a list of one; a list of prompts as is. Whether each prompt is readable is
    the engine's check (`intake.tokenize`); anything that is not a prompt or a list of them is one
    line here."""
    if is_single_prompt(prompts):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts must be text, a list of token ids, or a list of those, got {show(prompts)}")
    prompts = list(prompts)
    if not prompts:
        raise ValueError("no prompts given")
    return prompts


def check_messages(messages) -> None:
    """A conversation is a non-empty list of {"role": ..., "content": text} dicts."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("a chat is a non-empty list of {'role': ..., 'content': ...} messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"chat message {i} is {type(m).__name__}, not a {{'role', 'content'}} dict")
        if m.get("role") not in ("system", "user", "assistant", "tool"):
            raise ValueError(f"chat message {i} has role {show(m.get('role'))}: use system, user, assistant or tool")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"chat message {i} has no text content (got {type(m.get('content')).__name__})")


def param_list(params: SamplingParams | Seq[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    if not isinstance(params, (list, tuple)):
        raise ValueError(f"params must be SamplingParams, a list of them (one per prompt) or None "
                         f"(beam search: beam_search()), got {show(params)}")
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts: give one, or one per prompt")
    return params


class GenerationFront:
    """The high-level calls; see the module docstring for what a host must provide."""

    # A host that steps in a background thread sets this (the local engine's StepLoop).
    _loop: StepLoop | None = None

    def admission(self) -> AbstractContextManager[None]:
        """`with host.admission():` the requests added inside are all queued before the
        background loop's next step, so the scheduler considers them together (the loop may
        otherwise step between two adds, several times on a busy machine). Only add (or abort)
        inside: the loop takes no step there, so waiting on a request would never end (`generate`
        and `stream` refuse to). A server admits each request as it arrives: a no-op there."""
        return self._loop.held() if self._loop is not None else contextlib.nullcontext()

    def _refuse_waiting_in_admission(self) -> None:
        if self._loop is not None and self.is_running and self._loop.held_here():
            raise RuntimeError("cannot wait for requests inside `with engine.admission():` (the engine takes "
                               "no step there): add them inside, wait after the block")

    def _advance(self) -> None:
        """One step for a caller that reads results from the handles and listeners, not from the
        step's outputs."""
        self.step()

    def generate(self, prompts, params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False, tenant: str | None = None,
                 priority: int | Seq[int] = 0) -> list[RequestOutput]:
        """Run prompts to completion together; one RequestOutput per prompt, in order. `tenant`
        names who sends them all (see `add_request`); `priority`, one for all or one per prompt
        (vLLM's list), says who goes first (lower first)."""
        prompts = prompt_list(prompts)
        if isinstance(priority, (list, tuple)) and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts: give one, or one per prompt")
        priorities = list(priority) if isinstance(priority, (list, tuple)) else [priority] * len(prompts)
        return self._wait(self._submit_all(prompts, param_list(params, len(prompts)), tenant, priorities),
                          use_tqdm)

    def chat(self, messages, params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool = False, tenant: str | None = None) -> list[RequestOutput]:
        """Chat-template one conversation (a list of {role, content}) or a list of them, then generate."""
        if not isinstance(messages, (list, tuple)) or not messages:
            check_messages(messages)
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        for conversation in conversations:   # every one before any is templated or queued
            check_messages(conversation)
        return self.generate([self.apply_chat_template(c) for c in conversations], params, use_tqdm, tenant)

    def stream(self, prompt, params: SamplingParams | None = None,
               request_id: str | None = None, tenant: str | None = None) -> Iterator[StreamDelta]:
        """Yield text increments as they are generated; closing the iterator aborts the request."""
        self._refuse_waiting_in_admission()
        listener: queue.SimpleQueue = queue.SimpleQueue()
        rid = self.add_request(prompt, params, request_id, listener=listener, tenant=tenant)
        handle = self._handle(rid)
        try:
            while True:
                if not self.is_running:
                    while listener.empty() and not handle.done.is_set():
                        self._advance()
                    if listener.empty() and handle.done.is_set():
                        if handle.error is not None:
                            raise handle.error
                        return
                delta = listener.get()
                yield delta
                if delta.finished:
                    if handle.error is not None:
                        raise handle.error
                    return
        finally:
            if not handle.done.is_set():
                self.abort(rid)

    # -- shared -------------------------------------------------------------------------------------
    def _submit_all(self, prompts: list, params: list, tenant: str | None = None,
                    priorities: list | None = None) -> list[str]:
        """Add every request, or none: a rejected one aborts those already added. Its callers
        then wait for them, which `admission()` would never let end."""
        self._refuse_waiting_in_admission()
        ids: list[str] = []
        try:
            with self.admission():
                for p, sp, prio in zip(prompts, params, priorities or [0] * len(prompts)):
                    ids.append(self.add_request(p, sp, priority=prio, tenant=tenant))
        except BaseException:
            for rid in ids:
                self.abort(rid)
            raise
        return ids

    def _wait(self, ids: list[str], use_tqdm: bool = False) -> list[RequestOutput]:
        """Step (or wait for the loop) until every request is done; Ctrl-C aborts them all."""
        handles = [self._handle(rid) for rid in ids]
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(handles), desc="generate", unit="req")
        try:
            pending = list(handles)
            while pending:
                if self.is_running:
                    pending[0].done.wait(timeout=0.1)
                else:
                    self._advance()
                left = [h for h in pending if not h.done.is_set()]
                if bar is not None and len(left) < len(pending):
                    bar.update(len(pending) - len(left))
                pending = left
        except BaseException:
            for rid in ids:
                self.abort(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        for h in handles:
            if h.error is not None:
                raise h.error
        return [self._result(h) for h in handles]
