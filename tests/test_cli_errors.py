"""What `servelm generate | chat | serve | fetch` say about a model, a setting or a prompt they
cannot use: one line naming the problem (the file, where it is one) and exit 1, never a
traceback. The models are copies of the tiny test model (or tiny GGUFs) broken in tmp_path."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from servelm.cli import main
from tests.live_server import free_port
from tests.store.conftest import write_tiny_gguf

FAST = ["--device", "cpu", "--kv-cache-memory", "8MiB"]


def _one_error_line(capsys, command: str) -> str:
    """The error line `command` ended with (its last line on stderr: a model load may warn
    first); the caller has checked the exit status."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"servelm {command}: error: "), err
    return line


def _run(command: str, model: Path, *flags: str, stdin: str = "") -> int:
    """`servelm COMMAND` with `model`, in this process (a traceback fails the test)."""
    if command == "generate":
        argv = ["generate", "hello world", "--model", str(model)]
    elif command == "chat":
        argv = ["chat", "--model", str(model)]
    else:
        argv = ["serve", str(model), "--port", str(free_port())]
    stdin_was, sys.stdin = sys.stdin, io.StringIO(stdin)  # (chat reads its messages from it)
    try:
        return main([*argv, *FAST, *flags])
    finally:
        sys.stdin = stdin_was


def _edit_json(path: Path, **changes) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


# breakage -> (the file the message names, what it says about it)
BREAKAGES = {
    "no tokenizer.json": ("tokenizer.json", "not found: servelm needs a fast tokenizer"),
    "tokenizer.json not JSON": ("tokenizer.json", "is not a tokenizer servelm can read"),
    "config.json not JSON": ("config.json", "is not valid JSON: Expecting property name"),
    "generation_config.json not JSON": ("generation_config.json", "is not valid JSON"),
    "tokenizer_config.json a list": ("tokenizer_config.json", "is not a JSON object"),
    "weights cut short": ("model.safetensors", "is not a valid, complete safetensors file"),
    "unknown architecture": (None, "unsupported architecture ['FooBarForCausalLM']"),
}
# what the API process of `servelm serve` reads itself, before its engine process starts
READ_BY_SERVE = ("no tokenizer.json", "tokenizer.json not JSON", "config.json not JSON",
                 "generation_config.json not JSON", "tokenizer_config.json a list")  # fmt: skip


def _broken_copy(tiny_model_dir: Path, tmp_path: Path, breakage: str) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    if breakage == "no tokenizer.json":
        (folder / "tokenizer.json").unlink()
    elif breakage.endswith("not JSON"):
        (folder / breakage.split()[0]).write_text("{broken")
    elif breakage == "tokenizer_config.json a list":
        (folder / "tokenizer_config.json").write_text("[]")
    elif breakage == "weights cut short":
        weights = folder / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    else:
        _edit_json(folder / "config.json", architectures=["FooBarForCausalLM"])
    return folder


@pytest.mark.parametrize("breakage", BREAKAGES)
@pytest.mark.parametrize("command", ["generate", "chat"])
def test_a_broken_model_folder_is_one_line_naming_the_file(
    command, breakage, tiny_model_dir, tmp_path, capsys
):
    folder = _broken_copy(tiny_model_dir, tmp_path, breakage)
    assert _run(command, folder) == 1
    line = _one_error_line(capsys, command)
    name, says = BREAKAGES[breakage]
    assert says in line
    if name is not None:
        assert f"{folder / name} " in line


@pytest.mark.parametrize("breakage", READ_BY_SERVE)
def test_serve_says_in_one_line_what_its_own_process_cannot_read(
    breakage, tiny_model_dir, tmp_path, capsys
):
    # read before the engine process starts: no engine, no port, one line
    folder = _broken_copy(tiny_model_dir, tmp_path, breakage)
    assert _run("serve", folder) == 1
    name, says = BREAKAGES[breakage]
    assert f"{folder / name} {says}" in _one_error_line(capsys, "serve")


def test_serve_says_in_one_line_that_the_weights_are_cut_short(tiny_model_dir, tmp_path):
    # read in the engine process, which reports a model it refuses without a traceback
    folder = _broken_copy(tiny_model_dir, tmp_path, "weights cut short")
    argv = ["serve", str(folder), "--port", str(free_port()), *FAST]
    done = subprocess.run(
        [sys.executable, "-m", "servelm.cli", *argv], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert (
        f"engine failed to start: WeightLoadError: {folder / 'model.safetensors'} is not a "
        "valid, complete safetensors file" in done.stderr
    )


def _bad_gguf(tmp_path: Path, kind: str) -> Path:
    path = tmp_path / f"{kind}.gguf"
    if kind in ("cut after the magic", "cut in its tensor index", "cut in its tensor data"):
        write_tiny_gguf(path)
        data = path.read_bytes()
        keep = {"cut after the magic": 8, "cut in its tensor index": 3000}.get(kind, len(data) // 2)
        path.write_bytes(data[:keep])
    else:
        path.write_bytes({"empty": b"", "garbage": bytes(range(256)) * 64}[kind])
    return path


GGUFS = {
    "empty": "is not a GGUF file",
    "garbage": "is not a GGUF file",
    "cut after the magic": "is not a valid, complete GGUF file: it is cut short or corrupt",
    "cut in its tensor index": "is not a valid, complete GGUF file",
    "cut in its tensor data": "is not a valid, complete GGUF file",
}


@pytest.mark.parametrize("kind", GGUFS)
def test_fetch_names_a_gguf_file_it_cannot_read(kind, tmp_path, capsys):
    path = _bad_gguf(tmp_path, kind)
    assert main(["fetch", str(path), "--store", str(tmp_path / "store")]) == 1
    line = _one_error_line(capsys, "fetch")
    assert line.startswith(f"servelm fetch: error: {path} {GGUFS[kind]}")
    assert not (tmp_path / "store" / path.stem).exists()


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_a_broken_gguf_is_one_line_for_every_command(command, tmp_path, capsys):
    path = _bad_gguf(tmp_path, "cut after the magic")
    assert _run(command, path, "--store", str(tmp_path / "store")) == 1
    assert f"{path} {GGUFS['cut after the magic']}" in _one_error_line(capsys, command)


@pytest.mark.parametrize(
    "options, says",
    [({"arch": "mamba"}, "unsupported GGUF architecture 'mamba'"),  # before the import starts
     ({"pre": "mystery"}, "'mystery'")],  # while it writes the tokenizer
)  # fmt: skip
def test_a_gguf_it_cannot_import_is_named(options, says, tmp_path, capsys):
    path = tmp_path / "odd.gguf"
    write_tiny_gguf(path, **options)
    assert main(["fetch", str(path), "--store", str(tmp_path / "store")]) == 1
    line = _one_error_line(capsys, "fetch")
    assert line.startswith(f"servelm fetch: error: {path}: ") and says in line


REFUSALS = [
    (["--kv-cache-memory", "1KiB"], "no memory left for the KV cache"),
    (["--max-model-len", "100000"], "--max-model-len 100000 exceeds the model's context 4096"),
    (
        ["--max-model-len", "4096", "--kv-cache-memory", "64KiB"],
        "--max-model-len 4096 does not fit the KV cache, which holds 128 tokens",
    ),
    (["--quantization", "int4", "--dtype", "float32"], "--quantization int4 needs the CPU and"),
]


@pytest.mark.parametrize("flags, says", REFUSALS)
@pytest.mark.parametrize("command", ["generate", "chat"])
def test_a_setting_the_engine_refuses_is_one_line(command, flags, says, tiny_model_dir, capsys):
    # as `servelm serve` reports it (tests/server/test_engine_death.py)
    assert _run(command, tiny_model_dir, *flags) == 1
    assert f"servelm {command}: error: {says}" in _one_error_line(capsys, command)


def test_cuda_without_cuda_is_one_line(tiny_model_dir, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has a GPU")
    assert _run("generate", tiny_model_dir, "--device", "cuda") == 1
    assert "error: --device cuda: " in _one_error_line(capsys, "generate")


def test_generate_says_a_prompt_is_longer_than_the_context(tiny_model_dir, capsys):
    argv = ["generate", "short", "word " * 100, "--model", str(tiny_model_dir)]
    assert main([*argv, *FAST, "--max-model-len", "32"]) == 1
    line = _one_error_line(capsys, "generate")
    assert "maximum context length is 32 tokens, but the prompt has" in line


def test_chat_goes_on_when_the_conversation_outgrows_the_context(tiny_model_dir, capsys):
    # a message too long is refused and left out; the session goes on: a short one is
    # answered, /reset starts over
    lines = ["word " * 100, "hello", "/reset", "hello", ""]
    flags = ["--max-model-len", "48", "--max-tokens", "4", "--temperature", "0"]
    assert _run("chat", tiny_model_dir, *flags, stdin="\n".join(lines)) == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    said = err.splitlines()
    assert said[0].startswith("servelm chat: error: This model's maximum context length is 48")
    assert said[1].startswith(
        "servelm chat: the prompt is the whole conversation so far: that message is left out"
    )
    assert said[2] == "servelm chat: new conversation"
    # the first "hello" is answered as the first message of a new conversation is: the long
    # one is not part of it
    answers = [a for a in out.split("> ")[1:] if a]
    assert len(answers) == 2 and answers[0] == answers[1]


def test_chat_says_when_an_answer_stops_at_the_context(tiny_model_dir, capsys):
    flags = ["--max-model-len", "24", "--max-tokens", "100", "--temperature", "0"]
    assert _run("chat", tiny_model_dir, *flags, stdin="hello\n") == 0
    err = capsys.readouterr().err
    assert err.startswith("servelm chat: the answer stopped where the conversation filled")
