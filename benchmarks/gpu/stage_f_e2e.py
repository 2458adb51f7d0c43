"""Stage f: end-to-end asynchronous vs synchronous RL on one device (benchmarks/speed/e2e.py --device).

What: runs benchmarks/speed/e2e.py (sync, async η=2, async η=4, sync again on configs/quickstart.yaml's task, the
same samples each; see its docstring) with --device, sized to fit one 10-minute GPU command (10 steps per
mode, the last version evaluated on 50 held-out problems; --quick: the tiny random Llama as e2e.py --quick;
--quick on the CPU, CI's smoke run: only sync and async η=2 (`--modes sync,async_eta2`: η=4 and the second sync
run the same code again, ~30 s a whole-system run), 2 steps each, v2 evaluated), and stores its report as
OUT/stage_f.json with its table in results.md.
Target (issue 25): async/sync samples/s >= 1.5 on one GPU. Needs the real SmolLM2 weights unless --quick
(run.sh model-a / model-b, docs/gpu.md).

    python benchmarks/gpu/stage_f_e2e.py [--device cuda] [--quick] [--out DIR] [--work DIR]
"""
from __future__ import annotations

import json
import subprocess
import sys

import report
from report import common

import e2e_report  # benchmarks/speed/e2e_report.py: the e2e table

FULL = ["--steps", "10", "--eval-n", "50", "--eval-versions", "10"]
# the CPU smoke: the smallest run that proves the code path (issue 58), pinned like FULL: one sync and one async
# run of 2 steps (the throughput window needs two), the last version evaluated as on the GPU
QUICK_CPU = ["--quick", "--steps", "2", "--eval-versions", "2", "--modes", "sync,async_eta2"]
TIMEOUT_S = {True: 900, False: 570}


def main() -> None:
    args = report.parse(__doc__)
    json_path = args.work / "e2e.json"
    json_path.unlink(missing_ok=True)
    cmd = [sys.executable, str(report.HERE.parent / "speed" / "e2e.py"), "--device", args.device, "--json", str(json_path),
           "--out", str(args.work / "e2e"), "--plot", str(args.out / "stage_f_accuracy.png"),
           *(QUICK_CPU if report.cpu_smoke(args) else ["--quick"] if args.quick else FULL)]
    common.logger("gpu-f")(" ".join(cmd[1:]))
    rc = subprocess.run(cmd, cwd=report.ROOT, timeout=TIMEOUT_S[args.quick]).returncode
    if rc != 0 or not json_path.is_file():
        raise SystemExit(f"stage f: benchmarks/speed/e2e.py exited {rc} without a report ({json_path})")
    r = json.loads(json_path.read_text())
    r.update(title="e2e async vs sync", machine={**r["machine"], "device": common.device_name(args.device)})
    report.write(args.out, "f", r, "```\n" + e2e_report.table(r, " ".join(["python", *cmd[1:]])) + "\n```")


if __name__ == "__main__":
    main()
