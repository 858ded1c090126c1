"""A store model's packed int4 weights are kept between starts and give the same model back.

The tiny model goes into a store of its own (`SERVELM_MODEL_STORE`), loaded with
`quantization="int4"` and servelm's C kernel, as the default model is with its Q4_1 weights.
"""

import os
import shutil

import pytest
import torch

from servelm.kernels.build import compiler
from servelm.kernels.quant_matmul import QuantMatmul
from servelm.model import packed_cache
from servelm.model.config import load_spec
from servelm.model.layers.linear import Linear
from servelm.model.loader import build_model
from servelm.store.paths import STORE_ENV

pytestmark = pytest.mark.skipif(compiler() is None, reason="the C kernel needs a C compiler")


@pytest.fixture
def store_model(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setenv(STORE_ENV, str(tmp_path / "store"))
    model_dir = tmp_path / "store" / "tiny"
    shutil.copytree(tiny_model_dir, model_dir)
    return model_dir


def load(model_dir):
    kernel = QuantMatmul.load()
    assert kernel is not None
    spec = load_spec(model_dir)
    return build_model(model_dir, spec, torch.bfloat16, torch.device("cpu"), 64, "int4", kernel)


def logits(model) -> torch.Tensor:
    """The model's logits for a 12-token prompt in one fresh 16-token block: every projection
    runs through its int4 weight (the tiles' path, or the vector path without AMX)."""
    from servelm.worker.attention import TorchPagedAttention

    n, spec = 12, model.spec
    caches = [
        (torch.zeros(16, spec.num_kv_heads, spec.head_dim, dtype=torch.bfloat16),) * 2
        for _ in range(spec.num_layers)
    ]
    attn = TorchPagedAttention(caches, spec.head_dim**-0.5, 16)
    attn.plan([(0, n, [0])], torch.device("cpu"), torch.bfloat16)
    with torch.inference_mode():
        return model.compute_logits(model(torch.arange(3, 3 + n), torch.arange(n), attn))


def kept_files(model_dir):
    return sorted((model_dir / packed_cache.FOLDER).glob("*"))


def test_a_second_start_reads_them_and_computes_the_same(store_model):
    first = load(store_model)
    assert first.int4_layers > 0 and not first.int4_kept
    assert len(kept_files(store_model)) == 1
    second = load(store_model)
    assert second.int4_kept and second.int4_layers == first.int4_layers
    for a, b in zip(first.modules(), second.modules(), strict=True):
        if isinstance(a, Linear):
            assert torch.equal(a.int4.packed, b.int4.packed) and a.int4.error == b.int4.error
            assert a.int4.max_rows == b.int4.max_rows and b.weight.numel() == a.weight.numel()
    assert torch.equal(logits(first), logits(second))
    assert second.weight_bytes == first.weight_bytes


def test_a_changed_model_file_makes_them_again(store_model):
    load(store_model)
    (old,) = kept_files(store_model)
    config = store_model / "config.json"
    os.utime(config, ns=(config.stat().st_atime_ns, config.stat().st_mtime_ns + 10**9))
    again = load(store_model)
    assert not again.int4_kept
    assert kept_files(store_model) != [old] and len(kept_files(store_model)) == 1


def test_a_torn_file_is_ignored_and_replaced(store_model, caplog):
    load(store_model)
    (path,) = kept_files(store_model)
    path.write_bytes(path.read_bytes()[:1000])
    with caplog.at_level("WARNING"):
        again = load(store_model)
    assert not again.int4_kept and "ignoring packed weights" in caplog.text
    assert load(store_model).int4_kept


def test_a_folder_outside_the_store_keeps_nothing(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv(STORE_ENV, str(tmp_path / "store"))
    model_dir = tmp_path / "elsewhere"
    shutil.copytree(tiny_model_dir, model_dir)
    assert not load(model_dir).int4_kept and not load(model_dir).int4_kept
    assert not (model_dir / packed_cache.FOLDER).exists()
