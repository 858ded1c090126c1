"""`servelm generate "prompt" ...`: offline generation in the terminal, one batch for all prompts."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from typing import Any

from servelm.commands import CommandError, start_llm
from servelm.config import EngineArgs


def sampling_value(name: str, parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse type for SamplingParams' `name`: `parse` the text, then check the value with
    SamplingParams' own validation, so a bad value is a usage error (exit 2) at once, not a
    traceback once the model has loaded."""

    def check(text: str) -> Any:
        from servelm.engine.sampling_params import InvalidParamError, SamplingParams

        value = parse(text)  # a ValueError: argparse's "invalid int value: 'x'"
        try:
            SamplingParams(**{name: value})
        except InvalidParamError as exc:
            raise argparse.ArgumentTypeError(exc.message) from None
        return value

    check.__name__ = parse.__name__  # the type argparse names in "invalid ... value"
    return check


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=sampling_value("max_tokens", int), default=128)
    g.add_argument("--temperature", type=sampling_value("temperature", float), default=None)
    g.add_argument("--top-p", type=sampling_value("top_p", float), default=None)
    g.add_argument("--top-k", type=sampling_value("top_k", int), default=None)
    g.add_argument("--sampling-seed", type=sampling_value("seed", int), default=None)


def sampling_overrides(args: argparse.Namespace) -> dict:
    return {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.sampling_seed,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="+", help="one or more prompts")
    parser.add_argument(
        "--model", default=None, help="model folder, .gguf or hub id (default model if unset)"
    )
    parser.add_argument(
        "--chat", action="store_true", help="wrap each prompt as a user turn in the chat template"
    )
    EngineArgs.add_cli_args(parser, model_positional=False)
    add_sampling_arguments(parser)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING)
    llm = start_llm(args)
    params = llm.default_sampling_params(**sampling_overrides(args))
    try:
        if args.chat:
            results = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params)
        else:
            results = llm.generate(args.prompts, params)
    except ValueError as exc:  # a prompt longer than the context, or empty
        raise CommandError(str(exc)) from exc
    for prompt, res in zip(args.prompts, results, strict=True):
        out = res.outputs[0]
        print(
            f"### {prompt}\n{out.text}\n[{len(out.token_ids)} tokens, finish: {out.finish_reason}]\n"
        )
    return 0
