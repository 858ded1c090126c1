"""`--device`: auto picks what there is; a GPU asked for where there is none is a clear refusal."""

import pytest
import torch

from servelm.worker.model_runner import resolve_device


def test_auto_picks_cuda_only_where_it_runs():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    assert resolve_device("cpu") == torch.device("cpu")


def test_cuda_where_there_is_none_is_refused_by_name():
    if torch.cuda.is_available():
        assert resolve_device("cuda").type == "cuda"
        return
    with pytest.raises(ValueError, match="--device cuda: .*use --device cpu or auto"):
        resolve_device("cuda")
