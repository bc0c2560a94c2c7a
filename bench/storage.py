"""Compact hidden-state storage: bytes per token and the accepted length it costs.

    python bench/storage.py [--live] [--formats NAME,...] [overrides ...]

For each storage format (extract.aux_format x extract.teacher) the same `stage=all` runs
in a fresh store on the same prepared data, seed and steps: extraction (engine=hf unless
overridden), vocab, training, offline eval; with --live also `stage=eval eval.live=true`
(vLLM serving the draft on the held-out prompts, engine.dtype=float32). Prints:

- bytes per token measured on disk (shards / tokens) and by the formula
  (data/compact.py), and the ratio to the peers' 8H bf16 baseline;
- the same formula for real hidden sizes (4096: Llama-3-8B, 8192: Llama-3-70B,
  7168: DeepSeek-V3 / Kimi-K2) with K as given;
- the aux states' relative RMS error against a float32 extraction (bf16, fp8, int8), and
  the share of the verifier's probability its top-k carries;
- val acc_0, offline mean accepted length, and (--live) vLLM's served accepted length,
  each with its change against the baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3x.data.compact import baseline_bytes_per_token, bytes_per_token  # noqa: E402

FORMATS = {
    "baseline": {"aux": "native", "teacher": "hidden"},
    "fp8": {"aux": "fp8", "teacher": "hidden"},
    "int8": {"aux": "int8", "teacher": "hidden"},
    "topk64": {"aux": "native", "teacher": "topk", "topk": 64},
    "fp8+topk64": {"aux": "fp8", "teacher": "topk", "topk": 64},
    "fp8+topk16": {"aux": "fp8", "teacher": "topk", "topk": 16},
}


def overrides(fmt: dict) -> list:
    out = [f"extract.aux_format={fmt['aux']}", f"extract.teacher={fmt['teacher']}"]
    return out + ([f"extract.topk={fmt['topk']}"] if "topk" in fmt else [])


def run(args: list, env: dict) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "eagle3x", *args], capture_output=True,
                       text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"failed: {' '.join(args)}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    return r


def aux_errors(folders: dict, reference: Path) -> dict:
    """Relative RMS error of each folder's decoded aux states against `reference`."""
    import torch

    from eagle3x.data.shards import ShardReader

    ref = ShardReader(reference)
    n = min(len(ref), 64)
    want = torch.cat([ref[i]["aux_hidden"].float() for i in range(n)])
    out = {}
    for name, folder in folders.items():
        r = ShardReader(folder)
        got = torch.cat([r[i]["aux_hidden"].float() for i in range(n)])
        out[name] = float((got - want).norm() / want.norm())
    return out


def outlier_errors(reference: Path, factor: float = 100.0) -> dict:
    """fp8 and int8 relative RMS error on the reference aux states with one channel per
    layer multiplied by `factor` (the massive activations of real verifiers' residual
    streams, which a tiny random model lacks), measured on the other channels."""
    import torch

    from eagle3x.data.compact import dequantize, quantize
    from eagle3x.data.shards import ShardReader

    ref = ShardReader(reference)
    x = torch.cat([ref[i]["aux_hidden"].float() for i in range(min(len(ref), 64))])
    h = x.shape[1] // 3
    hot = torch.tensor([7, h + 7, 2 * h + 7])
    x[:, hot] *= factor
    keep = torch.ones(x.shape[1], dtype=torch.bool)
    keep[hot] = False
    out = {}
    for kind in ("fp8", "int8"):
        q = quantize(x, kind)
        y = dequantize(q["aux_q"], q["aux_scale"])
        out[kind] = float((y - x)[:, keep].norm() / x[:, keep].norm())
    return out


def topk_mass(folder: Path) -> float:
    """Mean probability the stored top-k carries (of the full vocabulary's 1)."""
    import torch

    from eagle3x.data.shards import ShardReader

    r = ShardReader(folder)
    n = min(len(r), 64)
    return float(torch.cat([r[i]["topk_logp"].float().exp().sum(-1) for i in range(n)]).mean())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--live", action="store_true", help="also serve each draft with vLLM")
    p.add_argument("--formats", default=",".join(FORMATS))
    known, extra = p.parse_known_args()
    names = known.formats.split(",")
    tmp = Path(tempfile.mkdtemp(prefix="eagle3x-storage-"))
    env = dict(os.environ, EAGLE3X_ARTIFACTS=str(tmp / "artifacts"), WANDB_MODE="offline")
    common = ["engine=hf", "logger=csv", *extra]
    run(["stage=prepare", *common], env)
    rows = {}
    for name in names:
        fmt = FORMATS[name]
        out = tmp / name
        t0 = time.perf_counter()
        run(["stage=all", f"train.output_dir={out}", *overrides(fmt), *common], env)
        summary = json.loads((out / "summary.json").read_text())
        if known.live:
            run(["stage=eval", "eval.live=true", "engine.dtype=float32",
                 f"train.output_dir={out}", *overrides(fmt), *common], env)
        folder = Path(summary["artifacts"]["hidden"]["path"])
        m = json.loads((folder / "manifest.json").read_text())
        tokens = sum(s["tokens"] for s in m["shards"])
        size = sum(s["bytes"] for s in m["shards"])
        ev = json.loads((out / "eval.json").read_text())
        rows[name] = {"folder": folder, "hidden": m["hidden_size"],
                      "measured": size / tokens,
                      "formula": bytes_per_token(m["hidden_size"], 2, fmt),
                      "val_acc_0": summary["acc"]["acc_0"],
                      "offline": ev["mean_accepted_length"],
                      "live": (ev.get("live") or {}).get("served", {}).get("mean_accepted_length"),
                      "seconds": time.perf_counter() - t0}
        print(f"{name}: done in {rows[name]['seconds']:.0f}s", flush=True)

    ref32 = tmp / "float32"
    run(["stage=extract", "extract.dtype=float32", f"extract.output_dir={ref32}", *common], env)
    quantized = {n: rows[n]["folder"] for n in ("baseline", "fp8", "int8") if n in rows}
    errors = aux_errors(quantized, ref32)
    outliers = outlier_errors(ref32)

    h = next(iter(rows.values()))["hidden"]
    base = rows.get("baseline")
    print(f"\nstorage on the tiny default (hidden {h}); baseline = bf16 aux + last hidden "
          f"({baseline_bytes_per_token(h)} B/token with ids and mask)")
    print(f"{'format':12s} {'B/token':>8s} {'formula':>8s} {'x base':>7s} {'val acc0':>9s} "
          f"{'offline':>8s} {'d%':>6s} {'live':>7s} {'d%':>6s}")
    for name, r in rows.items():
        def pct(key: str) -> str:
            if not base or r[key] is None or base[key] is None:
                return "-"
            return f"{100 * (r[key] / base[key] - 1):+.1f}"

        live = f"{r['live']:.3f}" if r["live"] is not None else "-"
        acc = f"{r['val_acc_0']:.3f}" if r["val_acc_0"] is not None else "-"
        print(f"{name:12s} {r['measured']:8.0f} {r['formula']:8d} "
              f"{r['measured'] / baseline_bytes_per_token(h):7.2f} {acc:>9s} "
              f"{r['offline']:8.3f} {pct('offline'):>6s} {live:>7s} {pct('live'):>6s}")
    print("\naux relative RMS error against a float32 extraction: "
          + ", ".join(f"{'bf16' if n == 'baseline' else n} {e:.2e}" for n, e in errors.items()))
    print("the same with one channel per layer x100 (massive activations), error on the "
          "other channels: " + ", ".join(f"{k} {e:.2e}" for k, e in outliers.items()))
    for name in names:
        if FORMATS[name]["teacher"] == "topk":
            print(f"{name}: the top-{FORMATS[name]['topk']} carry "
                  f"{100 * topk_mass(rows[name]['folder']):.1f}% of the verifier's probability")
    print("\nformula for real hidden sizes (bytes per token, x the 8H baseline):")
    print(f"{'format':12s} " + " ".join(f"{'H=' + str(x):>16s}" for x in (4096, 8192, 7168)))
    for name in names:
        fmt = FORMATS[name]
        cells = []
        for x in (4096, 8192, 7168):
            b = bytes_per_token(x, 2, fmt)
            cells.append(f"{b:8d} ({b / baseline_bytes_per_token(x):.3f})")
        print(f"{name:12s} " + " ".join(f"{c:>16s}" for c in cells))


if __name__ == "__main__":
    main()
