"""`servelm fetch ORG/NAME --revision SHA` through the real huggingface_hub against a hub stand-in
on loopback (tests/store/hub_standin.py, pointed at by $HF_ENDPOINT), then `servelm fetch
--verify` and `servelm serve` on the fetched folder, offline, run as the container image runs it.

The stand-in serves the default model's files (prepared by `servelm fetch`, as `make test` does)
as HuggingFaceTB/SmolLM2-135M-Instruct, the folder the image's CMD names, plus a tiny model for
the tests that fetch several times. Every command runs as a subprocess of the console script.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

from servelm.bench.ready import wait_healthy
from servelm.store.manifest import MANIFEST_NAME, read_manifest
from tests.live_server import free_port
from tests.store.dockerfile import read_image
from tests.store.hub_standin import HubStandIn, Repo, make_file

SERVELM = str(Path(sys.executable).parent / "servelm")  # the venv's console script
TOKEN = "hf_standin_token"
COMMIT = "5f2c1b0e9d8a7c6b5a4f3e2d1c0b9a8f7e6d5c4b"
TINY_COMMIT = "0123456789abcdef0123456789abcdef01234567"
DEFAULT_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
TINY_REPO = "servelm-tests/tiny"
# Files a model repo carries that serving does not read: they must not be fetched.
NOT_SERVED = {"README.md": b"# model card\n", "original/params.json": b"{}\n"}


def _repo(commit: str, folder: Path) -> Repo:
    files = {
        p.name: make_file(p.name, source=p)
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name != MANIFEST_NAME
    }
    files |= {name: make_file(name, data=data) for name, data in NOT_SERVED.items()}
    return Repo(commit, files)


@pytest.fixture(scope="module")
def hub(default_model_dir, tiny_model_dir):
    standin = HubStandIn(
        {
            DEFAULT_REPO: _repo(COMMIT, default_model_dir),
            TINY_REPO: _repo(TINY_COMMIT, tiny_model_dir),
        },
        token=TOKEN,
    )
    yield standin
    standin.close()


@pytest.fixture
def clean_hub(hub):
    hub.reset()
    hub.cut_once.clear()
    hub.hold = None
    return hub


def _env(hub: HubStandIn, home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    return {
        **env,
        "HF_ENDPOINT": hub.url,
        "HF_TOKEN": TOKEN,
        "HF_HOME": str(home / "hf-home"),  # no user cache to copy files from
        "HF_HUB_OFFLINE": "0",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        **extra,
    }


def fetch(hub, store: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [SERVELM, "fetch", *args, "--store", str(store)],
        env=env or _env(hub, store.parent),
        capture_output=True,
        text=True,
        timeout=300,
    )


def verify(folder: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [SERVELM, "fetch", "--verify", str(folder)], capture_output=True, text=True, timeout=120
    )


def hub_calls(hub: HubStandIn) -> list:
    """Requests for the repos (model info, tree, files); huggingface_hub 2.x also asks
    /api/agent-harnesses once a day, a tokenless lookup unrelated to the repo."""
    return [r for r in hub.requests if not r.path.startswith("/api/agent-harnesses")]


@pytest.fixture(scope="module")
def fetched(hub, tmp_path_factory):
    """The default model fetched at COMMIT, with the connection cut once mid-weights."""
    hub.reset()
    hub.cut_once = {"model.safetensors"}
    # Readable by any user: the image test serves it as a non-root user (a read-only volume).
    base = Path(tempfile.mkdtemp(prefix="servelm-hub-"))
    base.chmod(0o755)
    store = base / "models"
    result = fetch(hub, store, DEFAULT_REPO, "--revision", COMMIT)
    assert result.returncode == 0, result.stderr[-3000:]
    yield SimpleNamespace(
        store=store,
        folder=Path(result.stdout.strip()),
        stderr=result.stderr,
        requests=list(hub.requests),
        bytes_sent=dict(hub.bytes_sent),
        cuts=dict(hub.cuts),
        base=base,
    )
    shutil.rmtree(base, ignore_errors=True)


def test_fetch_writes_the_manifest_of_the_pinned_commit(fetched, default_model_dir):
    assert fetched.folder == fetched.store / "HuggingFaceTB--SmolLM2-135M-Instruct"
    manifest = read_manifest(fetched.folder)
    assert manifest["source"] == {"repo": DEFAULT_REPO, "revision": COMMIT}
    # The checksums the default model's own import recorded, independent of the fetch code.
    source = read_manifest(default_model_dir)["files"]
    assert manifest["files"] == source
    for name in NOT_SERVED:  # only what serving reads
        assert not (fetched.folder / name).exists()
    ok = verify(fetched.folder)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.splitlines() == [
        f"OK {fetched.folder}: {len(source)} files match the manifest ({DEFAULT_REPO}@{COMMIT})"
    ]


def test_a_cut_connection_is_resumed_with_a_range_request(fetched, default_model_dir):
    size = (default_model_dir / "model.safetensors").stat().st_size
    cut = fetched.cuts["model.safetensors"]
    assert 0 < cut < size
    gets = [
        r for r in fetched.requests if r.method == "GET" and r.path.endswith("/model.safetensors")
    ]
    assert [r.range is None for r in gets] == [True, False], gets
    resumed_at = int(gets[1].range.removeprefix("bytes=").rstrip("-"))
    # huggingface_hub keeps what it had written (whole 10 MB chunks) and asks for the rest.
    assert 0 < resumed_at <= cut
    assert fetched.bytes_sent["model.safetensors"] == cut + (size - resumed_at)
    assert "Trying to resume download" in fetched.stderr


def test_the_token_from_hf_token_reaches_the_hub_as_a_bearer_header(fetched):
    calls = hub_calls(SimpleNamespace(requests=fetched.requests))
    assert calls and all(r.authorization == f"Bearer {TOKEN}" for r in calls)


def test_a_gated_repo_without_a_token_is_a_clear_error(clean_hub, tmp_path):
    env = _env(clean_hub, tmp_path)
    del env["HF_TOKEN"]
    result = fetch(clean_hub, tmp_path / "models", TINY_REPO, "--revision", "main", env=env)
    assert result.returncode == 1
    assert "GatedRepoError" in result.stderr and "HF_TOKEN" in result.stderr
    assert "Traceback" not in result.stderr
    assert read_manifest(tmp_path / "models" / "servelm-tests--tiny") is None


def test_fetching_the_same_revision_again_downloads_nothing(fetched, clean_hub):
    again = fetch(clean_hub, fetched.store, DEFAULT_REPO, "--revision", COMMIT)
    assert again.returncode == 0, again.stderr
    assert Path(again.stdout.strip()) == fetched.folder
    assert clean_hub.requests == []  # pinned and intact: not one request
    # A branch costs one request, to learn its commit; still no file is fetched.
    branch = fetch(clean_hub, fetched.store, DEFAULT_REPO, "--revision", "main")
    assert branch.returncode == 0, branch.stderr
    assert [r.path for r in hub_calls(clean_hub)] == [f"/api/models/{DEFAULT_REPO}/revision/main"]


def test_verify_names_bad_files_and_fetch_repairs_them(clean_hub, tmp_path):
    store = tmp_path / "models"
    first = fetch(clean_hub, store, TINY_REPO, "--revision", TINY_COMMIT)
    assert first.returncode == 0, first.stderr
    folder = Path(first.stdout.strip())
    assert verify(folder).returncode == 0

    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte, same size
    weights.write_bytes(bytes(data))
    bad = verify(folder)
    assert bad.returncode == 1
    assert bad.stderr.splitlines() == [
        f"servelm fetch --verify: {weights}: sha256 differs from the manifest"
    ]
    (folder / "config.json").unlink()
    bad = verify(folder)
    assert bad.returncode == 1 and bad.stdout == ""
    assert sorted(bad.stderr.splitlines()) == [
        f"servelm fetch --verify: {folder / 'config.json'}: missing",
        f"servelm fetch --verify: {weights}: sha256 differs from the manifest",
    ]

    clean_hub.reset()
    repair = fetch(clean_hub, store, TINY_REPO, "--revision", TINY_COMMIT)
    assert repair.returncode == 0, repair.stderr
    fetched_again = sorted(r.path.rsplit("/", 1)[1] for r in clean_hub.downloads())
    assert fetched_again == ["config.json", "model.safetensors"]
    assert verify(folder).returncode == 0


def test_a_killed_fetch_leaves_no_manifest_and_the_next_one_fetches_the_rest(clean_hub, tmp_path):
    store = tmp_path / "models"
    folder = store / "servelm-tests--tiny"
    clean_hub.hold = ("model.safetensors", 64 * 1024)  # stall the weights after 64 KiB
    proc = subprocess.Popen(
        [SERVELM, "fetch", TINY_REPO, "--revision", TINY_COMMIT, "--store", str(store)],
        env=_env(clean_hub, tmp_path),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    others = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    # huggingface_hub records a file's metadata once the file is in place.
    done = [folder / ".cache/huggingface/download" / f"{name}.metadata" for name in others]
    deadline = time.monotonic() + 120
    while not (clean_hub.held.is_set() and all(p.exists() for p in done)):
        assert proc.poll() is None and time.monotonic() < deadline, "fetch did not get mid-file"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)  # as a node dies: nothing runs after it
    proc.wait()
    clean_hub.hold = None
    clean_hub.release()
    assert not (folder / MANIFEST_NAME).exists()
    assert not (folder / "model.safetensors").exists()
    assert verify(folder).returncode == 1

    clean_hub.reset()
    rest = fetch(clean_hub, store, TINY_REPO, "--revision", TINY_COMMIT)
    assert rest.returncode == 0, rest.stderr
    assert [r.path.rsplit("/", 1)[1] for r in clean_hub.downloads()] == ["model.safetensors"]
    assert verify(folder).returncode == 0


DROP_TO_NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]


def _nobody_can_run_python() -> bool:
    """Whether the test can run the server as uid 65534: it runs as root, setpriv is there, and
    that uid can start this interpreter and a child of it (the engine is spawned)."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        return False
    child = (
        "import subprocess, sys; sys.exit(subprocess.run([sys.executable, '-c', '']).returncode)"
    )
    probe = subprocess.run([*DROP_TO_NOBODY, sys.executable, "-c", child], capture_output=True)
    return probe.returncode == 0


def test_the_image_command_serves_the_fetched_folder_offline(fetched, clean_hub, tmp_path):
    """The Dockerfile's ENTRYPOINT + CMD, run as the image runs them: with the image's ENV
    (HF_HUB_OFFLINE=1), `servelm` from the venv's bin (the image's PATH), the store where the
    /models volume is mounted, as uid 65534 when the test runs as root and that uid can start
    the interpreter (a warning says when it cannot). Only the port is added (a free one). The
    hub stand-in stays $HF_ENDPOINT and sees no request."""
    import openai

    image = read_image()
    home = fetched.base / "home"  # the image user's $HOME (compiled kernels go under it)
    mounts = {"/models": str(fetched.store), image.env["HOME"]: str(home)}

    def mounted(value: str) -> str:
        for inside, outside in mounts.items():
            if value == inside or value.startswith(inside + "/"):
                return outside + value[len(inside) :]
        return value

    argv = [mounted(a) for a in image.argv]
    assert argv[:2] == ["servelm", "serve"] and Path(argv[2]) == fetched.folder
    argv[0] = SERVELM
    port = free_port()
    env = _env(clean_hub, tmp_path)
    env |= {k: mounted(v) for k, v in image.env.items() if k != "PATH"}
    env["PATH"] = f"{Path(SERVELM).parent}:{os.environ['PATH']}"
    # The kernels `make` built already, so that this start does not compile them again.
    from servelm.kernels.build import cache_dir

    kernels = Path(env["XDG_CACHE_HOME"]) / "servelm" / "kernels"
    shutil.copytree(cache_dir(), kernels, dirs_exist_ok=True)
    prefix = []
    if _nobody_can_run_python():
        # nobody: reads the store root wrote, as the engine reads a volume another Job filled
        for path in [home, *home.rglob("*")]:
            shutil.chown(path, 65534, 65534)
        prefix = DROP_TO_NOBODY
    else:
        warnings.warn(
            f"the image command ran as uid {os.geteuid()}: uid 65534 cannot start this "
            f"venv's interpreter ({sys.executable})",
            stacklevel=1,
        )
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [*prefix, *argv, "--port", str(port)], env=env, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", proc, 240, 0.2, log.read_text)
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120
        )
        model = client.models.list().data[0].id
        completion = client.completions.create(
            model=model, prompt="The capital of France is", max_tokens=4, temperature=0
        )
        assert completion.choices[0].text.strip()
        assert completion.usage.completion_tokens == 4
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert clean_hub.requests == [], "servelm serve asked the hub"
    assert proc.returncode == 0, log.read_text()[-3000:]


@pytest.mark.parametrize(
    ("repo", "revision", "error"),
    [
        ("nobody/nothing", "main", "RepositoryNotFoundError"),
        (TINY_REPO, "v9", "RevisionNotFoundError"),
    ],
)
def test_an_unknown_repo_or_revision_is_a_clear_error(clean_hub, tmp_path, repo, revision, error):
    result = fetch(clean_hub, tmp_path / "models", repo, "--revision", revision)
    assert result.returncode == 1 and result.stdout == ""
    assert "neither a local path nor a model on the Hugging Face hub" in result.stderr
    assert error in result.stderr and "Traceback" not in result.stderr


def test_a_hub_that_never_answers_is_a_clear_error_in_bounded_time(tmp_path):
    """A hub (or a proxy) that takes the connection and never answers: `servelm fetch` waited
    forever on huggingface_hub's default of no timeout."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # the kernel accepts the connections; nobody ever answers them
    try:
        stand_in = SimpleNamespace(url=f"http://127.0.0.1:{silent.getsockname()[1]}")
        env = _env(stand_in, tmp_path, HF_HUB_ETAG_TIMEOUT="2")
        result = fetch(stand_in, tmp_path / "models", "someorg/somemodel", env=env)
    finally:
        silent.close()
    assert result.returncode == 1, result.stderr
    assert "cannot reach the Hugging Face hub" in result.stderr
    assert "Traceback" not in result.stderr
