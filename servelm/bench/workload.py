"""Benchmark workloads: presets, length distributions, token-exact synthetic prompts, datasets.

Invariant: a request is a pure function of (seed, stream, index). Two runs with the same seed
send identical work, and request i never depends on how many requests were drawn before it (so
a `--duration` run sends a prefix of what a `--num-requests` run sends). Each load level of a
sweep draws from its own stream, so a level cannot hit the prefix cache on an earlier level's
prompts; the shared-prefix system prompt is the one thing common to every stream.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

# preset -> (input tokens, output tokens, shared prefix tokens)
PRESETS: dict[str, tuple[int, int, int]] = {
    "chat": (500, 250, 0),
    "rag": (6000, 250, 0),
    "shared-prefix": (100, 250, 1000),
}
LENGTH_DISTS = ("fixed", "uniform", "lognormal")
_MAX_ROUNDS = 8  # re-encode rounds before accepting a prompt that is a token or two off
_BATCH = 64  # prompts encoded together; bounds the memory held by Encoding objects


@dataclass(frozen=True)
class WorkloadSpec:
    """What to send. Lengths are means for the uniform and lognormal distributions."""

    preset: str = "chat"
    input_len: int = 500
    output_len: int = 250
    prefix_len: int = 0
    len_dist: str = "fixed"
    len_spread: float = 0.5  # uniform: +-spread*mean (below 1); lognormal: sigma
    dataset: str | None = None

    def __post_init__(self) -> None:
        if self.len_dist not in LENGTH_DISTS:
            raise ValueError(f"len_dist must be one of {LENGTH_DISTS}, got {self.len_dist!r}")
        if self.input_len < 0 or self.output_len < 1 or self.prefix_len < 0:
            raise ValueError("need input_len >= 0, output_len >= 1, prefix_len >= 0")
        check_spread(self.len_dist, self.len_spread)

    @classmethod
    def from_preset(cls, preset: str = "chat", **overrides: Any) -> WorkloadSpec:
        """A preset's lengths, with any non-None override (input_len=..., len_dist=...) applied."""
        if preset not in PRESETS:
            raise ValueError(f"unknown workload preset {preset!r}; choose from {sorted(PRESETS)}")
        input_len, output_len, prefix_len = PRESETS[preset]
        fields = {"input_len": input_len, "output_len": output_len, "prefix_len": prefix_len}
        fields.update({k: v for k, v in overrides.items() if v is not None})
        return cls(preset=preset, **fields)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class RequestSpec:
    """One request's content. Chat sends `messages`, or [system?, user=prompt];
    completions sends `completion_prompt(system, prompt)` (a `messages`-only request cannot)."""

    index: int
    prompt: str | None = None
    system: str | None = None
    messages: list[dict[str, Any]] | None = None
    prompt_tokens: int | None = None  # local count of everything above; None if unknown
    output_tokens: int | None = None  # max_tokens to ask for


def completion_prompt(system: str | None, prompt: str) -> str:
    """The one string the completions endpoint gets for a system prompt and a prompt: joined
    by the space PromptBuilder's words are one token after, so the lengths add up exactly."""
    return f"{system} {prompt}" if system else prompt


def check_spread(dist: str, spread: float) -> None:
    """ValueError for a spread `sample_length` cannot draw around its mean."""
    if not spread >= 0:
        raise ValueError(f"len_spread must be >= 0, got {spread:g}")
    if dist == "uniform" and spread >= 1:
        # mean +- spread*mean would reach lengths below 1; clamped to 1, they would raise the
        # mean above the one asked for (by a quarter at 1.5)
        raise ValueError(
            f"len_spread for uniform lengths must be below 1 (mean +- spread x mean), got "
            f"{spread:g}; lognormal lengths spread wider"
        )


def sample_length(rng: random.Random, mean: int, dist: str, spread: float) -> int:
    """A length drawn from `dist` around `mean`; never below 1 (0 only for a fixed 0)."""
    if dist == "fixed" or mean == 0:
        return mean
    if dist == "uniform":
        check_spread(dist, spread)
        low = shortest_length(mean, dist, spread)
        return rng.randint(low, max(low, round(mean * (1 + spread))))
    if dist == "lognormal":  # mu chosen so that the mean is `mean`
        mu = math.log(mean) - spread * spread / 2
        return max(1, round(rng.lognormvariate(mu, spread)))
    raise ValueError(f"unknown length distribution {dist!r}")


def shortest_length(mean: int, dist: str, spread: float) -> int:
    """The least `sample_length` can draw for these arguments."""
    if dist == "fixed" or mean == 0:
        return mean
    if dist == "uniform":
        return max(1, round(mean * (1 - spread)))
    return 1  # lognormal: any length from 1 up


class PromptBuilder:
    """Builds text with an exact token count under one tokenizer, from a word-ish vocabulary.

    The vocabulary is every token that decodes to a short lowercase ASCII word which is still a
    single token with a leading space, and the first word is one token without it, so
    " ".join(words) encodes to one token per word with most tokenizers; where it does not, the
    count is corrected by adding or dropping words and re-encoding.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.words = word_vocabulary(tokenizer)
        if not self.words:
            raise ValueError("tokenizer has no word-like tokens to build prompts from")
        # words that are one token even without a leading space, to open a prompt with
        bare = tokenizer.encode_batch(self.words, add_special_tokens=False)
        self.first_words = [w for w, enc in zip(self.words, bare, strict=True) if len(enc.ids) == 1]
        self.first_words = self.first_words or self.words

    def count(self, text: str) -> int:
        return len(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def count_many(self, texts: Sequence[str]) -> list[int]:
        encoded = self._tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [len(enc.ids) for enc in encoded]

    def build(self, rng: random.Random, num_tokens: int) -> tuple[str, int]:
        """(text, its real token count); the count is exact unless the tokenizer resists."""
        return self.build_many([(rng, num_tokens)])[0]

    def build_many(self, jobs: Sequence[tuple[random.Random, int]]) -> list[tuple[str, int]]:
        """build() for many (rng, num_tokens) at once, with the same results as one by one:
        the first encode of each batch runs in parallel inside the tokenizers library."""
        out: list[tuple[str, int]] = []
        for start in range(0, len(jobs), _BATCH):
            batch = jobs[start : start + _BATCH]
            drafts = [self._draw(rng, n) for rng, n in batch]
            texts = [" ".join(words) for words in drafts]
            encoded = self._tokenizer.encode_batch(texts, add_special_tokens=False)
            for (rng, n), words, text, enc in zip(batch, drafts, texts, encoded, strict=True):
                count = len(enc.ids)
                out.append((text, count) if count == n else self._correct(rng, n, words, count))
        return out

    def _draw(self, rng: random.Random, num_tokens: int) -> list[str]:
        if num_tokens <= 0:
            return []
        return [rng.choice(self.first_words), *rng.choices(self.words, k=num_tokens - 1)]

    def _correct(
        self, rng: random.Random, num_tokens: int, words: list[str], count: int
    ) -> tuple[str, int]:
        """Add or drop words and re-encode until the count is right (or rounds run out)."""
        text = " ".join(words)
        for _ in range(_MAX_ROUNDS):
            excess = count - num_tokens
            if excess >= len(words):  # too long even at this few words: draw them again
                words = rng.choices(self.first_words, k=len(words))
            elif excess > 0:
                del words[len(words) - excess :]
            else:
                words += rng.choices(self.words, k=-excess)
            text = " ".join(words)
            count = self.count(text)
            if count == num_tokens:
                break
        return text, count


def word_vocabulary(tokenizer: Tokenizer) -> list[str]:
    """Sorted, de-duplicated words that are one token each both alone and after a space."""
    size = tokenizer.get_vocab_size(with_added_tokens=False)
    decoded = tokenizer.decode_batch([[i] for i in range(size)], skip_special_tokens=True)
    candidates = sorted({w for s in decoded if _wordish(w := s.strip())})
    spaced = tokenizer.encode_batch([" " + w for w in candidates], add_special_tokens=False)
    single = [w for w, enc in zip(candidates, spaced, strict=True) if len(enc.ids) == 1]
    return single if len(single) >= 16 else candidates


def _wordish(word: str) -> bool:
    return 2 <= len(word) <= 12 and word.isascii() and word.isalpha() and word.islower()


class Workload:
    """The deterministic request stream for one benchmark config."""

    def __init__(
        self,
        spec: WorkloadSpec,
        seed: int,
        builder: PromptBuilder | None = None,
        dataset: list[dict[str, Any]] | None = None,
    ) -> None:
        if dataset is None and builder is None:
            raise ValueError("a synthetic workload needs a tokenizer (PromptBuilder)")
        if dataset is not None and not dataset:
            raise ValueError("the dataset is empty")
        self.spec = spec
        self.seed = seed
        self._builder = builder
        self._dataset = dataset
        self.system: str | None = None
        if dataset is None and spec.prefix_len > 0 and builder is not None:
            rng = random.Random(f"{seed}/prefix")
            self.system, _ = builder.build(rng, spec.prefix_len)

    def request(self, index: int, stream: str = "main") -> RequestSpec:
        return self.requests([index], stream)[0]

    def requests(self, indices: Iterable[int], stream: str = "main") -> list[RequestSpec]:
        """The requests at `indices` of `stream`; prompts are built in parallel batches."""
        spec = self.spec
        drawn = []
        for index in indices:
            rng = random.Random(f"{self.seed}/{stream}/{index}")
            drawn.append(
                (index, rng, sample_length(rng, spec.output_len, spec.len_dist, spec.len_spread))
            )
        if self._dataset is not None:
            items = self._dataset
            return [self._dataset_request(i, items[i % len(items)], out) for i, _, out in drawn]
        if self._builder is None:
            raise ValueError("a synthetic workload needs a tokenizer (PromptBuilder)")
        jobs = [
            (rng, sample_length(rng, spec.input_len, spec.len_dist, spec.len_spread))
            for _, rng, _ in drawn
        ]
        built = self._builder.build_many(jobs)
        if self.system is None:
            counts = [count for _, count in built]
        else:  # what is sent as one text, counted as one (exact for most tokenizers anyway)
            counts = self._builder.count_many(
                [completion_prompt(self.system, prompt) for prompt, _ in built]
            )
        return [
            RequestSpec(
                index=index,
                prompt=prompt,
                system=self.system,
                prompt_tokens=count,
                output_tokens=output_len,
            )
            for (index, _, output_len), (prompt, _), count in zip(drawn, built, counts, strict=True)
        ]

    def _dataset_request(self, index: int, item: dict[str, Any], output_len: int) -> RequestSpec:
        texts = (
            [item["prompt"]] if "prompt" in item else [m.get("content") for m in item["messages"]]
        )
        count = None
        if self._builder is not None and all(isinstance(t, str) for t in texts):
            count = sum(self._builder.count(t) for t in texts)
        return RequestSpec(
            index=index,
            prompt=item.get("prompt"),
            messages=item.get("messages"),
            prompt_tokens=count,
            output_tokens=item.get("max_tokens", output_len),
        )


def load_dataset(path: str | Path) -> list[dict[str, Any]]:
    """Read JSONL lines of {"prompt": str} or {"messages": [...]}, each with optional max_tokens."""
    try:
        text = Path(path).read_text()
    except OSError as exc:  # named as the dataset: the caller's hints are about the tokenizer
        raise ValueError(f"cannot read the dataset {path}: {exc.strerror or exc}") from None
    items = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{lineno}: not JSON: {exc}") from None
        ok_prompt = isinstance(item, dict) and isinstance(item.get("prompt"), str)
        ok_messages = isinstance(item, dict) and isinstance(item.get("messages"), list)
        if not (ok_prompt or ok_messages):
            raise ValueError(f'{path}:{lineno}: need a "prompt" string or a "messages" list')
        if not ok_prompt:
            _check_messages(item["messages"], f"{path}:{lineno}")
        max_tokens = item.get("max_tokens")
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise ValueError(f"{path}:{lineno}: max_tokens must be a positive integer")
        items.append(item)
    return items


def _check_messages(messages: list[Any], where: str) -> None:
    """A chat dataset line's messages: objects with a role, as the chat API takes them (their
    content is the server's to judge); anything else would fail only once the run began."""
    if not messages:
        raise ValueError(f'{where}: "messages" is empty')
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(
                f'{where}: message {i} must be an object with a "role" string, '
                f"got {json.dumps(message)[:60]}"
            )


def load_tokenizer(path: str | Path | None) -> Tokenizer:
    """A tokenizer from a folder holding tokenizer.json (or the file itself).

    With no path, the servelm default model's tokenizer (fetched if it is not there yet).
    """
    if path is None:
        from servelm.store.default import ensure_default_model  # lazy: the store may download

        found = ensure_default_model()
        path = getattr(found, "path", found)
    file = Path(path)
    if file.is_dir():
        file = file / "tokenizer.json"
    if not file.is_file():
        raise FileNotFoundError(f"no tokenizer.json at {path}")
    return Tokenizer.from_file(str(file))


def build_workload(
    spec: WorkloadSpec, seed: int, tokenizer: Tokenizer | str | Path | None = None
) -> Workload:
    """A Workload for `spec`. Synthetic prompts need a tokenizer (default: the default model's);
    a dataset uses one only if given, to count prompt tokens locally."""
    if spec.dataset is not None:
        dataset = load_dataset(spec.dataset)
        if tokenizer is None:
            return Workload(spec, seed, dataset=dataset)
    else:
        dataset = None
    if not isinstance(tokenizer, Tokenizer):
        tokenizer = load_tokenizer(tokenizer)
    return Workload(spec, seed, PromptBuilder(tokenizer), dataset)
