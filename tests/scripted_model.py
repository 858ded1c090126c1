"""A tiny Llama folder whose greedy answers are written in advance: scripts of whole-text tokens.

Every layer's output projections are zero, so the last hidden state is the current token's
embedding and the model is a bigram table. Each script is a chain of added tokens (pieces of
text); piece k's embedding is the unit vector e_k and the LM head scores piece k+1 (the end
token after the last piece) at about 8 * STEP from it and every other token at 0. Any other
token embeds to zero and scores nothing, so after the prompt `logit_bias` picks the script's
first piece (+100 < 8 * STEP, so the bias cannot pull the chain off its script); temperature 0
then writes the script to its end. The answers are exact, whatever the prompt's other tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.tiny_model import build_tokenizer

STEP = 50.0

SCRIPTS = {
    "one_call": [
        "Let me look that up.",
        "\n<tool_call>\n",
        '{"name": "get_weather", ',
        '"arguments": {"city": ',
        '"Paris", "unit": "celsius"}}',
        "\n</tool_call>",
    ],
    "two_calls": [
        '<tool_call>{"name": "get_time", "arguments": ',
        '{"tz": "UTC"}}</tool_call>',
        '\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}',
        "</tool_call>\n",
    ],
    "plain": ["The weather is ", "fine today."],
    "tag_prefix": ["Use <tool", "s> wisely."],
    "llama": ['{"name": "get_weather", "parameters": ', '{"city": "Rome"}}'],
    "pythonic": ['[get_weather(city="Lima"), ', "get_time(tz='PET')]"],
}


def build_scripted_model(out: Path) -> dict[str, int]:
    """Writes the folder; returns each script's first token id (for `logit_bias`)."""
    import torch
    from tokenizers import AddedToken, Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    pieces = [p for script in SCRIPTS.values() for p in script]
    assert len(set(pieces)) == len(pieces)
    tok.add_tokens([AddedToken(p, normalized=False) for p in pieces])
    tok.save(str(out / "tokenizer.json"))
    ids = {p: tok.token_to_id(p) for p in pieces}
    eos = tok.token_to_id("<|im_end|>")
    hidden = 64
    assert len(pieces) <= hidden
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=hidden,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=eos,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_() if p.dim() == 2 else p.fill_(1.0)  # norms at 1
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        k = 0
        for script in SCRIPTS.values():
            chain = [ids[p] for p in script] + [eos]
            for here, after in zip(chain, chain[1:], strict=False):
                embed[here, k] = 1.0
                head[after, k] = STEP
                k += 1
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": eos})
    )
    return {name: ids[script[0]] for name, script in SCRIPTS.items()}


def script_text(name: str) -> str:
    return "".join(SCRIPTS[name])
