"""bench_model.py on two or more versions of the code, run after run in alternation in one process tree on one GPU:
the comparison that holds on lent machines, where the same code measured ~1.5% apart on two H100s (27B IQ4_XS
batch-1 decode, benchmarks/RESULTS.md session 43) while the changes measured are often smaller.

    python3 benchmarks/ab_model.py --tree base=ab/base --tree new=. --weights IQ4_XS --batches 1 --seconds 330

A tree is a folder laid over a copy of this checkout's code (CODE): "." is the checkout as it is, and a folder that
holds only some files at their paths (e.g. ab/base/pallas_kernels/quant_gemv_int8.py, taken from `git show
HEAD:...`) is the checkout with those files replaced. Each tree's runs keep their own XLA compile cache, so its
second run skips the compiles. Runs go tree by tree, round after round, until the next would end past --seconds
(judged by the longest run so far); each run's figures, each tree's medians and their ratios to the first tree's
are printed last (and written to --json).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
CODE = ("luxjax", "pallas_kernels", "benchmarks", "server.py", "pyproject.toml")


def prepare_tree(overlay: Path, into: Path) -> Path:
    """A copy of the checkout's CODE with the files under `overlay` laid over it (none when overlay is the root)."""
    into.mkdir(parents=True)
    for name in CODE:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, into / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, into / name)
    if overlay.resolve() != ROOT:
        shutil.copytree(overlay, into, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    return into


def run_once(tree: Path, cache: Path, bench_args: list[str], timeout: float) -> dict:
    """One bench_model.py run in `tree`: its luxjax figures (numbers only), and `error` where it failed."""
    out = tree / "ab_run.json"
    out.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH")) if p))
    cmd = [sys.executable, "benchmarks/bench_model.py", *bench_args, "--compile-cache", str(cache), "--json", str(out)]
    try:
        done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"ran past {timeout:.0f} s"}
    if done.returncode or not out.exists():
        return {"error": f"exit {done.returncode}: " + " | ".join(done.stderr.strip().splitlines()[-3:])}
    figures = json.loads(out.read_text())["luxjax"]
    return {k: v for k, v in figures.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def alternate(trees: dict[str, Path], bench_args: list[str], seconds: float, run_timeout: float) -> list[dict]:
    """Runs of each tree in turn until the next one would end past `seconds` from now."""
    deadline, longest, runs = time.time() + seconds, 0.0, []
    with tempfile.TemporaryDirectory(prefix="ab_caches_") as caches, tqdm(desc="runs", unit="run") as bar:
        while True:
            for name, tree in trees.items():
                if time.time() + longest > deadline:
                    return runs
                start = time.time()
                figures = run_once(tree, Path(caches) / name, bench_args, min(run_timeout, deadline - start))
                elapsed = time.time() - start
                longest = max(longest, elapsed)
                runs.append({"tree": name, "seconds": round(elapsed, 1), **figures})
                bar.update()
                bar.write(json.dumps(runs[-1]))


def summary(runs: list[dict], trees: list[str]) -> dict[str, dict[str, float]]:
    """{tree: {figure: median over its successful runs}}."""
    medians = {}
    for name in trees:
        ok = [r for r in runs if r["tree"] == name and "error" not in r]
        keys = sorted({k for r in ok for k in r} - {"tree", "seconds"})
        medians[name] = {k: statistics.median(r[k] for r in ok if k in r) for k in keys}
    return medians


def print_tables(runs: list[dict], medians: dict[str, dict[str, float]]) -> None:
    """Every run's figures (or its error), then each tree's medians with their ratios to the first tree's."""
    keys = sorted({k for m in medians.values() for k in m})
    if not keys:
        print("\nno run gave figures: " + ("; ".join(f"{r['tree']} {r['error']}" for r in runs) or "none ran"))
        return
    print("\n| tree | run s | " + " | ".join(keys) + " |\n|" + "---|" * (len(keys) + 2))
    for r in runs:
        cells = [r["error"]] if "error" in r else [f"{r[k]:.4g}" if k in r else "" for k in keys]
        print(f"| {r['tree']} | {r['seconds']} | " + " | ".join(cells) + " |")
    first = next(iter(medians.values()))
    print("\n| tree (median) | " + " | ".join(keys) + " |\n|" + "---|" * (len(keys) + 1))
    for name, m in medians.items():
        cells = [f"{m[k]:.4g}" + (f" ({m[k] / first[k]:.4f})" if first.get(k) else "") if k in m else ""
                 for k in keys]
        print(f"| {name} | " + (" | ".join(cells) if m else "no run gave figures") + " |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", required=True, metavar="NAME=FOLDER",
                    help="a version of the code: FOLDER laid over the checkout (module doc); give two or more")
    ap.add_argument("--seconds", type=float, default=330, help="stop starting runs that would end past this")
    ap.add_argument("--run-timeout", type=float, default=300)
    ap.add_argument("--config", default="qwen35-27b")
    ap.add_argument("--weights", default="IQ4_XS")
    ap.add_argument("--batches", default="1")
    ap.add_argument("--decode-steps", default="64")
    ap.add_argument("--json", help="write every run and the medians here")
    args = ap.parse_args()
    named = dict(spec.split("=", 1) for spec in args.tree if "=" in spec)
    if len(args.tree) < 2 or len(named) < len(args.tree) or any(not Path(f).is_dir() for f in named.values()):
        ap.error(f"need two or more --tree NAME=FOLDER with distinct names and existing folders, got {args.tree}")
    bench_args = ["--config", args.config, "--weights", args.weights, "--no-peer", "--batches", args.batches,
                  "--decode-steps", args.decode_steps]
    with tempfile.TemporaryDirectory(prefix="ab_trees_") as work:
        trees = {name: prepare_tree(Path(folder), Path(work) / name) for name, folder in named.items()}
        runs = alternate(trees, bench_args, args.seconds, args.run_timeout)
    medians = summary(runs, list(named))
    if args.json:
        Path(args.json).write_text(json.dumps({"bench_args": bench_args, "runs": runs, "medians": medians}, indent=1))
    print_tables(runs, medians)


if __name__ == "__main__":
    main()
