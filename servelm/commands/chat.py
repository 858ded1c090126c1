"""`servelm chat`: an interactive conversation with a model in the terminal.

Every turn sends the whole conversation. A message the engine refuses (the conversation would
outgrow the context) is left out, with a line saying so, and the session goes on; `/reset`
starts a new conversation. Ctrl-C while the model answers stops that answer (the engine drops
the request) and leaves the message out, as a refused one; at the prompt it ends the session
(`servelm.cli.main`: one line, exit 130)."""

from __future__ import annotations

import argparse
import logging
import sys

from servelm.commands import start_llm
from servelm.commands.generate import add_sampling_arguments, sampling_overrides
from servelm.config import EngineArgs

# Typed as a message: forget the conversation so far (the system prompt stays)
RESET = "/reset"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, help="model folder, .gguf or hub id (default model if unset)"
    )
    parser.add_argument("--system", default=None, help="system prompt")
    EngineArgs.add_cli_args(parser, model_positional=False)
    add_sampling_arguments(parser)


def say(text: str) -> None:
    print(f"servelm chat: {text}", file=sys.stderr)


def _end_line() -> None:
    """A new line after the ^C a terminal echoes, so that what follows starts its own."""
    if sys.stderr.isatty():
        print(file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING)
    llm = start_llm(args)
    # (the flags were checked when parsed; the model's own defaults are taken only if usable)
    params = llm.default_sampling_params(**sampling_overrides(args))
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    print(f"servelm chat: empty line or Ctrl-D to quit, {RESET} to start a new conversation")
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            break
        except KeyboardInterrupt:
            _end_line()
            raise
        if not line:
            break
        if line == RESET:
            messages = list(system)
            say("new conversation")
            continue
        asked = {"role": "user", "content": line}
        try:
            out = llm.chat([*messages, asked], params)[0].outputs[0]
        except KeyboardInterrupt:  # (taken between steps, the request aborted: all clean)
            _end_line()
            say(
                "interrupted: that answer is dropped and its message left out of the "
                "conversation; empty line or Ctrl-D to quit"
            )
            continue
        except ValueError as exc:
            # Each turn sends the whole conversation, which in time outgrows the context (or
            # the engine refuses this message): the session goes on, the conversation as it
            # was, without the message, and the user is told so and what they can do.
            say(f"error: {exc}")
            say(
                "the prompt is the whole conversation so far: that message is left out of it, "
                f"unanswered; send a shorter one, or {RESET} to start a new conversation"
            )
            continue
        print(out.text)
        messages += [asked, {"role": "assistant", "content": out.text}]
        if out.finish_reason == "length" and (
            params.max_tokens is None or len(out.token_ids) < params.max_tokens
        ):  # stopped before --max-tokens: the context is full
            say(
                "the answer stopped where the conversation filled the model's context "
                f"(--max-model-len); {RESET} to start a new conversation"
            )
    return 0
