# The GPU environment of the benchmark shell scripts (benchmarks/*/*.sh), sourced from the repository root
# after the script has set OUT (its output folder):
#   - everything the script prints also goes to $OUT/log.txt;
#   - wheels in .whl/, when there (a GPU host without a package index), are installed into /tmp/site;
#   - PYTHONPATH is the repository root (and /tmp/site), NVLink multicast is off for NCCL;
#   - W: the work folder (artifacts; default /tmp/w), C: where a synthetic checkpoint is written (default
#     /dev/shm/ckpt: a 31 GB V2-Lite checkpoint in memory, removed once compiled);
#   - `stamp MSG` prints MSG after the seconds since the start.
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # no NVLink multicast
W=${W:-/tmp/w}; C=${C:-/dev/shm/ckpt}; mkdir -p "$W"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' 2>/dev/null
git log --oneline -1 2>/dev/null
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
