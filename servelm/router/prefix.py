"""Prompt prefixes as the router sees them: the request's prompt text and its chained block hashes.

The router hashes prompt *text*, not tokens: it stays tokenizer-free (any model, any
OpenAI-compatible replica, no /tokenize round trip per request). The text is cut into blocks of
`block_chars` characters and each full block is hashed together with its parent, like the
engine's KV blocks (`hash_block_tokens`):

    text   |  block 0  |  block 1  |  block 2  | tail (not hashed)
    hash   h0 = H(seed, b0)   h1 = H(h0, b1)   h2 = H(h1, b2)

so `h_i` names the whole prefix up to block i. The seed is the model name: two models never
share a prefix. Text blocks do not line up with the engine's 16-token blocks, but two prompts
with equal text prefixes have equal token prefixes too (up to the last token or so), which is
all routing needs: send them where that prefix already sits in the KV cache.

A Responses API body (`instructions` and `input` items) reads as the chat messages it means,
so it hashes and is estimated like the chat request of the same conversation. Its body cannot
tell it from an embeddings body (`{"input": "hi"}` is both), so the caller names the path.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

_ROLE_END, _MESSAGE_END = "\x1f", "\x1e"  # separators no chat message text contains
RESPONSES = "/v1/responses"
# content parts whose text the model reads: chat's, and the Responses API's
_TEXT_PARTS = ("text", "input_text", "output_text")


def prompt_text(body: dict[str, Any], path: str = "") -> str:
    """The prompt of a completions, chat or (`path` RESPONSES) Responses request as one string
    (the first prompt of a batch)."""
    messages = responses_messages(body) if path == RESPONSES else body.get("messages")
    if isinstance(messages, list):
        parts = []
        for m in messages:
            if not isinstance(m, dict):
                continue
            parts.append(
                f"{m.get('role', '')}{_ROLE_END}{_content_text(m.get('content'))}{_MESSAGE_END}"
            )
        return "".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch: route by its first prompt
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):  # token ids
        return ",".join(str(t) for t in prompt) + ","
    return ""


def responses_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """A Responses body's `instructions` and `input` as chat messages, near enough for routing
    and estimates: a string is a user message, message items keep their role and content, other
    items (function calls and their outputs) count as their JSON. The conversation a
    `previous_response_id` names is on its replica, not here."""
    instructions, items = body.get("instructions"), body.get("input")
    out = []
    if isinstance(instructions, str) and instructions:  # (as the replica: "" makes no message)
        out.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        return [*out, {"role": "user", "content": items}]
    for item in items if isinstance(items, list) else []:
        if isinstance(item, dict) and item.get("type", "message") == "message":
            out.append({"role": item.get("role", ""), "content": item.get("content")})
        elif isinstance(item, dict):
            out.append({"role": str(item.get("type")), "content": item})
    return out


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": ...}, {"type": "image_url", ...}]
        return "".join(
            p["text"]
            if p.get("type") in _TEXT_PARTS and isinstance(p.get("text"), str)
            else json.dumps(p, sort_keys=True)
            for p in content
            if isinstance(p, dict)
        )
    return "" if content is None else json.dumps(content, sort_keys=True)


def block_hashes(text: str, block_chars: int, max_blocks: int, seed: str = "") -> list[bytes]:
    """Chained hashes of the first full blocks of `text` (at most `max_blocks`)."""
    # "surrogatepass": a lone surrogate (valid JSON, invalid Unicode) hashes like any other
    # character here; the replica answers such a request with its 400
    parent = hashlib.blake2b(seed.encode("utf-8", "surrogatepass"), digest_size=16).digest()
    out = []
    for i in range(min(len(text) // block_chars, max_blocks)):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(text[i * block_chars : (i + 1) * block_chars].encode("utf-8", "surrogatepass"))
        parent = h.digest()
        out.append(parent)
    return out


def estimate_prompt_tokens(body: dict[str, Any], path: str = "") -> int:
    """A tokenizer-free estimate of prompt tokens (about 4 characters per token)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return len(prompt)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        return sum(len(p) for p in prompt)
    if isinstance(prompt, list):
        return sum(-(-len(p) // 4) for p in prompt if isinstance(p, str))
    return -(-len(prompt_text(body, path)) // 4)
