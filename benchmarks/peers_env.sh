# FlashInfer's environment for the benchmark shell scripts, sourced after benchmarks/gpu_env.sh:
#   - the wheels in .whl-peers/ (flashinfer-python, a JIT-only py3-none-any wheel, and what it imports that the
#     image lacks: apache-tvm-ffi, ninja, nvidia-ml-py, einops, tabulate) go into /tmp/site-peers, apart from
#     gpu_env.sh's /tmp/site (a second --target install there would replace its bin/);
#   - PATH gets their bin/ (ninja, which FlashInfer's JIT runs), FlashInfer's JIT workspace is /tmp/flashinfer-jit
#     (a fresh machine compiles the modules it needs on first use), CUDA_HOME is set where nvcc is not on PATH;
#   - prints the nvcc and ninja versions.
if ls .whl-peers/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-peers \
    .whl-peers/*.whl || echo "the wheels of .whl-peers did not install"
fi
export PYTHONPATH=/tmp/site-peers:$PYTHONPATH PATH=/tmp/site-peers/bin:$PATH
export FLASHINFER_WORKSPACE_BASE=/tmp/flashinfer-jit TVM_FFI_CACHE_DIR=/tmp/flashinfer-jit/tvm-ffi
export FLASHINFER_LOGGING_LEVEL=${FLASHINFER_LOGGING_LEVEL:-WARNING}
if ! command -v nvcc >/dev/null && [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDA_HOME=/usr/local/cuda
fi
NVCC=$(command -v nvcc || echo "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc")
echo "nvcc $("$NVCC" --version 2>/dev/null | grep -o 'release [0-9.]*' || echo missing), ninja $(ninja --version 2>/dev/null || echo missing)"
