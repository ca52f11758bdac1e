#!/usr/bin/env bash
# DeepSpeed's JIT-built ops across GPU machines: a fresh machine builds fused_adam (~35 s) before the first ZeRO run of
# every call, out of the call's device time. One call saves the build, the next calls restore it.
#
#   bash benchmarks/gpu_ops_cache.sh save "$OUT"   # at the end of a call that built them: $OUT/ds-ops-<key>.tar.gz
#   # copy that file into .whl/ here (carried with the wheelhouse; .whl/ is git-ignored)
#   bash benchmarks/gpu_ops_cache.sh restore       # gpu_env.sh runs this: unpacks .whl/ds-ops-<key>.tar.gz if present
#
# <key> names what a build depends on (Python, torch, DeepSpeed, the GPU's compute capability): another image or GPU
# finds no file and builds as before. torch's loader runs ninja on every first load in a process, and ninja rebuilds
# whatever is older than its sources; the wheelhouse installs DeepSpeed's sources anew on each machine, so restore
# dates those sources back (2000-01-01) rather than the objects forward, which would void ninja's deps log. A
# changed flag still rebuilds (ninja's command log). Ops: OPS (default fused_adam; cpu_adam, ~60 s to build for the
# offload strategies, is 14 MB compressed: add it where the 64 MiB carry has room).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHL="${WHL:-$ROOT/.whl}"
OPS="${OPS:-fused_adam}"
BUILD_ROOT="${TORCH_EXTENSIONS_DIR:-$(python3 -c 'from torch.utils.cpp_extension import get_default_build_root as r; print(r())')}"

key() {
  local py torch ds cap
  py="$(python3 -c 'import sys; print(f"py{sys.version_info[0]}{sys.version_info[1]}")')"
  torch="$(python3 -c 'import importlib.metadata as m; print(m.version("torch"))')"
  ds="$(python3 -c 'import importlib.metadata as m; print(m.version("deepspeed"))')"
  cap="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d '.' || true)"
  echo "${py}-torch${torch}-ds${ds}-sm${cap:-cpu}" | tr '+' '_'
}

case "${1:-}" in
  save)
    dest="${2:?usage: gpu_ops_cache.sh save DIR}"
    out="$dest/ds-ops-$(key).tar.gz"
    dirs=()
    [[ -d "$BUILD_ROOT" ]] || { echo "gpu_ops_cache: nothing built under $BUILD_ROOT"; exit 0; }
    for op in $OPS; do
      # torch's default root has a per-Python/CUDA subfolder (py312_cu130/<op>); TORCH_EXTENSIONS_DIR has <op> directly
      found="$(cd "$BUILD_ROOT" && find . -maxdepth 2 -type d -name "$op" | head -1)"
      [[ -n "$found" && -n "$(ls "$BUILD_ROOT/$found"/*.so 2>/dev/null)" ]] && dirs+=("${found#./}")
    done
    if (( ${#dirs[@]} == 0 )); then echo "gpu_ops_cache: no built $OPS under $BUILD_ROOT"; exit 0; fi
    tar -czf "$out" -C "$BUILD_ROOT" --exclude=lock "${dirs[@]}"
    echo "gpu_ops_cache: saved ${dirs[*]} ($(du -h "$out" | cut -f1)) to $out"
    ;;
  restore)
    file="$WHL/ds-ops-$(key).tar.gz"
    if [[ ! -f "$file" ]]; then echo "gpu_ops_cache: no $(basename "$file") in $WHL: ops build when first needed"; exit 0; fi
    mkdir -p "$BUILD_ROOT"
    tar -xzf "$file" -C "$BUILD_ROOT"  # the objects keep their build times, which ninja's deps log recorded
    # the sources the wheelhouse just installed (new times) dated before those builds; headers come with the image
    csrc="${DS_CSRC:-$(python3 -c 'import importlib.util as u, os; print(os.path.join(os.path.dirname(u.find_spec("deepspeed").origin), "ops", "csrc"))')}"
    find "$csrc" -type f -exec touch -d "2000-01-01" {} +
    echo "gpu_ops_cache: restored $(basename "$file") into $BUILD_ROOT"
    ;;
  *) echo "usage: gpu_ops_cache.sh save DIR | restore" >&2; exit 2 ;;
esac
