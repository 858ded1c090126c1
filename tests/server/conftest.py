import pytest

from tests.live_server import LiveServer


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
