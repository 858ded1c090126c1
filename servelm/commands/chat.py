"""`servelm chat`: an interactive conversation with a model in the terminal."""

from __future__ import annotations

import argparse
import logging

from servelm.commands.generate import add_sampling_arguments, sampling_overrides
from servelm.config import EngineArgs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, help="model folder, .gguf or hub id (default model if unset)"
    )
    parser.add_argument("--system", default=None, help="system prompt")
    EngineArgs.add_cli_args(parser, model_positional=False)
    add_sampling_arguments(parser)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING)
    from servelm.llm import LLM

    llm = LLM(**EngineArgs.from_cli_args(args).__dict__)
    params = llm.default_sampling_params(**sampling_overrides(args))
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("servelm chat: empty line or Ctrl-D to quit")
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            break
        if not line:
            break
        messages.append({"role": "user", "content": line})
        answer = llm.chat(messages, params)[0].text
        print(answer)
        messages.append({"role": "assistant", "content": answer})
    return 0
