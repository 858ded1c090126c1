"""Prompt logprobs of the real default model (SmolLM2-135M-Instruct, float32) served by
`servelm serve`, against transformers' float32 log-softmax of the same prompt (issue #37):
through echo + logprobs and vLLM's prompt_logprobs, for a prompt longer than the step's token
budget (chunked prefill) and for one whose prefix is in the prefix cache; then
lm-evaluation-harness's `local-completions` model as the client of a small multiple-choice task,
whose per-choice log-likelihoods and accuracy must be transformers' own."""

from __future__ import annotations

import json

import pytest
import torch

from tests.live_server import LiveServer

pytestmark = pytest.mark.slow

TOL = 1e-3
BUDGET = 64  # --max-num-batched-tokens: a longer prompt is scored chunk by chunk

LONG = " ".join(
    f"Item {i}: the warehouse on street {i * 7 % 13} ships {i % 5 + 1} crates of apples every "
    f"morning, and the driver signs the book."
    for i in range(8)
)
SHARED = (
    "You are a careful assistant. Answer every question in one short sentence, and never "
    "invent numbers that you do not know. "
)


@pytest.fixture(scope="module")
def served(default_model_dir):
    srv = LiveServer(
        default_model_dir,
        "--served-model-name",
        "smol",
        "--dtype",
        "float32",
        "--kv-cache-memory",
        "256MiB",
        "--max-model-len",
        "1024",
        "--max-num-batched-tokens",
        str(BUDGET),
        startup_timeout=300,
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(served):
    import openai

    return openai.OpenAI(base_url=served.base_url, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def hf(default_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(default_model_dir)


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, vocab]: row i is transformers' float32 log-softmax predicting ids[i + 1]."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return logits.log_softmax(dim=-1)[:-1]


def assert_echo_matches(lp, ids: list[int], ref: torch.Tensor, k: int) -> None:
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for pos in range(1, len(ids)):
        row = ref[pos - 1]
        assert abs(lp.token_logprobs[pos] - float(row[ids[pos]])) < TOL, pos
        theirs = sorted(row.topk(k).values.tolist())
        ours = sorted(lp.top_logprobs[pos].values())
        # the top k (and the prompt's own token, where it is not among them)
        assert any(
            len(ours) == len(theirs) + extra
            and all(abs(a - b) < TOL for a, b in zip(ours[extra:], theirs, strict=True))
            for extra in (0, 1)
        ), (pos, ours, theirs)


def test_echo_logprobs_match_transformers_chunked(client, hf):
    model, tok = hf
    ids = tok.encode(LONG)
    assert len(ids) > 2 * BUDGET  # scored in three chunks or more
    r = client.completions.create(
        model="smol", prompt=LONG, max_tokens=0, echo=True, logprobs=3, temperature=0
    )
    choice = r.choices[0]
    assert choice.text == LONG and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == len(ids)
    assert_echo_matches(choice.logprobs, ids, hf_logprobs(model, ids), 3)


def test_prompt_logprobs_of_a_cached_prefix_match_transformers(client, hf):
    model, tok = hf
    first, second = SHARED + "What is the capital of France?", SHARED + "Name a blue fruit."
    client.completions.create(model="smol", prompt=first, max_tokens=1)  # caches SHARED's blocks
    plain = client.completions.create(model="smol", prompt=second, max_tokens=1)
    assert plain.usage.prompt_tokens_details.cached_tokens >= 16  # the prefix is cached
    r = client.completions.create(
        model="smol", prompt=second, max_tokens=1, extra_body={"prompt_logprobs": 2}
    )
    assert r.usage.prompt_tokens_details.cached_tokens == 0  # scored: no position skipped
    ids = tok.encode(second)
    ref = hf_logprobs(model, ids)
    plps = r.choices[0].model_extra["prompt_logprobs"]
    assert len(plps) == len(ids) and plps[0] is None
    for pos in range(1, len(ids)):
        entry, row = plps[pos], ref[pos - 1]
        assert abs(entry[str(ids[pos])]["logprob"] - float(row[ids[pos]])) < TOL
        assert entry[str(ids[pos])]["rank"] == int((row > row[ids[pos]]).sum()) + 1
        values, top_ids = row.topk(2)
        for t, value in zip(top_ids, values, strict=True):
            assert abs(entry[str(int(t))]["logprob"] - float(value)) < TOL
    # the chat endpoint scores its templated prompt alike
    messages = [{"role": "user", "content": "Name a blue fruit."}]
    r = client.chat.completions.create(
        model="smol", messages=messages, max_tokens=1, extra_body={"prompt_logprobs": 0}
    )
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok.encode(text, add_special_tokens=False)
    ref = hf_logprobs(model, ids)
    plps = r.choices[0].model_extra["prompt_logprobs"]
    assert len(plps) == len(ids)
    for pos in range(1, len(ids)):
        assert abs(plps[pos][str(ids[pos])]["logprob"] - float(ref[pos - 1][ids[pos]])) < TOL


# -- lm-evaluation-harness --------------------------------------------------------------------
DOCS = [
    {"question": "The capital of France is", "choices": ["Paris", "London", "Rome"], "answer": 0},
    {"question": "Two plus two equals", "choices": ["five", "four", "ten"], "answer": 1},
    {"question": "The color of the sky on a clear day is", "choices": ["green", "red", "blue"],
     "answer": 2},
    {"question": "Water freezes at zero degrees", "choices": ["Celsius", "Kelvin", "Newton"],
     "answer": 0},
    {"question": "A cat says", "choices": ["moo", "meow", "quack"], "answer": 1},
    {"question": "The opposite of hot is", "choices": ["warm", "loud", "cold"], "answer": 2},
]  # fmt: skip

TASK_YAML = """\
task: servelm_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def offline_loglikelihoods(model, tok, doc) -> list[float]:
    """What lm-eval's loglikelihood asks for each choice, from transformers: the summed logprob
    of the continuation's tokens after the context's (split as lm-eval splits the pair)."""
    out = []
    for choice in doc["choices"]:
        context_ids = tok.encode(doc["question"], add_special_tokens=False)
        whole = tok.encode(doc["question"] + " " + choice, add_special_tokens=False)
        ref = hf_logprobs(model, whole)
        out.append(sum(float(ref[p - 1][whole[p]]) for p in range(len(context_ids), len(whole))))
    return out


@pytest.mark.parametrize("tokenized", [True, False])
def test_lm_eval_local_completions_matches_transformers(
    served, hf, default_model_dir, tmp_path, monkeypatch, tokenized
):
    import lm_eval  # pinned in the test extras: installed by make
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    data = tmp_path / "mc.json"
    data.write_text(json.dumps(DOCS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "servelm_tiny_mc.yaml").write_text(TASK_YAML.format(data=data))
    model_args = {
        "model": "smol",
        "base_url": served.base_url + "/completions",
        "tokenizer": str(default_model_dir),  # the local folder: no hub
        "tokenizer_backend": "huggingface",
        "tokenized_requests": tokenized,
        "num_concurrent": 2,
        "max_retries": 1,
        "batch_size": 4,
    }
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=model_args,
        tasks=["servelm_tiny_mc"],
        task_manager=TaskManager(include_path=str(tasks)),
        log_samples=True,
        num_fewshot=0,
        random_seed=0,
    )
    samples = sorted(results["samples"]["servelm_tiny_mc"], key=lambda s: s["doc_id"])
    assert len(samples) == len(DOCS)
    model, tok = hf
    correct = 0
    for sample in samples:
        doc = DOCS[sample["doc_id"]]
        theirs = offline_loglikelihoods(model, tok, doc)
        ours = [float(resp[0][0]) for resp in sample["resps"]]
        assert ours == pytest.approx(theirs, abs=TOL * 4), (doc, ours, theirs)
        assert all(v < 0 for v in ours)  # not the all-zero sums of an ignored echo
        best = max(range(len(theirs)), key=theirs.__getitem__)
        correct += best == doc["answer"]
        assert sample["acc"] == float(best == doc["answer"])
    acc = results["results"]["servelm_tiny_mc"]["acc,none"]
    assert acc == pytest.approx(correct / len(DOCS))
