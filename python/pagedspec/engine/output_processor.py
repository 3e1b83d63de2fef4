"""Output processing: a step's token ids become what the API returns. Per completion: incremental
detokenization, stop strings (the text is cut before the stop string, and while a completion runs
its last ``len(longest stop) - 1`` characters are held back, so a stop string is never half-sent),
logprobs with decoded tokens, and :class:`RequestOutput` in the request's output kind
(cumulative, delta, final only). It never touches the scheduler: a stop string it finds is
reported to the :class:`~pagedspec.engine.engine.Engine`, which ends the sequence in the core.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence as Seq, Union

from pagedspec.engine.core import CoreRequest, SeqUpdate
from pagedspec.engine.outputs import (CompletionOutput, Logprob, RequestMetrics, RequestOutput,
                                      RequestOutputKind, SamplingParams)


class IncrementalDetokenizer:
    """Text of a growing list of token ids, decoded a few tokens at a time.

    Each new token is decoded together with the tokens since the last emitted text (plus a few
    tokens of context, so that tokenizers whose pieces carry leading spaces decode them right),
    and text is emitted once it no longer ends in an incomplete UTF-8 sequence. O(1) per token.
    """

    def __init__(self, tokenizer, prompt_token_ids: Seq[int], context: int = 6):
        self.tokenizer = tokenizer
        self.ids = list(prompt_token_ids[-context:])
        self.prefix_offset, self.read_offset = 0, len(self.ids)
        self.text = ""

    def _decode(self, ids: Seq[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def add(self, token: int) -> str:
        """Appends a token; returns the text it completed ("" while a character is partial)."""
        self.ids.append(token)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """The text of tokens still held back (an incomplete character at the very end)."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        delta = full[len(prefix):]
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta


@dataclass(eq=False)
class _CompletionState:
    index: int
    detok: Optional[IncrementalDetokenizer]
    token_ids: list[int] = field(default_factory=list)
    logprobs: Optional[list[dict[int, Logprob]]] = None
    cumulative_logprob: Optional[float] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    text: str = ""                       # the completion's text (cut at a stop string)
    stop_checked: int = 0                # characters of text searched for stop strings
    sent_text: int = 0                   # DELTA: what earlier outputs carried
    sent_tokens: int = 0


@dataclass(eq=False)
class _RequestState:
    core: CoreRequest
    prompt: Optional[str]
    params: SamplingParams
    stops: list[str]
    hold_back: int                       # characters a running completion keeps back
    completions: dict[int, _CompletionState] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return (len(self.completions) == self.params.n
                and all(c.finish_reason is not None for c in self.completions.values()))


class OutputProcessor:
    """Turns the core's :class:`SeqUpdate`s into :class:`RequestOutput`s."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.requests: dict[str, _RequestState] = {}

    def add(self, request: CoreRequest, prompt: Optional[str]) -> None:
        stops = request.params.stop_strings
        self.requests[request.request_id] = _RequestState(
            request, prompt, request.params, stops,
            max((len(s) for s in stops), default=1) - 1)

    def abort(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.requests

    def _piece(self, token: int) -> Optional[str]:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else None

    def process(self, updates: Seq[SeqUpdate]
                ) -> tuple[list[RequestOutput], list[tuple[str, int]]]:
        """The outputs of the requests these updates touched, and the completions a stop string
        ended while their sequences still run, as ``(request_id, index)``, for the engine to end."""
        stopped: list[tuple[str, int]] = []
        touched: dict[str, _RequestState] = {}
        for u in updates:
            state = self.requests.get(u.request.request_id)
            if state is None:
                continue
            c = state.completions.get(u.index)
            if c is None:
                detok = (IncrementalDetokenizer(self.tokenizer, u.request.prompt_token_ids)
                         if self.tokenizer is not None else None)
                wants_logprobs = state.params.logprobs is not None
                c = state.completions[u.index] = _CompletionState(
                    u.index, detok, logprobs=[] if wants_logprobs else None,
                    cumulative_logprob=0.0 if wants_logprobs else None)
            touched[u.request.request_id] = state
            if c.finish_reason is not None:     # ended by a stop string; tokens after it
                c.token_ids += u.new_token_ids  # are still the sequence's
                continue
            self._add_tokens(c, u)
            if self._find_stop(state, c):
                if u.finish_reason is None:
                    stopped.append((u.request.request_id, u.index))
            elif u.finish_reason is not None:
                if c.detok is not None:
                    c.text += c.detok.flush()
                c.finish_reason, c.stop_reason = u.finish_reason, u.stop_reason
        outputs = []
        for request_id, state in touched.items():
            out = self._output(state)
            if out is not None:
                outputs.append(out)
            if state.finished:
                del self.requests[request_id]
        return outputs, stopped

    def _add_tokens(self, c: _CompletionState, u: SeqUpdate) -> None:
        c.token_ids += u.new_token_ids
        if c.logprobs is not None and u.new_logprobs is not None:
            for token, (chosen, rank, pairs) in zip(u.new_token_ids, u.new_logprobs):
                entry = {t: Logprob(v, n + 1, self._piece(t)) for n, (t, v) in enumerate(pairs)}
                entry.setdefault(token, Logprob(chosen, rank, self._piece(token)))
                c.logprobs.append(entry)
                c.cumulative_logprob += entry[token].logprob
        if c.detok is not None:
            for token in u.new_token_ids:
                c.text += c.detok.add(token)

    @staticmethod
    def _find_stop(state: _RequestState, c: _CompletionState) -> bool:
        """Cuts the text before the first stop string, if one appeared."""
        if not state.stops or c.detok is None:
            return False
        # Text before this step held no stop string, so a hit overlaps the new text: search
        # only where it can start (not the whole text every token).
        text, seen = c.text, c.stop_checked
        hits = [(pos, s) for s in state.stops
                if (pos := text.find(s, max(0, seen - len(s) + 1))) >= 0]
        c.stop_checked = len(text)
        if not hits:
            return False
        pos, s = min(hits)
        c.text = text[:pos]
        c.finish_reason, c.stop_reason = "stop", s
        return True

    def _output(self, state: _RequestState) -> Optional[RequestOutput]:
        kind = state.params.output_kind
        finished = state.finished
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        outs = []
        for index in sorted(state.completions):
            c = state.completions[index]
            visible = len(c.text) if c.finish_reason is not None \
                else min(max(len(c.text) - state.hold_back, c.sent_text), len(c.text))
            if kind is RequestOutputKind.DELTA:
                text, tokens = c.text[c.sent_text:visible], c.token_ids[c.sent_tokens:]
                logprobs = c.logprobs[c.sent_tokens:] if c.logprobs is not None else None
                c.sent_text, c.sent_tokens = visible, len(c.token_ids)
            else:
                text, tokens = c.text[:visible], list(c.token_ids)
                logprobs = list(c.logprobs) if c.logprobs is not None else None
            outs.append(CompletionOutput(index, text, tokens, c.cumulative_logprob, logprobs,
                                         c.finish_reason, c.stop_reason))
        core = state.core
        metrics = RequestMetrics(core.arrival_time, core.first_scheduled_time,
                                 core.first_token_time,
                                 max(core.last_token_time.values(), default=None),
                                 core.finished_time)
        return RequestOutput(core.request_id, state.prompt, core.prompt_token_ids, outs,
                             finished, metrics,
                             core.seqs[0].num_cached_tokens if core.seqs else 0)
