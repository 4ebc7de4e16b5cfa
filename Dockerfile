# The serving image: mlac with the exact torch and triton that its kernel-cache units are prepared
# with. A unit is used only on a GPU whose target signature matches it (GPU, compute capability,
# CUDA, driver, torch, triton; docs/ci.md): build the GPU `prepare` jobs and the servers from this one
# image, and the units they publish load with zero JIT.
#
#   docker build -t registry.example.com/mlac/runtime:torch2.11-cu130 .
#   docker run --gpus all -p 8000:8000 -v mlac-cache:/root/.cache/mlac registry.example.com/mlac/runtime:torch2.11-cu130 \
#       serve oci://registry.example.com/models/deepseek-v3:r1 --require-prepared \
#       --require-signature /keys/signing-pub.pem --host 0.0.0.0
FROM nvidia/cuda:13.0.1-runtime-ubuntu24.04

# Triton builds its small C launchers at first use: gcc and the Python headers stay in the image
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc ca-certificates \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/mlac
ENV PATH=/opt/mlac/bin:$PATH PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1

# The pins of the target signature (the GPU image mlac is measured on: torch 2.11.0+cu130, triton 3.6.0)
ARG TORCH_VERSION=2.11.0
ARG TRITON_VERSION=3.6.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu130
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}" \
    && pip install "triton==${TRITON_VERSION}"

COPY pyproject.toml README.md /src/
COPY mlac /src/mlac
RUN pip install "/src[serve]" && rm -rf /src

# `serve oci://...` pulls into the download folder: mount a volume there so that restarts download nothing
VOLUME /root/.cache/mlac
EXPOSE 8000
ENTRYPOINT ["mlac"]
CMD ["--help"]
