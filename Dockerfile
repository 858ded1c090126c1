# servelm's serving image: `servelm serve` over a model folder on the /models volume.
#
#   docker build -t servelm .                                         # CPU (Debian, CPU torch)
#   docker build -t servelm:cuda \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#
# Weights are not in the image: fetch them into a volume with `servelm fetch ORG/NAME
# --revision SHA --store /models` (with HF_HUB_OFFLINE=0 and $HF_TOKEN), check them with
# `servelm fetch --verify /models/ORG--NAME`, then run the image with the volume on /models and
# the folder as the first argument. tests/store/test_image.py runs this file's ENTRYPOINT + CMD.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}

ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

# python3 for servelm; gcc + libc headers + libgomp: servelm compiles its C kernels for the CPU
# it finds at the first start (-march=native), so the compiler ships with the image.
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        python3 python3-venv gcc libc6-dev libgomp1 ca-certificates \
    && rm -rf /var/lib/apt/lists/*

RUN python3 -m venv /opt/servelm
ENV PATH=/opt/servelm/bin:$PATH
RUN pip install --no-cache-dir "$TORCH_SPEC" --index-url "$TORCH_INDEX_URL"
COPY pyproject.toml README.md /tmp/src/
COPY servelm /tmp/src/servelm
# [hub]: the same image runs the fetch Job (`servelm fetch`, with HF_HUB_OFFLINE=0).
RUN pip install --no-cache-dir "/tmp/src[hub]" && rm -rf /tmp/src

# A numeric non-root user, so that runAsNonRoot can check it. Its home holds the compiled
# kernels ($XDG_CACHE_HOME/servelm/kernels); mount an emptyDir there when the root file system
# is read-only.
RUN useradd --uid 10001 --user-group --create-home --home-dir /home/servelm servelm \
    && mkdir /models && chown 10001:10001 /models
USER 10001:10001
ENV HOME=/home/servelm \
    XDG_CACHE_HOME=/home/servelm/.cache \
    SERVELM_MODEL_STORE=/models \
    HF_HUB_OFFLINE=1 \
    PYTHONUNBUFFERED=1
VOLUME /models
EXPOSE 8000

ENTRYPOINT ["servelm", "serve"]
CMD ["/models/HuggingFaceTB--SmolLM2-135M-Instruct", "--host", "0.0.0.0", "--port", "8000"]
