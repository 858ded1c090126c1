"""OutputProcessor: engine token ids -> text deltas, stop strings, final results (API side).

One `RequestState` per live request holds its streaming detokenizer and the text so far. Text
that could be the start of a stop string is held back until it is known not to be one, so a
stop string never leaks into a stream. A stop-string match ends the request here, and the
caller must abort it in the engine (`TextDelta.abort_engine`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from servelm.engine.outputs import EngineCoreOutput, ErrorKind, Logprobs
from servelm.engine.sampling_params import SamplingParams
from servelm.text.tokenizer import TextTokenizer


@dataclass
class TextDelta:
    request_id: str
    text: str  # new text since the previous delta
    token_ids: list[int]  # new token ids since the previous delta
    logprobs: list[Logprobs] | None = None
    finish_reason: str | None = None
    abort_engine: bool = False  # finished here (stop string) but still running in the engine
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    queued_time: float | None = None
    error: str | None = None
    error_kind: ErrorKind | None = None  # with `error`: whose fault (unset: the engine's)
    # chat with tools: the OpenAI `delta.tool_calls` entries the API process read from the text
    tool_calls: list[dict] | None = None
    # the prompt's logprobs (first entry None), with a request's first delta when it asked
    prompt_logprobs: list[Logprobs | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestState:
    request_id: str
    params: SamplingParams
    detokenizer: object
    text: str = ""
    sent: int = 0  # characters of `text` already handed out
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False


class OutputProcessor:
    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add_request(
        self, request_id: str, params: SamplingParams, prompt_token_ids: Sequence[int] = ()
    ) -> None:
        """`prompt_token_ids`: what the text follows (a SentencePiece answer's first word keeps
        its space after a prompt, `IncrementalDetokenizer`)."""
        stream = self.tokenizer.decode_stream(params.skip_special_tokens, prompt_token_ids)
        self.states[request_id] = RequestState(request_id, params, stream)

    def remove(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def process(self, out: EngineCoreOutput) -> TextDelta | None:
        state = self.states.get(out.request_id)
        if state is None or state.finished:
            return None
        delta = TextDelta(
            out.request_id,
            "",
            [],
            out.logprobs,
            out.finish_reason,
            False,
            out.num_prompt_tokens,
            out.num_cached_tokens,
            out.queued_time,
            out.error,
            out.error_kind,
        )
        delta.prompt_logprobs = out.prompt_logprobs
        params = state.params
        for i, tok in enumerate(out.new_token_ids):
            state.token_ids.append(tok)
            delta.token_ids.append(tok)
            if tok == out.stop_token_id and not params.include_stop_str_in_output:
                continue  # the eos / stop token's text is not part of the text (vLLM's rule)
            before = len(state.text)
            state.text += state.detokenizer.step(tok)
            # Like EOS and stop_token_ids, stop strings count only after min_tokens tokens.
            if (
                params.stop
                and len(state.token_ids) > params.min_tokens
                and self._match_stop(state, before)
            ):
                delta.token_ids = delta.token_ids[: i + 1]
                if delta.logprobs:
                    delta.logprobs = delta.logprobs[: i + 1]
                delta.finish_reason = "stop"
                delta.abort_engine = out.finish_reason is None
                break
        if delta.finish_reason is not None:
            state.finished = True
            end = len(state.text)
        else:
            end = len(state.text) - self._holdback(params)
        if end > state.sent:
            delta.text = state.text[state.sent : end]
            state.sent = end
        if state.finished:
            del self.states[out.request_id]
        return delta

    @staticmethod
    def _holdback(params: SamplingParams) -> int:
        return max((len(s) for s in params.stop), default=1) - 1

    @staticmethod
    def _match_stop(state: RequestState, new_from: int) -> bool:
        """Cut the text at the first stop string that ends past `new_from`; True if one did.

        Only matches that end in the new text count: an earlier one was either caught when it
        ended or came before min_tokens. Such a match starts at or after `state.sent`, since
        the hold-back keeps the last (longest stop - 1) characters unsent.
        """
        params = state.params
        best = None
        for s in params.stop:
            pos = state.text.find(s, max(0, new_from - len(s) + 1))
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, s)
        if best is None:
            return False
        pos, s = best
        state.text = state.text[: pos + len(s) if params.include_stop_str_in_output else pos]
        state.sent = min(state.sent, len(state.text))
        return True
