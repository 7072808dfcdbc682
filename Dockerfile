# specdec image: the same image runs the Ray head (coordinator) and the GPU workers on KubeRay,
# and `docker run IMAGE generate ...` works as a client.
#
#   GPU (default):  docker build -t specdec:0.1.0 .
#   CPU only:       docker build -t specdec:0.1.0-cpu \
#                     --build-arg BASE_IMAGE=ubuntu:24.04 \
#                     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .
#
# pyproject.toml pins torch==2.13.0 (on the project's CPU machines that is the CPU wheel). Here
# torch is installed first from PyTorch's CUDA index, as 2.13.0+cu128, which satisfies the pin,
# so `pip install .` keeps it. Pick the index that matches your nodes' NVIDIA driver (cu128 needs
# a driver >= 570, or >= 525 with CUDA minor-version compatibility); the wheel bundles the CUDA
# runtime, so the base image only has to be a CUDA-enabled one (NVIDIA container runtime env).
ARG BASE_IMAGE=nvidia/cuda:12.8.1-base-ubuntu24.04
FROM ${BASE_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
# Must equal spec.rayVersion in k8s/base/raycluster.yaml; every pod runs this same image.
ARG RAY_VERSION=2.60.0

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HF_HUB_OFFLINE=1 \
    RAY_USAGE_STATS_ENABLED=0

# bash: KubeRay's commands; wget: KubeRay's default health probes for older Ray versions; gcc and
# libc6-dev: CPU workers build specdec's C kernels on first use (specdec.model.cpu_kernels).
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv bash wget ca-certificates gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*

RUN python3 -m venv /opt/venv \
 && pip install --upgrade pip \
 && pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

# Third-party dependencies in their own layer (read from pyproject.toml), so that a code change
# does not reinstall them.
COPY pyproject.toml /tmp/specdec-pyproject.toml
RUN python -c "import tomllib; d = tomllib.load(open('/tmp/specdec-pyproject.toml', 'rb')); print('\n'.join(d['project']['dependencies']))" > /tmp/specdec-requirements.txt \
 && pip install -r /tmp/specdec-requirements.txt "ray[default]==${RAY_VERSION}" \
 && rm /tmp/specdec-pyproject.toml /tmp/specdec-requirements.txt

COPY . /opt/specdec
RUN pip install /opt/specdec \
 && ln -s /opt/venv/bin/specdec /opt/venv/bin/ray /usr/local/bin/ \
 && python -c "import torch, ray, specdec, coordinator, draft_worker, target_worker; print('torch', torch.__version__, 'ray', ray.__version__)"

# Non-root; the UID matches runAsUser in k8s/base/raycluster.yaml (1000 is taken by 'ubuntu').
RUN useradd --uid 10001 --user-group --create-home --shell /bin/bash specdec
USER 10001
WORKDIR /home/specdec

EXPOSE 50051 8000 8265
ENTRYPOINT ["specdec"]
CMD ["--help"]
