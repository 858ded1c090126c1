import pytest

from tests.live_server import LiveServer
from tests.scripted_model import build_scripted_model


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    srv = LiveServer(
        tiny_model_dir,
        "--kv-cache-memory",
        "8MiB",
        "--served-model-name",
        "tiny",
        "--max-model-len",
        "512",
        "--max-num-seqs",
        "64",
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def scripted(tmp_path_factory):
    """(folder, each script's first token id) of the scripted model (tests/scripted_model.py),
    whose greedy answers are written in advance."""
    folder = tmp_path_factory.mktemp("scripted")
    return folder, build_scripted_model(folder)
