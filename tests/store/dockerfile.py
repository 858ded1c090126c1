"""The repo's Dockerfile, read with dockerfile-parse: what the image runs and with which env."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dockerfile_parse import DockerfileParser

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"


@dataclass
class Image:
    entrypoint: list[str]
    cmd: list[str]
    env: dict[str, str]  # the final stage's ENV
    user: str | None
    volumes: list[str]
    parser: DockerfileParser

    @property
    def argv(self) -> list[str]:
        """What `docker run IMAGE` executes: ENTRYPOINT followed by CMD."""
        return [*self.entrypoint, *self.cmd]


def _exec_form(value: str | None) -> list[str]:
    # The exec (JSON) form only: a shell form would run under /bin/sh and not get signals.
    parsed = json.loads(value) if value else []
    assert isinstance(parsed, list) and all(isinstance(a, str) for a in parsed), value
    return parsed


def read_image() -> Image:
    parser = DockerfileParser(path=str(DOCKERFILE))
    last: dict[str, str] = {}
    volumes: list[str] = []
    for instruction in parser.structure:
        name, value = instruction["instruction"], instruction["value"]
        if name in ("ENTRYPOINT", "CMD", "USER"):
            last[name] = value
        elif name == "VOLUME":
            volumes += _exec_form(value) if value.startswith("[") else value.split()
    return Image(
        entrypoint=_exec_form(last.get("ENTRYPOINT")),
        cmd=_exec_form(last.get("CMD")),
        env=dict(parser.envs),
        user=last.get("USER"),
        volumes=volumes,
        parser=parser,
    )
