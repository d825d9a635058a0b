"""OutputProcessor: new tokens in, stop decisions, text and streamed deltas out.

Everything that turns a sampled token into something a caller sees lives here: the stop rules
(stop token ids, EOS, stop strings, max_tokens, the model's context), detokenisation, the
RequestOutput of a request, and the StreamDeltas its listeners receive (text withheld while it
ends inside an incomplete UTF-8 character). The engine calls it under its lock.
"""
from __future__ import annotations

import logging
import weakref

from ..core.scheduler import Scheduler
from ..core.sequence import Sequence
from ..worker.logprobs import TokenLogprobs
from .detokenizer import IncrementalText, WindowDecoder, decodes_locally
from .logprobs import as_position
from .outputs import CompletionOutput, RequestOutput, StreamDelta
from .request import Request

logger = logging.getLogger(__name__)


class ListenerGone(RuntimeError):
    """A listener refused a delta (its consumer is gone); it is dropped, the others still got it."""


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int, scheduler: Scheduler) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.scheduler = scheduler
        # Each live sequence's text so far (engine/detokenizer.py), dropped with the sequence.
        self._texts: weakref.WeakKeyDictionary[Sequence, IncrementalText] = weakref.WeakKeyDictionary()
        self._local = tokenizer is not None and decodes_locally(tokenizer)
        self._decoders: dict[bool, WindowDecoder] = {}     # by skip_special_tokens, made on first use

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_token(self, token: int) -> str | None:
        """One token alone as text, special tokens kept (what a logprob entry shows)."""
        return None if self.tokenizer is None else self.tokenizer.decode([token], skip_special_tokens=False)

    def text_of(self, seq: Sequence) -> str:
        """A sequence's output text so far, special tokens kept or skipped as its request asks:
        the tokens since the last call decoded in a short window (IncrementalText), not all of them."""
        skip = getattr(seq.params, "skip_special_tokens", True)
        if not self._local:
            return self.decode(seq.output_token_ids, skip)
        decoder = self._decoders.get(skip)
        if decoder is None:
            decoder = self._decoders[skip] = WindowDecoder.of(self.tokenizer, skip)
        text = self._texts.get(seq)
        if text is None:
            text = self._texts[seq] = IncrementalText()
        return text.extend(decoder, seq.output_token_ids)

    def text_now(self, req: Request, seq: Sequence) -> str:
        """What a sequence's text reads at this step: its final text once made (the request has
        ended, or a stop string cut it), else the text so far, also for a sample that ended
        before its siblings (its final text is made when the request ends)."""
        if seq.is_finished and (req.finished or isinstance(seq.stop_reason, str)):
            return seq.text
        return self.text_of(seq)

    def final_text_of(self, seq: Sequence) -> str:
        """A finished sequence's text: the whole list decoded once more, so it is `decode`'s even
        where a tokenizer's decoding is not local after all (then said in the log)."""
        text = self.decode(seq.output_token_ids, getattr(seq.params, "skip_special_tokens", True))
        grown = self._texts.pop(seq, None)
        if grown is not None and grown.ids == seq.output_token_ids and grown.text != text:
            logger.warning("request %s: the text grown token by token differed from the whole decode at its "
                           "end (%r vs %r); the whole decode is kept", seq.request_id, grown.text[-40:], text[-40:])
        return text

    # -- tokens ---------------------------------------------------------------------------------
    def append_token(self, req: Request, seq: Sequence, token: int, now: float,
                     logprobs: TokenLogprobs | None = None) -> None:
        """Append one sampled token (with its logprobs, when asked) and finish the sequence if a
        stop rule says so."""
        seq.token_ids.append(token)
        if seq.grammar is not None and not seq.grammar.accept(token):
            raise ValueError(f"token {token} breaks the request's structured_outputs grammar (the mask "
                             f"allowed no token: does min_tokens forbid the end it reached?)")
        if logprobs is not None:
            req.logprobs.setdefault(seq.sample_index, []).append(as_position(logprobs, self.decode_token))
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        req.metrics.num_generated_tokens += 1
        params = seq.params
        reason: str | None = None
        if token in params.stop_token_ids:
            reason, seq.stop_reason = "stop", token
        elif not params.ignore_eos and token in self.eos_token_ids:
            reason = "stop"
        elif params.stop and self.tokenizer is not None:
            text = self.text_of(seq)
            if any(s in text for s in params.stop):     # the cut is made in the whole list's decode
                text = self.final_text_of(seq)
            for s in params.stop:
                at = text.find(s)
                if at >= 0:
                    end = at + len(s) if params.include_stop_str_in_output else at
                    reason, seq.stop_reason, seq.text = "stop", s, text[:end]
                    break
        if reason is None and seq.grammar is not None and seq.grammar.terminated:
            reason = "stop"   # the grammar is complete (it accepted a stop token, even under ignore_eos)
        if reason is None and (seq.num_output_tokens >= params.max_tokens
                               or seq.num_tokens >= self.max_model_len):
            reason = "length"
        if reason is not None:
            self.scheduler.finish(seq, reason)

    # -- requests ---------------------------------------------------------------------------------
    def finish(self, req: Request, now: float) -> None:
        """Fix the final texts (and beam hypotheses) and tell the listeners."""
        req.metrics.finish_time = now
        try:
            for seq in req.seqs:
                if seq.stop_reason is None or not isinstance(seq.stop_reason, str):
                    seq.text = self.final_text_of(seq)
            if req.beam is not None:
                req.beam.finalize(self.decode, req.seqs)
        except Exception as err:   # its text cannot be made: the request ends with that error
            logger.error("request %s: detokenising its output failed: %s", req.request_id, err)
            if req.error is None:
                req.error = err
                for seq in req.seqs:
                    seq.finish_reason = "error"
        try:
            self.publish(req)
        except ListenerGone:     # the request is over anyway: the other listeners got their delta
            logger.warning("request %s: a listener was gone at its end", req.request_id, exc_info=True)
        req.done.set()

    def output(self, req: Request) -> RequestOutput:
        completions = []
        wants = getattr(req.params, "logprobs", None) is not None
        for i, seq in enumerate(req.seqs):
            text = self.text_now(req, seq)
            lps = list(req.logprobs.get(seq.sample_index, ())) if wants else None
            completions.append(CompletionOutput(
                i, text, list(seq.output_token_ids), seq.finish_reason, seq.stop_reason, logprobs=lps,
                cumulative_logprob=sum(p[t].logprob for p, t in zip(lps, seq.output_token_ids)) if wants else None))
        if req.beam is not None and req.finished:
            completions = [CompletionOutput(i, b.text, list(b.token_ids), b.finish_reason, score=b.score)
                           for i, b in enumerate(req.beam.sequences)]
        cached = req.seqs[0].num_cached_tokens or 0
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, completions,
                             req.finished, cached, req.metrics, req.tenant,
                             None if req.prompt_logprobs is None else list(req.prompt_logprobs))

    def publish(self, req: Request) -> None:
        """Send each listener the text and tokens added since the last update."""
        if not req.listeners:
            return
        seq = req.seqs[0]
        finished = req.finished
        tokens = seq.output_token_ids
        text = self.text_now(req, seq)
        if req.beam is not None:
            if not finished:
                return   # beams reorder every step: only the final hypotheses are published
            tokens, text = req.beam.sequences[0].token_ids, req.beam.sequences[0].text
        if not finished and text.endswith("\ufffd"):
            return   # an incomplete UTF-8 sequence: wait for the next token
        sent = "".join(req.sent_text)
        new_tokens = tokens[len(req.sent_tokens):]
        new_text = text[len(sent):] if text.startswith(sent) else text
        if not new_tokens and not new_text and not finished:
            return
        req.sent_text.append(new_text)
        req.sent_tokens.extend(new_tokens)
        delta = StreamDelta(req.request_id, new_text, new_tokens, finished, seq.finish_reason,
                            self.output(req) if finished else None, req.error if finished else None)
        gone = None
        for q in list(req.listeners):
            try:
                q.put(delta)
            except Exception as err:
                logger.info("request %s: dropping a listener that failed (%s)", req.request_id, err)
                req.listeners.remove(q)
                gone = gone or err
        if gone is not None:
            raise ListenerGone(f"a listener of {req.request_id} failed: {type(gone).__name__}: {gone}") from gone
