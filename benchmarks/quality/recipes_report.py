"""Which recipe learns (issue 60 item 4): the recipes' runs of benchmarks/results/quality.jsonl against GRPO's, a
table, a plot and a JSON summary. Reads only: the runs are quality.py's (`--modes gspo_eta2,dapo_eta2,...`).

What: for every recipe mode of quality.py (`RECIPES`) with finished v50 runs on the 1,100 held-out problems: v50 strict
accuracy per seed, its gap to GRPO's run of the same seed (async_eta2, the quickstart's default) and to GRPO's mean
over all its seeds (6 seeds, 43.2 %), the first and last steps' entropy, the steps' largest clip fraction and the
seconds a version took on this machine (training wall time to v50 / 50: generation, reward and training together,
noisy on a shared 2-core machine). pass@k at temperature 1.0 joins the table from `--passk-dir`: one
`areal-mq eval --samples 8 --temperature 1.0 --k 1,8 --json` output a kept run's final weights, named
MODE-seedS.json (base.json: the base model; grpo_rerun-seedS.json: GRPO's rerun), averaged over a mode's seeds. `--rerun FILE`: GRPO runs again on
today's code (a results file of its own, so they neither replace nor join the six it is compared with). The plot:
every seed's v50 strict accuracy per recipe, GRPO's seeds beside them, GRPO's mean and its ±5-point band (the
issue's target); with pass@k measured, a second panel of pass@1 and pass@8 per recipe.

    python benchmarks/quality/recipes_report.py [--results benchmarks/results/quality.jsonl] [--plot PNG] [--json PATH]
        [--passk-dir benchmarks/results/passk] [--rerun benchmarks/results/grpo_rerun.jsonl]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
import common  # noqa: E402
import quality  # noqa: E402  (benchmarks/quality/, on sys.path through common)
import quality_report  # noqa: E402

BASE = "async_eta2"
RERUN = "grpo_rerun"  # pass@k of GRPO's rerun weights: benchmarks/results/passk/grpo_rerun-seedS.json
TARGET_POINTS = 5.0  # issue 60: every recipe within 5 points of GRPO at v50


def final(run: dict) -> float | None:
    """Strict accuracy at the run's last version, in %."""
    last = [e for e in run["evals"] if e["version"] == run["versions"]]
    return 100.0 * last[0]["strict"] if last else None


def summary(runs: list[dict], versions: int, eval_n: int) -> dict:
    """Per mode (GRPO and each recipe): seeds, v50 strict per seed, mean, gap to GRPO, entropy, clip, s a version."""
    keep = [r for r in runs if r["versions"] == versions and r["eval_n"] == eval_n and not r["quick"]
            and r["mode"] in {BASE, *quality.RECIPES}]
    by_mode: dict[str, list[dict]] = {}
    for r in keep:
        by_mode.setdefault(r["mode"], []).append(r)
    base_by_seed = {r["seed"]: final(r) for r in by_mode.get(BASE, [])}
    base_all = [v for v in base_by_seed.values() if v is not None]
    base_mean = sum(base_all) / len(base_all) if base_all else None
    out = {}
    for mode, rs in by_mode.items():
        rs = sorted(rs, key=lambda r: r["seed"])
        acc = {r["seed"]: final(r) for r in rs}
        mean = sum(acc.values()) / len(acc)
        paired = [acc[s] - base_by_seed[s] for s in acc if s in base_by_seed]
        ent = [(r["per_step"]["entropy"][0], r["per_step"]["entropy"][-1]) for r in rs]
        clips = [max((c or 0.0) for c in r["per_step"]["clip_frac"]) for r in rs]
        per_version = [e["t_s"] / r["versions"] for r in rs for e in r["evals"] if e["version"] == r["versions"]]
        out[mode] = {
            "label": quality.MODES[mode][0] if mode in quality.MODES else mode, "seeds": sorted(acc),
            "strict_v50": acc, "mean": round(mean, 2),
            "gap_to_grpo_mean": None if base_mean is None else round(mean - base_mean, 2),
            "gap_to_grpo_same_seed": [round(p, 2) for p in paired],
            "within_target": None if base_mean is None else abs(mean - base_mean) <= TARGET_POINTS,
            "entropy_first_last": [[round(a, 3), round(b, 3)] for a, b in ent], "clip_frac_max": clips,
            "s_per_version": [round(s, 1) for s in per_version], "dates": [r["date"] for r in rs],
        }
    return {"versions": versions, "eval_n": eval_n, "grpo_mean": None if base_mean is None else round(base_mean, 2),
            "grpo_seeds": len(base_all), "target_points": TARGET_POINTS, "modes": out}


def read_passk(folder: Path | None) -> dict:
    """{mode: {"pass@1", "pass@8", "n", "seeds", "truncated"}}: the strict pass@1 and pass@8 of every
    `areal-mq eval --json` output in `folder` (MODE-seedS.json; base.json is the base model, mode "base"), averaged
    over a mode's seeds; n is the problems of one evaluation. Outputs of different sizes or k are refused."""
    if folder is None or not folder.is_dir():
        return {}
    found: dict[str, list[tuple[int, dict]]] = {}
    for f in sorted(folder.glob("*.json")):
        mode, _, seed = f.stem.rpartition("-seed")
        mode, seed = (mode, int(seed)) if mode else (f.stem, 0)
        found.setdefault(mode, []).append((seed, json.loads(f.read_text())))
    out = {}
    for mode, evals in found.items():
        pk = [e["pass_at_k"] for _, e in evals]
        if len({p["n"] for p in pk}) != 1 or any("8" not in p["pass@k_strict"] for p in pk):
            raise SystemExit(f"{folder}: {mode}'s evaluations differ in size or lack pass@8: {[p['n'] for p in pk]}")
        out[mode] = {"pass@1": sum(p["pass@k_strict"]["1"] for p in pk) / len(pk),
                     "pass@8": sum(p["pass@k_strict"]["8"] for p in pk) / len(pk), "n": pk[0]["n"],
                     "seeds": sorted(s for s, _ in evals),
                     "truncated": sum(e.get("truncated", 0.0) for _, e in evals) / len(evals)}
    return out


def reruns(runs: list[dict], versions: int, eval_n: int) -> dict:
    """{seed: v50 strict %} of GRPO's runs in a rerun results file."""
    return {r["seed"]: final(r) for r in runs if r["mode"] == BASE and r["versions"] == versions
            and r["eval_n"] == eval_n and not r["quick"] and final(r) is not None}


def passk_cell(pk: dict | None) -> str:
    """The table's pass@1 / pass@8 cell of one `read_passk` entry ("-" when not measured)."""
    return "-" if not pk else f"{100 * pk['pass@1']:.1f} / {100 * pk['pass@8']:.1f} (n={pk['n']})"


def table(s: dict, passk: dict) -> str:
    rows = [("recipe", "seeds", "v50 strict per seed", "mean", "vs GRPO mean", "vs GRPO same seed", "entropy first→last",
             "max clip", "s/version", "pass@1 / pass@8 (T=1)")]
    order = [BASE, *[m for m in quality.RECIPES if m in s["modes"]]]
    for mode in order:
        m = s["modes"].get(mode)
        if m is None:
            continue
        pk = passk.get(mode)
        rows.append((
            "GRPO (the quickstart)" if mode == BASE else m["label"], ",".join(map(str, m["seeds"])),
            " ".join(f"{v:.1f}" for v in m["strict_v50"].values()), f"{m['mean']:.1f}",
            "-" if mode == BASE or m["gap_to_grpo_mean"] is None else f"{m['gap_to_grpo_mean']:+.1f}",
            "-" if mode == BASE else " ".join(f"{g:+.1f}" for g in m["gap_to_grpo_same_seed"]),
            " ".join(f"{a:.2f}→{b:.2f}" for a, b in m["entropy_first_last"][:2]),
            f"{max(m['clip_frac_max']):.3f}", " ".join(f"{x:.0f}" for x in m["s_per_version"][:3]),
            passk_cell(pk)))
    if s.get("grpo_rerun") or RERUN in passk:
        pk = passk.get(RERUN)
        rows.append(("GRPO rerun on today's code", ",".join(map(str, s.get("grpo_rerun") or {})),
                     " ".join(f"{v:.1f}" for v in (s.get("grpo_rerun") or {}).values()), "", "", "", "", "", "",
                     passk_cell(pk)))
    if "base" in passk:
        rows.append(("base model (v0)", "", "", "", "", "", "", "", "", passk_cell(passk["base"])))
    return "\n".join(common.align(rows))


def plot(s: dict, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = [BASE, *[m for m in quality.RECIPES if m in s["modes"]]]
    passk = s.get("passk") or {}
    if passk:
        fig, (ax, bx) = plt.subplots(1, 2, figsize=(14, 4.6), gridspec_kw={"width_ratios": [3, 2]})
    else:
        fig, ax = plt.subplots(figsize=(9, 4.2))
    if s["grpo_mean"] is not None:
        ax.axhspan(s["grpo_mean"] - TARGET_POINTS, s["grpo_mean"] + TARGET_POINTS, color="tab:green", alpha=0.12,
                   label=f"GRPO mean ± {TARGET_POINTS:.0f} points (the target)")
        ax.axhline(s["grpo_mean"], color="tab:green", lw=1)
    for x, mode in enumerate(order):
        m = s["modes"][mode]
        ys = list(m["strict_v50"].values())
        ax.scatter([x] * len(ys), ys, color="tab:blue" if mode != BASE else "tab:green", zorder=3)
        ax.plot([x - 0.25, x + 0.25], [m["mean"]] * 2, color="black", lw=2)
    if s.get("grpo_rerun"):
        ys = list(s["grpo_rerun"].values())
        ax.scatter([0.15] * len(ys), ys, facecolors="none", edgecolors="tab:red", zorder=3,
                   label="GRPO rerun on today's code")
    ax.axhline(20.5, color="gray", ls="--", lw=1, label="base model (v0) 20.5 %")
    ax.set_xticks(range(len(order)))
    ax.set_xticklabels(["GRPO" if m == BASE else m.replace("_eta2", "") for m in order])
    ax.set_ylabel(f"held-out strict accuracy at v{s['versions']} (%)")
    ax.set_title(f"Recipes on the quickstart's task: v{s['versions']}, n = {s['eval_n']} per evaluation, "
                 "one dot a seed, bar = mean")
    ax.legend(loc="lower right", fontsize=8)
    if passk:
        names = [m for m in ["base", RERUN, *order] if m in passk]
        xs = range(len(names))
        bx.bar([x - 0.2 for x in xs], [100 * passk[m]["pass@1"] for m in names], 0.4, label="pass@1")
        bx.bar([x + 0.2 for x in xs], [100 * passk[m]["pass@8"] for m in names], 0.4, label="pass@8")
        bx.set_xticks(list(xs))
        bx.set_xticklabels([{BASE: "GRPO", RERUN: "GRPO\n(rerun)"}.get(m, m.replace("_eta2", "")) for m in names])
        bx.set_ylabel("strict accuracy (%)")
        bx.set_title(f"temperature 1.0, 8 answers a problem, n = {passk[names[0]]['n']}", fontsize=10)
        bx.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=quality.RESULTS)
    parser.add_argument("--versions", type=int, default=50)
    parser.add_argument("--eval-n", type=int, default=1100)
    parser.add_argument("--passk-dir", type=Path, default=Path("benchmarks/results/passk"),
                        help="areal-mq eval --json outputs, MODE-seedS.json (base.json: the base model).")
    parser.add_argument("--rerun", type=Path, help="A results file of GRPO runs again on today's code.")
    parser.add_argument("--plot", type=Path, default=Path("docs/recipes.png"))
    parser.add_argument("--json", type=Path, help="Write the summary here.")
    args = parser.parse_args()
    s = summary(quality_report.read_jsonl(args.results), args.versions, args.eval_n)
    if not s["modes"]:
        raise SystemExit(f"{args.results}: no v{args.versions} runs of GRPO or a recipe")
    passk = read_passk(args.passk_dir)
    s["passk"] = passk
    if args.rerun:
        s["grpo_rerun"] = reruns(quality_report.read_jsonl(args.rerun), args.versions, args.eval_n)
    s["plot"] = str(plot(s, args.plot))
    common.save(s, args.json)
    print(table(s, passk))
    print(f"GRPO mean over {s['grpo_seeds']} seeds: {s['grpo_mean']} %; plot {s['plot']}")
    print(common.command("recipes_report.py"))


if __name__ == "__main__":
    main()
