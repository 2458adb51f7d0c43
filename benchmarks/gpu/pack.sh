#!/usr/bin/env bash
# Build what travels to a GPU machine (run HERE, where PyPI is reachable; the GPU machine reaches nothing).
#
# What: gpu_pack/ (ignored by git, < 60 MiB) holds
#   wheels/   cp312 manylinux x86_64 wheels of the packages the GPU image lacks (pyzmq, pydantic, pydantic-core
#             and their two helpers, structlog, math-verify with latex2sympy2_extended and antlr4, gguf,
#             zstandard), at the versions installed here, so the GPU runs what CI runs;
#   smollm2/  SmolLM2-135M-Instruct's config.json and tokenizer files (no weights: stages b, c, d build a
#             model of SmolLM2's exact config with random weights on the GPU machine, which changes no
#             timing; benchmarks/gpu/random_model.py);
#   tiny-random-llama/  the tests' tiny model (16 MB), built here: building it needs the SmolLM2 GGUF's
#             tokenizer, which the GPU machine lacks, and the gpu-marked tests use it (run.sh puts it in the
#             model cache there).
# The real weights (the 92 MB GGUF, needed only by stages e and f, which learn) do not fit the 64 MiB one
# command carries, so `--with-model` also writes the GGUF in two halves, gpu_model_a/ and gpu_model_b/, each
# carried by its own command; `run.sh model-a` and `run.sh model-b` join them there (docs/gpu.md).
# Why a script: the wheel list, the platform tags and the size limit live in one place.
#
#   bash benchmarks/gpu/pack.sh [--with-model]
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
PACK="$ROOT/gpu_pack"
LIMIT_MIB=60
WITH_MODEL=0
for arg in "$@"; do
  case "$arg" in
    --with-model) WITH_MODEL=1 ;;
    *) echo "pack.sh: unknown argument $arg (usage: bash benchmarks/gpu/pack.sh [--with-model])" >&2; exit 2 ;;
  esac
done
PYTHON="${PYTHON:-python}"
# What the GPU image lacks (/work/.library/device/KINDS.md lists what it has), with their own needs.
PKGS=(pyzmq pydantic pydantic_core annotated-types typing-inspection structlog math-verify
      latex2sympy2_extended antlr4-python3-runtime gguf zstandard)

rm -rf "$PACK" && mkdir -p "$PACK/wheels" "$PACK/smollm2"
specs=$("$PYTHON" - "${PKGS[@]}" <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, version
for name in sys.argv[1:]:
    try:
        print(f"{name}=={version(name)}")
    except PackageNotFoundError:
        sys.exit(f"pack.sh: {name} is not installed here; pip install -e . first (its version is the one packed)")
PY
)
echo "pack.sh: downloading cp312 manylinux x86_64 wheels: $(echo $specs | tr '\n' ' ')"
# shellcheck disable=SC2086
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$PACK/wheels" $specs

"$PYTHON" - "$PACK/smollm2" <<'PY'
import shutil, sys
from pathlib import Path
from areal_mq.engines.models import TOKENIZER_FILES, resolve_model
src, dst = resolve_model("smollm2-135m-instruct"), Path(sys.argv[1])
names = ["config.json", "generation_config.json", "special_tokens_map.json", "chat_template.jinja", *TOKENIZER_FILES]
copied = [n for n in dict.fromkeys(names) if (src / n).is_file() and shutil.copy2(src / n, dst / n)]
print(f"pack.sh: SmolLM2 config + tokenizer ({', '.join(copied)}) from {src}")
tiny = resolve_model("tiny-random-llama")
shutil.copytree(tiny, dst.parent / "tiny-random-llama")
print(f"pack.sh: the tests' tiny model from {tiny}")
PY

if [ "$WITH_MODEL" = 1 ]; then
  GGUF=$("$PYTHON" -c "from areal_mq.engines.models import gguf_path; print(gguf_path())")
  rm -rf "$ROOT/gpu_model_a" "$ROOT/gpu_model_b" && mkdir -p "$ROOT/gpu_model_a" "$ROOT/gpu_model_b"
  size=$(stat -c %s "$GGUF"); half=$(( (size + 1) / 2 ))
  head -c "$half" "$GGUF" > "$ROOT/gpu_model_a/gguf.part"
  tail -c +"$(( half + 1 ))" "$GGUF" > "$ROOT/gpu_model_b/gguf.part"
  sum=$(sha256sum "$GGUF" | cut -d' ' -f1)
  for h in a b; do echo "$sum  $(basename "$GGUF")" > "$ROOT/gpu_model_$h/SHA256"; done
  echo "pack.sh: GGUF halves: $(du -sh "$ROOT/gpu_model_a" | cut -f1) + $(du -sh "$ROOT/gpu_model_b" | cut -f1) (sha256 $sum)"
fi

bytes=$(du -sb "$PACK" | cut -f1)
mib=$(( (bytes + 1048575) / 1048576 ))
echo "pack.sh: $PACK is $mib MiB ($bytes bytes; $(ls "$PACK/wheels" | wc -l) wheels)"
if [ "$mib" -gt "$LIMIT_MIB" ]; then
  echo "pack.sh: over the $LIMIT_MIB MiB budget (64 MiB travel with one command, the repo included)" >&2
  exit 1
fi
