"""GrammarCompiler: compiles grammars for the engine on a worker thread, cached by their text.

A compile never runs on the step loop: `submit` returns a future at once, and the engine keeps
the request out of the scheduler until it is done. Each finished grammar is kept (up to
`cache_size`, and `cache_text_bytes` of their text, least recently used out first) as a
template matcher; every request gets a copy
of it, so a schema sent again costs a copy, not a compile. The grammar engine's view of the
vocabulary (built from tokenizer.json, about a second for 49k tokens) is made on that thread
too, on the first request that asks for structure.
"""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from servelm.engine.sampling_params import StructuredOutput

# The cache's bound in the grammars' own text: a compiled grammar takes about 70 times its
# text in memory (docs/performance.md, "structured/compiler.py"), so 256 distinct 47 KB
# schemas held 845 MiB, and larger ones (bodies run to 8 MiB) would hold gigabytes.
CACHE_TEXT_BYTES = 2 << 20


class GrammarCompiler:
    """Called from one thread (the engine's step loop); compiles on another."""

    def __init__(
        self,
        tokenizer_file: str | Path,
        vocab_size: int,
        cache_size: int = 256,
        cache_text_bytes: int = CACHE_TEXT_BYTES,
    ) -> None:
        self.tokenizer_file = Path(tokenizer_file)
        self.vocab_size = vocab_size  # the logits' width: tokens past the tokenizer's are masked
        self.cache_size = cache_size
        self.cache_text_bytes = cache_text_bytes
        self._cached_text = 0  # the cached grammars' text, in characters
        self._cache: OrderedDict[tuple[StructuredOutput, tuple[int, ...]], Future] = OrderedDict()
        self._tokenizers: dict[tuple[int, ...], Any] = {}
        self._pool: ThreadPoolExecutor | None = None

    def submit(self, spec: StructuredOutput, eos_token_ids: frozenset[int]) -> Future:
        """A future of the template matcher of `spec` (copy it: `LLMatcher.deep_copy`); it
        holds a ValueError with the grammar engine's message when `spec` does not compile."""
        key = (spec, tuple(sorted(eos_token_ids)))
        future = self._cache.get(key)
        if future is not None:
            self._cache.move_to_end(key)
            return future
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="servelm-grammar")
        future = self._pool.submit(self._compile, *key)
        self._cache[key] = future
        self._cached_text += len(spec.value)
        # (the newest stays, however large: its requests hold it anyway)
        while len(self._cache) > 1 and (
            len(self._cache) > self.cache_size or self._cached_text > self.cache_text_bytes
        ):
            (old, _), _ = self._cache.popitem(last=False)
            self._cached_text -= len(old.value)
        return future

    def _compile(self, spec: StructuredOutput, eos: tuple[int, ...]) -> Any:
        from llguidance import LLMatcher

        from servelm.structured.grammar import to_grammar

        matcher = LLMatcher(self._tokenizer(eos), to_grammar(spec), log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def _tokenizer(self, eos: tuple[int, ...]) -> Any:
        tokenizer = self._tokenizers.get(eos)
        if tokenizer is None:
            from servelm.structured.grammar import grammar_tokenizer

            text = self.tokenizer_file.read_text()
            tokenizer = grammar_tokenizer(text, self.vocab_size, eos)
            self._tokenizers[eos] = tokenizer
        return tokenizer

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
