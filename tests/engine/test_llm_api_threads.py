"""Threads that call `generate` on one LLM at once take turns: each gets the answers a call of
its own gets (unserialised, a second thread stepping the engine mid-step broke the runner's
batch or killed the process with SIGFPE)."""

from __future__ import annotations

import threading

from servelm import LLM, SamplingParams


def test_threads_sharing_one_llm_take_turns(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), kv_cache_memory="16MiB", max_model_len=512, num_threads=1)
    prompts = ["The quick brown fox", "A serving engine batches requests " * 3, "1 2 3 4"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    got: dict[int, object] = {}

    def work(k: int) -> None:
        try:
            got[k] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        except Exception as exc:  # (reported below, not lost in the thread)
            got[k] = repr(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == {k: expected for k in range(4)}
    assert not llm.engine.has_unfinished_requests()
