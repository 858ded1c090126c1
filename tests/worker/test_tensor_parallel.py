"""Tensor parallelism on a CPU: two ranks joined by gloo (servelm/worker/tp.py,
servelm/model/parallel.py), each loading only its slices of a tiny random model.

- Greedy tokens at tp=2 equal tp=1's exactly and transformers' (float32), batched, with
  prefix-cache hits, chunked and preempted (tests/model/family_harness.py), for 8 query heads
  over 4 KV heads, 2 (with q/k/v biases, Qwen2) and 1 (replicated on both ranks, with a
  vocabulary that does not divide: the last rank's padding is cut from the logits).
- What each rank reads from the checkpoint and holds, its KV bytes per token and the
  collectives a step makes are the planner's numbers (`servelm plan --tp 2`).
- `servelm serve --tensor-parallel-size 2` answers the openai client; a rank killed
  mid-stream fails the stream, turns /health to 503, the server exits 1 and no rank is left.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest
from safetensors import safe_open

from servelm import LLM, SamplingParams
from servelm.model.config import ModelConfigError
from servelm.planner.shapes import shape_from_folder
from servelm.worker import shm_allreduce
from tests.live_server import LiveServer, kill_mid_stream
from tests.model.family_harness import (
    check_against_transformers,
    make_tiny_model,
    prompts_sharing_prefix,
)

SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=8, head_dim=16)


def _tokens(model_dir: Path, prompts, **kwargs) -> list[tuple[list[int], list[float]]]:
    llm = LLM(str(model_dir), dtype="float32", **kwargs)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    out = [
        (r.outputs[0].token_ids, [lp.logprob for lp in r.outputs[0].logprobs])
        for r in llm.generate(prompts, params)
    ]
    llm.engine.check_integrity()
    return out


@pytest.mark.parametrize(
    "config,kv_heads,extra",
    [
        ("LlamaConfig", 4, {}),
        ("Qwen2Config", 2, {}),  # q/k/v biases: column slices of the bias too
        ("LlamaConfig", 1, {"vocab_size": 387}),  # KV head replicated; vocab 194 + 193 (+1 pad)
        # o_proj's and down_proj's biases (row slices: added once, after the sum), gate/up's
        ("LlamaConfig", 4, {"attention_bias": True, "mlp_bias": True}),
    ],
)
def test_tp2_equals_tp1_and_transformers(tmp_path, monkeypatch, config, kv_heads, extra):
    model_dir = make_tiny_model(tmp_path, config, num_key_value_heads=kv_heads, **SHAPE, **extra)
    prompts = prompts_sharing_prefix(384)
    one = _tokens(model_dir, prompts)
    two = _tokens(model_dir, prompts, tensor_parallel_size=2)  # all-reduces in shared memory
    monkeypatch.setenv(shm_allreduce.ENV, "0")
    gloo = _tokens(model_dir, prompts, tensor_parallel_size=2)  # every collective in gloo
    monkeypatch.delenv(shm_allreduce.ENV)
    for (ids1, lps1), (ids2, lps2), (ids3, _) in zip(one, two, gloo, strict=True):
        assert ids2 == ids1 and ids3 == ids1
        assert max(abs(a - b) for a, b in zip(lps1, lps2, strict=True)) < 1e-4
    assert not list(Path("/dev/shm").glob("servelm-tp-*"))  # the mapping's file is gone
    seen = check_against_transformers(model_dir, kernels=("auto",), tensor_parallel_size=2)
    assert seen["prefix_cache_hits"] > 0 and seen["preemptions_auto"] > 0


def test_each_rank_reads_and_holds_what_the_plan_says(tmp_path):
    model_dir = make_tiny_model(tmp_path, "LlamaConfig", num_key_value_heads=4, **SHAPE)
    shape = shape_from_folder(model_dir)
    total = 0
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            sliced = f.get_slice(name)
            total += 4 * _numel(sliced.get_shape())
    llm = LLM(str(model_dir), dtype="float32", tensor_parallel_size=2)
    tp = llm.engine.executor
    # The planner counts per-rank elements as bf16 bytes; these weights are float32.
    per_rank = shape.weight_bytes("bf16", 2) / 2 * 4
    assert len(tp.ranks) == 2
    for rank in tp.ranks:
        assert rank.bytes_read == per_rank, rank
        assert rank.weight_bytes == per_rank, rank
        assert rank.rss_bytes > rank.weight_bytes  # (read from /proc: the weights are in it)
    assert per_rank < 0.55 * total  # half, plus the replicated norms
    assert tp.bytes_per_block // 16 == shape.kv_bytes_per_token("bf16", 2) * 2

    # A step's collectives: two per layer, the embedding's and the logits' (the plan's count).
    from servelm.planner.catalog import get_gpu
    from servelm.planner.plan import plan

    expected = plan(shape, get_gpu("h100"), tp=2).collectives_per_step
    assert expected == 2 * shape.num_layers + 2
    group = tp.runner.tp
    before = group.collectives
    llm.generate([[5] * 10], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert group.collectives - before == 3 * expected  # a prompt step and two decode steps


def test_q4_1_weights_are_sliced_into_int4_copies_on_each_rank(tmp_path):
    """A Q4_1 GGUF (the default model's form): each rank's slices of the 4-bit projections
    still lie on their groups' grid (a column slice keeps whole groups of 32), so each rank
    serves them from exact int4 copies with the C kernel, and greedy tokens are tp=1's."""
    from servelm.store.gguf_import import import_gguf
    from tests.store.gguf_models import Q, all_of, tiny_hf_model, write_family_gguf

    layers = 2
    hf = tiny_hf_model("llama", num_attention_heads=8, num_key_value_heads=4, head_dim=32)
    src = write_family_gguf(tmp_path / "q4_1.gguf", hf, "llama", all_of(Q.Q4_1))
    folder = import_gguf(src, tmp_path / "model")
    prompts = [[5, 6, 7, 8] * 6, [9, 10, 11] * 5, [12] * 9]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = {}
    for tp in (1, 2):
        llm = LLM(str(folder), dtype="bfloat16", kv_cache_memory="4MiB", tensor_parallel_size=tp)
        if tp == 2:
            assert [r.int4_layers for r in llm.engine.executor.ranks] == [4 * layers] * 2
        else:
            assert llm.engine.executor.int4_layers == 4 * layers
        outs[tp] = [r.outputs[0].token_ids for r in llm.generate(prompts, params)]
        del llm
    assert outs[2] == outs[1]


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def test_a_model_that_does_not_split_is_refused_by_name(tmp_path):
    model_dir = make_tiny_model(tmp_path, "LlamaConfig", num_key_value_heads=2, **SHAPE)
    with pytest.raises(ModelConfigError, match="8 query heads.* 3 ranks"):
        LLM(str(model_dir), dtype="float32", tensor_parallel_size=3)
    phi = make_tiny_model(tmp_path, "Phi3Config", num_key_value_heads=2, **SHAPE)
    with pytest.raises(ModelConfigError, match="Phi3ForCausalLM.s tensor .*_proj.weight is not"):
        LLM(str(phi), dtype="float32", tensor_parallel_size=2)
    assert not _rank_processes(os.getpid())  # refused before any rank started (nor left over)


def _rank_processes(parent: int) -> list[int]:
    """Live rank processes (servelm.worker.tp) whose parent is `parent`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if b"servelm.worker.tp" in cmdline and int(fields[1]) == parent and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    """Whether process `pid` still runs (an orphan would have been adopted by init, so this
    asks about the pid itself, not about the children of the engine)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _gone(pids: list[int], seconds: float = 10) -> bool:
    deadline = time.time() + seconds
    while any(_alive(p) for p in pids) and time.time() < deadline:
        time.sleep(0.2)
    return not any(_alive(p) for p in pids)


def test_serve_answers_and_a_dead_rank_takes_the_server_down(tiny_model_dir):
    from openai import OpenAI

    srv = LiveServer(tiny_model_dir, "--tensor-parallel-size", "2", "--engine-death-grace", "3")
    try:
        assert "tensor parallel: 2 ranks" in srv.log()
        client = OpenAI(base_url=srv.base_url, api_key="none")
        done = client.completions.create(
            model=client.models.list().data[0].id,
            prompt="def add(a, b):",
            max_tokens=8,
            temperature=0,
        )
        assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 8
        # the same text as one rank gives
        alone = LLM(str(tiny_model_dir)).generate(
            "def add(a, b):", SamplingParams(temperature=0, max_tokens=8)
        )
        assert done.choices[0].text == alone[0].outputs[0].text

        engine = srv.engine_pid()
        (rank1,) = _rank_processes(engine)
        events = kill_mid_stream(srv.base_url, rank1)
        assert events[-1] == "data: [DONE]"
        assert '"error"' in events[-2]
        assert httpx.get(srv.url + "/health").status_code == 503
        deadline = time.time() + 30
        while srv.proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert srv.proc.returncode == 1
        assert "tensor-parallel rank 1 exited" in srv.log()
        assert _gone([engine, rank1])
    finally:
        srv.stop()


def test_sigterm_stops_the_server_and_every_rank(tiny_model_dir):
    srv = LiveServer(tiny_model_dir, "--tensor-parallel-size", "2")
    try:
        engine = srv.engine_pid()
        ranks = _rank_processes(engine)
        assert len(ranks) == 1
    finally:
        code = srv.stop()
    assert code == 0
    assert _gone([engine, *ranks])
