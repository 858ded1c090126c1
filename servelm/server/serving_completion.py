"""POST /v1/completions: prompts as a string, strings, token ids or lists of token ids.

`echo` puts the prompt before each choice's text and, with `logprobs`, its tokens before the
generated ones in the logprobs (the first token's logprob null): what evaluation harnesses
score a continuation by. With echo, `max_tokens` may be 0: the prompt is scored, nothing
generated. Both, and vLLM's `prompt_logprobs`, ask the engine for the prompt's logprobs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from servelm.engine.outputs import Logprobs
from servelm.server.errors import APIError
from servelm.server.protocol import CompletionRequest
from servelm.server.serving import (
    OpenAIServing,
    cancel_on_disconnect,
    chunk_writer,
    collect,
    new_id,
    stream_events,
)
from servelm.server.sse import SSE_HEADERS
from servelm.server.structured import checked_structure
from servelm.text.tokenizer import TextTokenizer

MAX_PROMPTS = 64


@dataclass
class Shape:
    """What each choice's body holds besides the generated text: per choice the prompt's ids
    and text (`echo`), and how many top logprobs each part asks."""

    prompt_ids: list[list[int]]  # per choice
    echo_texts: list[str] | None  # per choice, with echo
    logprobs: int | None
    prompt_logprobs: int | None
    skip_special_tokens: bool  # as the text is detokenized (for the logprobs' text_offset)


class TextOffsets:
    """`text_offset` of one choice's generated tokens: where each token's text starts in the
    choice's text, counted by detokenizing the tokens as the answer's text was (after the same
    prompt, `IncrementalDetokenizer`). Not the lengths of the tokens decoded one by one: a token
    that holds part of a character decodes alone to U+FFFD but adds nothing until the
    character's last byte, and text held back for stop strings does not delay the offsets, so
    a stream and a whole answer get the same ones. (Bytes that make no UTF-8 come out as U+FFFD
    with the next token's text, which then starts at them.)"""

    def __init__(
        self, tokenizer: TextTokenizer, prompt_ids: list[int], skip_special_tokens: bool, start: int
    ) -> None:
        self._stream = tokenizer.decode_stream(skip_special_tokens, prompt_ids)
        self._at = start

    def of(self, token_ids: list[int]) -> list[int]:
        out = []
        for t in token_ids:
            out.append(self._at)
            self._at += len(self._stream.step(t))
        return out


class ServingCompletion(OpenAIServing):
    async def _prompts(self, prompt: Any) -> list[list[int]]:
        # counted before any is tokenized: a million one-word prompts took seconds of the
        # event loop to reach this 400
        batch = isinstance(prompt, list) and prompt and not isinstance(prompt[0], int)
        if batch and len(prompt) > MAX_PROMPTS:
            raise APIError(400, f"at most {MAX_PROMPTS} prompts per request.", "prompt")
        # (the request model took one shape only, so the first item tells it: walking a
        # million token ids again here held the event loop for 0.3 s)
        first = prompt[0] if isinstance(prompt, list) and prompt else None
        if isinstance(prompt, str):
            prompts = [await self.encode(prompt)]
        elif isinstance(first, int):
            prompts = [prompt]
        elif isinstance(first, str):
            prompts = [await self.encode(p) for p in prompt]
        elif isinstance(first, list):
            prompts = prompt
        else:
            raise APIError(
                400, "prompt must be a string, a list of strings, or token ids.", "prompt"
            )
        for ids in prompts:
            if not ids:
                raise APIError(400, "prompt must not be empty.", "prompt")
            self.check_prompt_length(ids)  # (before the ids are walked: it needs their count)
            self.check_token_ids(ids, "prompt")
        return prompts

    async def create(self, req: CompletionRequest, raw: Request):
        self.check_model(req.model)
        self.check_logprobs(req.logprobs, "logprobs")
        self.check_logprobs(req.prompt_logprobs, "prompt_logprobs")
        if req.suffix:
            raise APIError(400, "suffix is not supported.", "suffix")
        if req.best_of is not None and req.best_of > req.n:
            raise APIError(400, "best_of is not supported: ask for n choices instead.", "best_of")
        if req.best_of is not None and req.best_of < req.n:  # (OpenAI's and vLLM's rule)
            message = f"best_of must be at least n ({req.n}), got {req.best_of}."
            raise APIError(400, message, "best_of")
        prompts = await self._prompts(req.prompt)
        self.check_output_room(prompts, req.max_tokens)
        # the engine scores the prompt for echoed logprobs and for prompt_logprobs (the more of
        # the two top-N; each part shows its own)
        asks = [
            k for k in (req.logprobs if req.echo else None, req.prompt_logprobs) if k is not None
        ]
        params = self.sampling_params(
            req,
            req.max_tokens,
            req.logprobs,
            await checked_structure(req, self.tokenizer),
            prompt_logprobs=max(asks) if asks else None,
            echo=req.echo,
        )
        self.check_admission(len(prompts) * params.n)
        rid = new_id("cmpl", raw.scope)
        created = int(time.time())
        n = params.n
        shape = Shape(
            [p for p in prompts for _ in range(n)],
            [t for t in self._echo_texts(req.prompt, prompts) for _ in range(n)]
            if req.echo
            else None,
            req.logprobs,
            req.prompt_logprobs,
            params.skip_special_tokens,
        )
        choices = self.run_choices(rid, prompts, params, req.priority, req.cache_salt)
        num_prompt = sum(len(p) for p in prompts)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            body = self._stream(rid, created, shape, num_prompt, choices, include_usage)
            return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)
        return JSONResponse(
            await cancel_on_disconnect(raw, self._full(rid, created, shape, num_prompt, choices))
        )

    def _echo_texts(self, prompt: Any, prompts: list[list[int]]) -> list[str]:
        """Each prompt as the text it was given, or its token ids decoded."""
        if isinstance(prompt, str):
            return [prompt]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        return [self.tokenizer.decode(ids, skip_special_tokens=False) for ids in prompts]

    def _logprobs(self, lps: list[Logprobs], offsets: TextOffsets) -> dict[str, Any]:
        dec = self.tokenizer.decode
        tokens = [dec([lp.token_id], skip_special_tokens=False) for lp in lps]
        # each top_logprobs holds the k most likely and the sampled token, as vLLM's do (and as
        # the echoed prompt's): `logprobs: 0` asks for the sampled token's alone
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [
                {**{dec([t], False): v for t, v in lp.top}, tok: lp.logprob}
                for tok, lp in zip(tokens, lps, strict=True)
            ],
            "text_offset": offsets.of([lp.token_id for lp in lps]),
        }

    def _prompt_offsets(self, ids: list[int], echo_text: str) -> list[int]:
        """Where each prompt token's text starts in the echoed prompt: from detokenizing the
        prompt with its special tokens' text kept (as the text of token ids is) or else left
        out (a string prompt's BOS), whichever gives the echoed text back; within it when
        neither does (a tokenizer that normalizes text)."""
        for skip in (False, True):
            stream = self.tokenizer.decode_stream(skip)
            pieces = [stream.step(t) for t in ids]
            if "".join(pieces) == echo_text:
                break
        starts = accumulate((len(p) for p in pieces[:-1]), initial=0)
        return [min(start, len(echo_text)) for start in starts]

    def _prompt_logprobs(
        self, ids: list[int], entries: list[Logprobs | None], k: int, echo_text: str
    ) -> dict[str, Any]:
        """The echoed prompt's part of `logprobs`: its first token's logprob and top_logprobs
        null (nothing precedes it), each other top_logprobs the k most likely and the prompt's
        own token (as vLLM and OpenAI's legacy API), text_offset from the start of the prompt."""
        dec = self.tokenizer.decode
        tokens = [dec([t], skip_special_tokens=False) for t in ids]
        return {
            "tokens": tokens,
            "token_logprobs": [None] + [lp.logprob for lp in entries[1:]],
            "top_logprobs": [None]
            + [
                {**{dec([t], False): v for t, v in lp.top[:k]}, tokens[pos]: lp.logprob}
                for pos, lp in enumerate(entries[1:], start=1)
            ],
            "text_offset": self._prompt_offsets(ids, echo_text),
        }

    def _text_offsets(self, i: int, shape: Shape) -> TextOffsets:
        """Choice i's generated tokens' text_offset, after its echoed prompt if any."""
        start = len(shape.echo_texts[i]) if shape.echo_texts else 0
        return TextOffsets(self.tokenizer, shape.prompt_ids[i], shape.skip_special_tokens, start)

    def _choice_logprobs(
        self, i: int, shape: Shape, prompt_lps, lps: list[Logprobs], offsets: TextOffsets
    ) -> dict[str, Any] | None:
        """A choice's (or a first chunk's) `logprobs` when asked: with echo the prompt's part
        first."""
        echoed = shape.echo_texts is not None and prompt_lps  # prompt_logprobs alone: not echoed
        gen = self._logprobs(lps, offsets)
        if not echoed:
            return gen if lps else None
        part = self._prompt_logprobs(
            shape.prompt_ids[i], prompt_lps, shape.logprobs, shape.echo_texts[i]
        )
        return {key: part[key] + gen[key] for key in part}

    async def _full(self, rid, created, shape: Shape, num_prompt, choices) -> dict[str, Any]:
        total = len(shape.prompt_ids)
        done = await collect(choices, total, num_prompt)
        out = []
        for i in range(total):
            prompt_lps = done.prompt_logprobs[i]
            choice = {
                "index": i,
                "text": (shape.echo_texts[i] if shape.echo_texts else "") + done.texts[i],
                "finish_reason": done.reasons[i],
                "logprobs": None
                if shape.logprobs is None
                else self._choice_logprobs(
                    i, shape, prompt_lps, done.logprobs[i], self._text_offsets(i, shape)
                ),
            }
            if shape.prompt_logprobs is not None and prompt_lps is not None:
                choice["prompt_logprobs"] = self.prompt_logprobs_json(
                    prompt_lps, shape.prompt_logprobs
                )
            out.append(choice)
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": self.state.model_name,
            "choices": out,
            "usage": done.usage,
        }

    def _stream(self, rid, created, shape: Shape, num_prompt, choices, include_usage):
        model = self.state.model_name
        total = len(shape.prompt_ids)
        asked = shape.logprobs is not None
        offsets = [self._text_offsets(i, shape) for i in range(total)] if asked else []
        echoed = [shape.echo_texts is None] * total  # whether the choice's prompt went out

        chunk = chunk_writer(rid, "text_completion", created, model)

        def choice_of(i: int, delta) -> dict[str, Any]:
            text, prompt_lps = delta.text, None
            if not echoed[i]:  # the choice's first chunk starts with its prompt
                echoed[i] = True
                text = shape.echo_texts[i] + text
                prompt_lps = delta.prompt_logprobs
            lps = None
            if asked:
                lps = self._choice_logprobs(i, shape, prompt_lps, delta.logprobs or [], offsets[i])
            choice = {
                "index": i,
                "text": text,
                "finish_reason": delta.finish_reason,
                "logprobs": lps,
            }
            if shape.prompt_logprobs is not None and delta.prompt_logprobs is not None:
                choice["prompt_logprobs"] = self.prompt_logprobs_json(
                    delta.prompt_logprobs, shape.prompt_logprobs
                )
            return choice

        return stream_events(choices, num_prompt, include_usage, chunk, choice_of)
