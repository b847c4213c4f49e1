#!/usr/bin/env bash
# Build TransformerEngine's PyTorch extension into a wheel for the torch and CUDA of the machine it
# runs on (a GPU machine: its extension is compiled against that torch build, so it is a source
# package on PyPI), without network access once the inputs are on disk:
#   bash scripts/build_te.sh SDIST WHEEL_DIR
#     SDIST      transformer_engine_torch-2.20.2.tar.gz (`pip download --no-deps transformer_engine_torch==2.20.2`)
#     WHEEL_DIR  where the wheel is written; install it with the two wheels it needs beside it:
#                transformer_engine-2.20.2 (py3-none-any) and transformer_engine_cu13-2.20.2 (the prebuilt core)
# Needs: torch with CUDA 13, the CUDA toolkit's headers (CUDA_HOME, or nvcc on PATH), and NCCL's and
# cuDNN's headers, which the nvidia-* wheels that come with torch carry. About 2-3 minutes on 16 cores.
set -euo pipefail
sdist=$(realpath "$1")
mkdir -p "$2"
out=$(realpath "$2")
# the extension's sources include nccl.h and cudnn.h, which the CUDA toolkit does not carry: take
# the headers of every nvidia-* wheel in torch's environment (nvidia/<name>/include)
nvidia_includes=$(python3 - <<'EOF'
import pathlib, nvidia
roots = [pathlib.Path(p) for p in nvidia.__path__]
print(":".join(str(d) for r in roots for d in sorted(r.glob("*/include")) + sorted(r.glob("cu*/include"))))
EOF
)
export CPLUS_INCLUDE_PATH=$nvidia_includes${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}
# build from the sources: its setup would otherwise first try to download a prebuilt wheel
export NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_FRAMEWORK=pytorch MAX_JOBS=${MAX_JOBS:-$(nproc)}
start=$(date +%s)
python3 -m pip wheel --no-build-isolation --no-deps --no-cache-dir -w "$out" "$sdist"
echo "build_te: $(ls "$out"/transformer_engine_torch-*.whl) in $(( $(date +%s) - start )) s"
