"""Ctrl-C and a closed stdout end a `servelm` command without a traceback (`servelm.cli.main`);
Ctrl-C while `servelm chat` answers stops that answer and the session goes on."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from servelm.cli import main

FAST = ["--device", "cpu", "--kv-cache-memory", "8MiB", "--temperature", "0"]
ANSWERS = ["--max-tokens", "64", "--max-model-len", "4096"]


def sigint_in(seconds: float) -> threading.Timer:
    """A real SIGINT to this process after `seconds`, as a terminal's Ctrl-C sends it."""
    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    return timer


def sigint_while_the_engine_steps() -> threading.Thread:
    """A real SIGINT to this process as soon as the main thread is inside an engine step (it
    watches the main thread's stack), so that it comes while the model answers, however fast."""
    main_thread, pid = threading.main_thread().ident, os.getpid()

    def watch() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            frame = sys._current_frames().get(main_thread)
            while frame is not None:
                code = frame.f_code
                if code.co_name == "step" and code.co_filename.endswith("engine/core.py"):
                    os.kill(pid, signal.SIGINT)
                    return
                frame = frame.f_back
            time.sleep(0.0002)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    return watcher


class Typist(io.TextIOBase):
    """stdin for `servelm chat`: types `lines` one by one; Ctrl-C while the model answers the
    line `interrupt`, or at the prompt when a line is KeyboardInterrupt (what `input()`
    raises on a Ctrl-C there)."""

    def __init__(self, lines: list[object], interrupt: str | None = None) -> None:
        self.lines, self.interrupt = list(lines), interrupt
        self.watchers: list[threading.Thread] = []

    def readable(self) -> bool:
        return True

    def readline(self, size: int | None = -1) -> str:
        for watcher in self.watchers:  # (the answer interrupted: the SIGINT was sent)
            watcher.join()
        line = self.lines.pop(0) if self.lines else ""
        if line is KeyboardInterrupt:
            raise KeyboardInterrupt
        if line == self.interrupt:
            self.watchers.append(sigint_while_the_engine_steps())
        return f"{line}\n" if line else ""


def chat(model: Path, typist: Typist, capsys) -> tuple[int, list[str], str]:
    """(exit status, the answer printed for each line, stderr) of a chat session typed by
    `typist` ("" for a line answered with nothing)."""
    stdin_was, sys.stdin = sys.stdin, typist
    try:
        status = main(["chat", "--model", str(model), *FAST, *ANSWERS])
    finally:
        sys.stdin = stdin_was
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    answers = [a.strip() for a in out.split("> ")[1:-1]]  # (the last: the prompt quit at)
    return status, answers, err


def test_ctrl_c_stops_an_answer_and_the_conversation_goes_on(tiny_model_dir, capsys):
    story = "Write a long story about a dragon."
    status, answers, err = chat(tiny_model_dir, Typist(["hi", story, "hello", ""], story), capsys)
    assert status == 0
    assert "servelm chat: interrupted: that answer is dropped" in err
    # the interrupted message is left out and the turn before it kept: "hello" is answered as
    # in a session that never saw the story, and the engine holds no part of the dropped one
    same, fresh, _ = chat(tiny_model_dir, Typist(["hi", "hello", ""]), capsys)
    assert same == 0 and len(answers) == 3 and answers[1] == ""
    assert [answers[0], answers[2]] == fresh and all(fresh)


def test_a_ctrl_c_mid_step_waits_for_the_step_to_end(tiny_model_dir):  # (in LLM itself)
    # A step publishes the prefix-cache hashes of the blocks it fills before the model fills
    # them: a Ctrl-C that cut it there would leave them cached unwritten, and the next message
    # sharing that prefix would read garbage. Here the Ctrl-C comes exactly there (from a
    # pre-forward hook of the model), as the story's prompt is about to be computed.
    from servelm.llm import LLM

    def start() -> LLM:
        return LLM(str(tiny_model_dir), device="cpu", kv_cache_memory="8MiB", max_model_len=4096)

    def answer(llm: LLM, *lines: str) -> list[str]:
        conversation, said = [], []
        for line in lines:
            conversation.append({"role": "user", "content": line})
            said.append(llm.chat(conversation, params)[0].outputs[0].text)
            conversation.append({"role": "assistant", "content": said[-1]})
        return said

    llm = start()
    params = llm.default_sampling_params(max_tokens=64, temperature=0)
    (first,) = answer(llm, "hi")
    kill = llm.engine.executor.model.register_forward_pre_hook(
        lambda *_: os.kill(os.getpid(), signal.SIGINT)
    )
    story = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": first}]
    story.append({"role": "user", "content": "Write a long story about a dragon. " * 8})
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.chat(story, params)
    finally:
        kill.remove()
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_integrity()
    assert answer(llm, "hi", "hello") == answer(start(), "hi", "hello")


def test_ctrl_c_at_the_prompt_ends_the_session_in_one_line(tiny_model_dir, capsys):
    status, answers, err = chat(tiny_model_dir, Typist([KeyboardInterrupt]), capsys)
    assert status == 130 and answers == []  # (nothing but the prompt it was interrupted at)
    assert err.strip().splitlines()[-1] == "servelm chat: interrupted"


def test_ctrl_c_in_generate_is_one_line(tiny_model_dir, capsys):
    timer = sigint_in(0.05)  # (while the model loads, or at the latest as it generates)
    try:
        argv = ["generate", "hello", "--model", str(tiny_model_dir), *FAST, "--max-tokens", "3000"]
        status = main(argv)
    finally:
        timer.cancel()
    err = capsys.readouterr().err
    assert status == 130 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == "servelm generate: interrupted"


@pytest.mark.parametrize(
    "argv, status",
    [
        (["plan", "llama-3.1-8b", "--json"], 141),  # 128 + SIGPIPE, as a shell reports it
        (["plan", "--list"], 1),  # (rich, which prints the table, ends so on its own)
    ],
)
def test_a_closed_stdout_ends_quietly(argv, status):
    # the reader of stdout went away before anything was written (`| head -0`)
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "servelm.cli", *argv],
            stdout=write,
            stderr=subprocess.PIPE,
            timeout=120,
        )
    finally:
        os.close(write)
    assert done.stderr.decode() == ""
    assert done.returncode == status
