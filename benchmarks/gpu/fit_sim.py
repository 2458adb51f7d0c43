"""Fit the simulator's `h100-measured` timing slot from the GPU stages' JSON (issue 25 item 9).

What: reads stage b (decode step time over batch x context, prefill rate), stage c (train step time over
tokens) and stage d (the engine's pause for a weight update) and writes a JSON timing model that
areal_mq/sim/timing.py loads into its `h100-measured` slot (areal_mq/sim/h100_measured.json with --install):
  decode step  = decode_fixed_s + batch * context * kv_bytes_per_token / mem_bw   (least squares in batch x
                 context; the intercept holds everything that does not grow with the KV read — the weights'
                 read, kernel launches, sampling — so weight_bytes is 0 and mem_bw is the effective KV rate)
  prefill      = 1 / (stage b's prefill tokens/s) per token
  update pause = the smallest engine pause (load + resume) of the publish modes stage d measured (named)
  train step   = train_fixed_s + tokens * train_s_per_token   (least squares over stage c's scaling points)
Each fit is named by the model and the GPU measured, and its source line says where every number came from.
Why: the simulator's timing models must be measured or derived, never invented (areal_mq/sim/timing.py);
this turns one GPU run into the measured one.
--install refuses a fit from anything but an H100 (the slot's name promises one); --out writes anywhere.

    python benchmarks/gpu/fit_sim.py B.json C.json D.json --out sim_timing.json [--install]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

SLOT = "h100-measured"
INSTALL = Path(__file__).resolve().parents[2] / "areal_mq" / "sim" / "h100_measured.json"


class FitError(ValueError):
    """A stage's JSON lacks what the fit needs (says which file, which field, and what to run)."""


def need(report: dict, key: str, path: str, stage: str):
    if key not in report:
        raise FitError(f"{path}: no {key!r}; expected stage {stage}'s JSON (bash benchmarks/gpu/run.sh {stage})")
    return report[key]


def line(x: list[float], y: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope); one distinct x: (mean y, 0)."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    if len(set(x.tolist())) < 2:
        return float(y.mean()), 0.0
    slope, intercept = np.polyfit(x, y, 1)
    return float(intercept), float(slope)


def fit(b: dict, c: dict, d: dict, paths: tuple[str, str, str] = ("b", "c", "d")) -> dict:
    """The slot's fields (TimingModel's) plus name, model, device and source, from the three stages' reports."""
    model = need(b, "model", paths[0], "b")
    sweep = need(b, "decode_sweep", paths[0], "b")
    if len(sweep) < 2:
        raise FitError(f"{paths[0]}: decode_sweep has {len(sweep)} point(s); the fit needs >= 2")
    fixed, per_ctx = line([p["batch"] * p["context"] for p in sweep], [p["step_s"] for p in sweep])
    kv = float(model["kv_bytes_per_token"])
    prefill_tps = float(need(b, "prefill_tokens_per_s", paths[0], "b"))
    scaling = need(c, "train_scaling", paths[1], "c")
    train_fixed, train_per_token = line([p["tokens"] for p in scaling], [p["step_s"] for p in scaling])
    measured = [u for u in need(d, "updates", paths[2], "d") if "engine_pause_s" in u]
    if not measured:
        raise FitError(f"{paths[2]}: no update with engine_pause_s; run stage d")
    update = min(measured, key=lambda u: u["engine_pause_s"])
    device = b.get("machine", {}).get("device", "?")
    name = f"{model['name']}-{gpu_tag(device)}-measured"
    return {
        "slot": SLOT, "name": name, "model": model["name"], "device": device,
        "source": f"measured: {model['name']} ({model.get('weights', '')}) on {device}, benchmarks/gpu stages b, c, "
                  f"d fitted by benchmarks/gpu/fit_sim.py; decode fit over {len(sweep)} (batch, context) points, "
                  f"weights' read folded into decode_fixed_s; update pause = {update['mode']} engine pause; "
                  f"train fit over {len(scaling)} step sizes at precision {c.get('precision', '?')}",
        "decode_fixed_s": max(0.0, fixed), "weight_bytes": 0.0, "kv_bytes_per_token": kv,
        "mem_bw_bytes_per_s": kv / per_ctx if per_ctx > 0 else 0.0,
        "prefill_s_per_token": 1.0 / prefill_tps if prefill_tps > 0 else 0.0,
        "update_pause_s": float(update["engine_pause_s"]),
        "train_fixed_s": max(0.0, train_fixed), "train_s_per_token": max(0.0, train_per_token),
    }


def gpu_tag(device: str) -> str:
    """'cuda:0 (NVIDIA H100 80GB HBM3)' -> 'h100'; 'cpu' -> 'cpu'."""
    text = device.lower()
    for tag in ("h200", "h100", "a100", "l40s"):
        if tag in text:
            return tag
    return "cpu" if text.startswith("cpu") else "gpu"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("b", type=Path, help="stage_b.json")
    parser.add_argument("c", type=Path, help="stage_c.json")
    parser.add_argument("d", type=Path, help="stage_d.json")
    parser.add_argument("--out", type=Path, help="Write the fit here.")
    parser.add_argument("--install", action="store_true", help=f"Also write {INSTALL} (the slot; H100 fits only).")
    args = parser.parse_args(argv)
    try:
        reports = [json.loads(p.read_text()) for p in (args.b, args.c, args.d)]
        result = fit(*reports, paths=(str(args.b), str(args.c), str(args.d)))
    except (OSError, json.JSONDecodeError, FitError, KeyError, TypeError) as exc:
        print(f"fit_sim: {exc}", file=sys.stderr)
        return 2
    if args.install and gpu_tag(result["device"]) != "h100":
        print(f"fit_sim: refusing --install: measured on {result['device']}, not an H100 (use --out)", file=sys.stderr)
        return 2
    text = json.dumps(result, indent=1)
    for path in [args.out] + ([INSTALL] if args.install else []):
        if path:
            path.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
