"""The container image's contract, read from the Dockerfile and the .dockerignore (no daemon is
needed: docker-py computes the build context the way `docker build` sends it). The image's
command itself is run against a fetched store in test_hub_fetch.py."""

from __future__ import annotations

from docker.utils.build import exclude_paths

from tests.store.dockerfile import DOCKERIGNORE, ROOT, read_image


def test_the_image_serves_offline_as_a_non_root_user_from_the_models_volume():
    image = read_image()
    assert image.entrypoint == ["servelm", "serve"]
    assert image.cmd[0].startswith("/models/")  # the model folder, on the volume
    assert image.env["HF_HUB_OFFLINE"] == "1"
    assert image.env["SERVELM_MODEL_STORE"] == "/models"
    assert image.volumes == ["/models"]
    user = image.user.split(":")[0]
    assert user.isdigit() and int(user) != 0  # numeric, so runAsNonRoot can check it


def test_the_base_image_is_a_build_argument():
    image = read_image()
    # the default, resolved from `ARG BASE_IMAGE=...` before FROM: CPU
    assert image.parser.baseimage == "debian:bookworm-slim"
    from_lines = [i["value"] for i in image.parser.structure if i["instruction"] == "FROM"]
    assert from_lines == ["${BASE_IMAGE}"]


def test_no_weights_are_copied_into_the_image():
    image = read_image()
    sources = [
        part
        for i in image.parser.structure
        if i["instruction"] in ("COPY", "ADD")
        for part in i["value"].split()[:-1]
    ]
    assert sources and all(s in ("pyproject.toml", "README.md", "servelm") for s in sources)


def test_the_build_context_holds_the_package_and_nothing_big():
    context = exclude_paths(
        str(ROOT), DOCKERIGNORE.read_text().splitlines(), dockerfile="Dockerfile"
    )
    # What the COPY lines need is there...
    for needed in ("pyproject.toml", "README.md", "servelm/cli.py", "servelm/kernels/common.h"):
        assert needed in context
    assert any(p.startswith("servelm/kernels/") and p.endswith(".c") for p in context)
    # ...and nothing else: no virtualenv, git history, model stores, caches or weights.
    top = {p.split("/")[0] for p in context}
    assert top <= {"pyproject.toml", "README.md", "servelm", "Dockerfile", ".dockerignore"}, top
    for path in context:
        parts = path.split("/")
        assert not {"__pycache__", ".packed", ".venv", ".git"} & set(parts), path
        assert not path.endswith((".pyc", ".so", ".gguf", ".safetensors", ".bin", ".pt")), path
    size = sum((ROOT / p).stat().st_size for p in context if (ROOT / p).is_file())
    assert size < 5 * 2**20, f"build context of {size} bytes"
