"""`servelm bench` refusing what it cannot run before it runs (bad numbers, a dataset line it
could not send, an --out or --plot it could not write, a server that wants an API key), and
stopping on Ctrl-C with what had finished. Against the loopback stand-in server (conftest.py)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from tokenizers import Tokenizer

from servelm.bench.client import Target, build_payload, send_request
from servelm.bench.command import run
from servelm.bench.results import RequestRecord
from servelm.bench.stats import SLO, meets_slo, summarize
from servelm.bench.workload import RequestSpec, WorkloadSpec, build_workload, sample_length
from servelm.cli import main
from tests.bench.conftest import parse
from tests.tiny_model import build_tokenizer


def one_error_line(capsys) -> str:
    out = capsys.readouterr().out
    assert "Traceback" not in out
    lines = out.strip().splitlines()
    assert len(lines) == 1, out
    return lines[0]


def dataset(tmp_path: Path, line: str) -> str:
    path = tmp_path / "ds.jsonl"
    path.write_text(line + "\n")
    return str(path)


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--rate", "5", "--max-concurrency", "-1"], "max_concurrency must be >= 1"),
        (["--rate", "5", "--max-concurrency", "0"], "max_concurrency must be >= 1"),
        (["--concurrency", "2", "--max-concurrency", "4"], "max_concurrency caps an open loop"),
        (["--concurrency", "0"], "concurrency must be >= 1, got 0"),
        (["--concurrency", "-2"], "concurrency must be >= 1, got -2"),
        (["--timeout", "0"], "timeout must be > 0"),
        (["--timeout", "-1"], "timeout must be > 0"),
        (["--slo-threshold", "5"], "share of requests, in (0, 1]; got 5"),
        (["--slo-threshold", "0"], "share of requests, in (0, 1]; got 0"),
        (["--slo-ttft-ms", "-5"], "SLO ttft_ms must be > 0"),
        (["--len-dist", "uniform", "--len-spread", "1.5"], "must be below 1"),
        (["--len-spread", "-0.5"], "len_spread must be >= 0"),
    ],
)
def test_bad_numbers_are_one_line_and_exit_2(flags, says, tokenizer_dir, capsys) -> None:
    # nothing listens at port 9: a check that let these through would fail there instead
    argv = ["--base-url", "http://127.0.0.1:9", "--tokenizer", tokenizer_dir, *flags]
    assert run(parse(argv)) == 2
    line = one_error_line(capsys)
    assert line.startswith("servelm bench: ") and says in line, line


@pytest.mark.parametrize(
    "line, says",
    [
        ('{"messages": ["hi"]}', 'ds.jsonl:1: message 0 must be an object with a "role"'),
        ('{"messages": [{"content": "hi"}]}', "ds.jsonl:1: message 0 must be an object"),
        ('{"messages": []}', 'ds.jsonl:1: "messages" is empty'),
    ],
)
def test_dataset_messages_are_checked_on_load(line, says, tmp_path, capsys) -> None:
    argv = ["--base-url", "http://127.0.0.1:9", "--dataset", dataset(tmp_path, line)]
    assert run(parse(argv)) == 2
    assert says in one_error_line(capsys)


def test_unwritable_outputs_are_refused_before_any_request(
    standin, tokenizer_dir, tmp_path, capsys
):
    a_file = tmp_path / "afile"
    a_file.write_text("")
    base = ["--base-url", standin.url, "--tokenizer", tokenizer_dir, "--input-len", "8",
            "--output-len", "2", "--num-requests", "2", "--no-server-metrics"]  # fmt: skip
    for flags, says in (
        (["--out", str(a_file / "x.json")], f"--out {a_file / 'x.json'}: {a_file} is a file"),
        (["--out", str(tmp_path)], "is a folder; give the name of a file"),
        (["--plot", str(a_file)], "is a file; give a folder to write the plots into"),
    ):
        assert run(parse([*base, *flags])) == 2
        assert says in one_error_line(capsys)
    assert standin.bodies == []  # refused before the run, not after it
    # a folder missing on the way is made
    out = tmp_path / "new" / "folder" / "r.json"
    assert run(parse([*base, "--out", str(out)])) == 0
    assert json.loads(out.read_text())["runs"][0]["summary"]["completed"] == 2


def test_a_401_on_the_model_list_asks_for_an_api_key(standin_with_key, tokenizer_dir, capsys):
    base = ["--base-url", standin_with_key.url, "--tokenizer", tokenizer_dir]
    assert run(parse(base)) == 2
    line = one_error_line(capsys)
    assert "HTTP 401 (invalid api key)" in line
    assert "the server wants an API key: pass --api-key or set $OPENAI_API_KEY" in line
    assert "--model" not in line  # naming the model would not get past the key
    assert run(parse([*base, "--api-key", "wrong"])) == 2
    assert "refused the API key given" in one_error_line(capsys)


def test_ctrl_c_reports_and_writes_what_finished(standin, tokenizer_dir, tmp_path, capsys):
    # 10 requests, two at a time, each ~0.6 s: a Ctrl-C at 1.5 s finds a few finished and two
    # in flight; a second sweep level never starts
    standin.ttft_s, standin.itl_s = 0.1, 0.05
    out = tmp_path / "r.json"
    argv = ["--base-url", standin.url, "--tokenizer", tokenizer_dir, "--input-len", "8",
            "--output-len", "10", "--num-requests", "10", "--sweep-concurrency", "2,4",
            "--out", str(out), "--no-server-metrics"]  # fmt: skip
    timer = threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        status = main(["bench", *argv])
    finally:
        timer.cancel()
    assert status == 130
    printed = " ".join(capsys.readouterr().out.split())
    assert "Traceback" not in printed and "servelm bench · standin-model" in printed  # the table
    assert "servelm bench: interrupted: level c=2 was cut short" in printed
    data = json.loads(out.read_text())
    (level,) = data["runs"]
    assert level["interrupted"] is True and data["capacity"] is None
    finished = level["requests"]
    assert 1 <= len(finished) < 10 and all(r["error"] is None for r in finished)
    assert level["summary"]["completed"] == len(finished)
    # the requests in flight were cancelled, not left running on the server
    deadline = time.monotonic() + 5
    while standin.in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert standin.in_flight == 0


# a stream that ends properly with no text: the model's first token ended the answer
EMPTY_ANSWER = (
    b'data: {"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": null}]}\n\n'
    b'data: {"choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": "stop"}]}\n\n'
    b'data: {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 1}}\n\n'
    b"data: [DONE]\n\n"
)


def test_an_empty_answer_is_a_completed_request() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            200, headers={"content-type": "text/event-stream"}, content=EMPTY_ANSWER
        )

    async def go() -> RequestRecord:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            target = Target(api_url="http://bench.test/v1", model="m")
            return await send_request(client, target, RequestSpec(index=0, prompt="hi"), 0.0)

    empty = asyncio.run(go())
    assert empty.ok, empty.error_message
    assert empty.ttft_s is None and empty.tpot_s is None and empty.e2e_s is not None
    assert empty.output_tokens == 1  # what the server's usage counted
    # percentiles over the requests that have a first token; the empty one meets a TTFT SLO
    # by its whole answer's time
    other = RequestRecord(index=1, start_s=0.0, ttft_s=0.2, e2e_s=0.5, output_tokens=4)
    summary = summarize([empty, other], 1.0, SLO(ttft_ms=300, tpot_ms=None))
    assert summary["completed"] == 2 and summary["failed"] == 0
    assert summary["ttft_ms"]["p50"] == pytest.approx(200)
    assert summary["slo_attainment"] == 1.0
    assert not meets_slo(RequestRecord(index=2, start_s=0.0, e2e_s=0.5), SLO(ttft_ms=100))


def test_shared_prefix_completions_prompt_has_the_recorded_length(tmp_path) -> None:
    # the completions endpoint gets system prompt and prompt as one text: its length is the one
    # recorded, and the one asked for (a "\n\n" between them added tokens nobody counted). A
    # byte-level BPE with every byte in its vocabulary, as real models have (and newlines).
    build_tokenizer(tmp_path)
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    spec = WorkloadSpec.from_preset("shared-prefix", input_len=40, prefix_len=200)
    workload = build_workload(spec, 0, tokenizer)
    target = Target(api_url="http://x/v1", model="m", endpoint="completions")
    for request in workload.requests(range(5)):
        sent = build_payload(target, request)["prompt"]
        assert len(tokenizer.encode(sent, add_special_tokens=False).ids) == request.prompt_tokens
        assert request.prompt_tokens == 240


def test_uniform_lengths_keep_their_mean_or_are_refused() -> None:
    import random

    for spread in (1.0, 1.5):
        with pytest.raises(ValueError, match="must be below 1"):
            WorkloadSpec(len_dist="uniform", len_spread=spread)
        with pytest.raises(ValueError, match="must be below 1"):
            sample_length(random.Random(0), 500, "uniform", spread)
    WorkloadSpec(len_dist="lognormal", len_spread=1.5)  # a sigma: any size
    draws = [sample_length(random.Random(i), 500, "uniform", 0.9) for i in range(4000)]
    assert sum(draws) / len(draws) == pytest.approx(500, rel=0.03)
