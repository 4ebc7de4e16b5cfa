# DeepGEMM's environment for benchmarks/kernels/peers.py, sourced after benchmarks/gpu_env.sh. DeepGEMM has no
# wheel and the GPU host no package index, so its sources travel in .peers/ (ignored by git), made on a machine
# with the sources at hand:
#   .peers/dg.tgz   dg/deep_gemm: DeepGEMM's last Python-JIT release (deepseek-ai/DeepGEMM at 03d0be3, 2025-07-02),
#                   with CUTLASS's include/cute and include/cutlass (NVIDIA/cutlass at eefa171, the submodule
#                   commit that DeepGEMM pins) copied into dg/deep_gemm/include/
#   .peers/whl/     what it imports that the image lacks: cuda-bindings 13.x (NVRTC, the driver API), cuda-pathfinder
# It compiles its kernels at first use with nvcc, into /tmp/deepgemm-jit (its NVRTC path, DG_JIT_USE_NVRTC=1, failed to
# compile under the image's CUDA 13.0 NVRTC: NVRTC_ERROR_COMPILATION).
if [ -f .peers/dg.tgz ]; then
  mkdir -p /tmp/deepgemm && tar xzf .peers/dg.tgz -C /tmp/deepgemm || echo "could not unpack .peers/dg.tgz"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-dg \
    .peers/whl/*.whl || echo "the wheels of .peers/whl did not install"
  export PYTHONPATH=/tmp/deepgemm/dg:/tmp/site-dg:$PYTHONPATH
  export DG_JIT_USE_NVRTC=${DG_JIT_USE_NVRTC:-0} DG_JIT_CACHE_DIR=/tmp/deepgemm-jit
  export DEEPGEMM_SOURCE="deepseek-ai/DeepGEMM@03d0be3 (Python JIT), CUTLASS@eefa171, JIT by $([ "$DG_JIT_USE_NVRTC" = 1 ] && echo NVRTC || echo nvcc)"
  if ! command -v nvcc >/dev/null && [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
    export CUDA_HOME=/usr/local/cuda
  fi
  python3 -c 'import deep_gemm' 2>&1 | tail -1 && echo "DeepGEMM: $DEEPGEMM_SOURCE"
else
  echo "no .peers/dg.tgz: DeepGEMM is left out"
fi
