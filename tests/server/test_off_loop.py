"""Long prompts are tokenized off the event loop; short ones in place."""

import asyncio
import os
import threading

from servelm.server.serving import THREAD_ENCODE_CHARS, message_chars, off_loop


def test_long_text_runs_on_a_worker_thread_and_short_text_in_place():
    def where(x: int) -> tuple[int, int]:
        return x, threading.get_ident()

    def policy() -> int:
        return os.sched_getscheduler(0)

    async def main() -> tuple[int, int, int]:
        loop_thread = threading.get_ident()
        short = await off_loop(THREAD_ENCODE_CHARS - 1, where, 1)
        long = await off_loop(THREAD_ENCODE_CHARS, where, 2)
        assert short[0] == 1 and long[0] == 2
        if hasattr(os, "SCHED_IDLE"):  # Linux: the tokenizer thread yields to the engine
            assert await off_loop(THREAD_ENCODE_CHARS, policy) == os.SCHED_IDLE
            assert policy() != os.SCHED_IDLE  # and the loop's thread keeps its priority
        return loop_thread, short[1], long[1]

    loop_thread, short_thread, long_thread = asyncio.run(main())
    assert short_thread == loop_thread
    assert long_thread != loop_thread


def test_message_chars_counts_content_only():
    msgs = [{"role": "system", "content": "abc"}, {"role": "user", "content": "de"}, {"role": "x"}]
    assert message_chars(msgs) == 5
