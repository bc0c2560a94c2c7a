"""One prepared GPU check: prepare -> extract (vllm, hf) -> vocab -> train -> eval on a
bigger random verifier, with every figure written to gpu_results.json.

    python bench/gpu_check.py --out DIR [--smoke]

--smoke runs the same path on the CPU with tiny shapes (the test suite does, so this
script cannot rot). Figures: bf16 (fp32 on CPU) matmul rate, extraction tokens/s per
engine and their ratio, bytes/token, peak GPU memory, training tokens/s, and an MFU
estimate (training FLOPs/token x tokens/s over the measured matmul rate). Each stage is
timed and a failure is recorded rather than ending the run. Where vLLM is installed, eval
also serves the draft with it (`eval.live`): live acceptance, the exact replay, parity.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Dict

import torch

SHAPES = {
    "gpu": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
                num_attention_heads=16, num_key_value_heads=8, vocab_size=32000),
    "smoke": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=6,
                  num_attention_heads=2, num_key_value_heads=2, vocab_size=1024),
}


def matmul_rate(device: str) -> float:
    """Measured dense matmul FLOP/s (bf16 on GPU, fp32 on CPU)."""
    n, dtype = (8192, torch.bfloat16) if device == "cuda" else (512, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    if device == "cuda":
        torch.cuda.synchronize()
    reps = 10
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    if device == "cuda":
        torch.cuda.synchronize()
    return 2 * n ** 3 * reps / (time.perf_counter() - t0)


def train_flops_per_token(shape: Dict[str, Any], ttt: int, draft_vocab: int) -> float:
    """Forward+backward FLOPs per token of draft training (6 x params touched x steps),
    plus the verifier-head target logits (forward only, once per token)."""
    h, i, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    hd = h // heads
    layer = 2 * h * (heads * hd + 2 * kv * hd) + heads * hd * h + 3 * h * i
    per_step = layer + h * draft_vocab
    return 6 * (3 * h * h + ttt * per_step) + 2 * h * v


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    shape = SHAPES["smoke" if args.smoke else "gpu"]
    res: Dict[str, Any] = {"smoke": args.smoke, "device": device, "shape": shape,
                           "torch": torch.__version__, "python": platform.python_version(),
                           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "stages": {}}
    if device == "cuda":
        res["gpu"] = torch.cuda.get_device_name(0)

    def save() -> None:
        (out / "gpu_results.json").write_text(json.dumps(res, indent=2))

    def stage(name: str, fn) -> Any:
        t0 = time.perf_counter()
        try:
            value = fn()
            res["stages"][name] = {"ok": True, "seconds": round(time.perf_counter() - t0, 2)}
            return value
        except BaseException as exc:  # record and go on
            res["stages"][name] = {"ok": False, "seconds": round(time.perf_counter() - t0, 2),
                                   "error": f"{type(exc).__name__}: {exc}"[:2000],
                                   "trace": traceback.format_exc()[-3000:]}
            return None
        finally:
            save()

    res["matmul_flops"] = stage("matmul", lambda: matmul_rate(device))
    work = Path(tempfile.mkdtemp(prefix="eagle3x-gpu-"))
    os.environ["EAGLE3X_ARTIFACTS"] = str(work / "artifacts")
    from eagle3x import tiny

    verifier = stage("build_verifier", lambda: tiny.build_random(
        work / "verifier", device=device, dtype="bfloat16" if device == "cuda" else "float32", **shape))
    from eagle3x.config.compose import load_config, typed
    from eagle3x.config.schema import Stage
    from eagle3x.pipeline import run_stages, stages_for, start

    samples = 32 if args.smoke else 320
    base = ["verifier=local", f"verifier.path={verifier}", "logger=none",
            f"data.num_samples={samples}", "extract.max_seq_len=512", "vocab.draft_vocab_size=256",
            f"train.output_dir={work / 'run'}", "train.ttt_steps=4", "train.batch_size=8",
            "train.lr=1e-3", f"trainer.max_steps={5 if args.smoke else 300}",
            "trainer.enable_progress_bar=false", "eval.depth=4", "eval.max_samples=32",
            f"data.holdout_samples={8 if args.smoke else 32}"]
    if device == "cuda":
        base += ["trainer.precision=bf16-mixed", "engine.dtype=bfloat16"]
    hidden = ["engine=hf", f"extract.output_dir={work / 'hidden-hf'}"]

    def run(spec, *extra):
        settings = typed(load_config(["stage=all", *base, *extra]))
        return lambda: run_stages(start(settings), settings, [spec])

    res["extract"] = {}
    for spec in stages_for(Stage.all):  # the stage graph's order
        if spec.name == "extract":  # once per engine, each into its own folder
            for engine in ["hf"] + ([] if args.smoke else ["vllm"]):
                folder = work / f"hidden-{engine}"
                batch = 256 if engine == "vllm" else 16
                if stage(f"extract_{engine}", run(
                        spec, f"engine={engine}", f"extract.output_dir={folder}",
                        f"extract.batch_size={batch}", "engine.gpu_memory_utilization=0.5")):
                    m = json.loads((folder / "manifest.json").read_text())
                    size = sum(s["bytes"] for s in m["shards"])
                    tokens = sum(s["tokens"] for s in m["shards"])
                    res["extract"][engine] = dict(m["runs"][-1], bytes_per_token=size / tokens)
            if len(res["extract"]) == 2:
                res["extract"]["vllm_over_hf"] = (res["extract"]["vllm"]["tokens_per_second"]
                                                  / res["extract"]["hf"]["tokens_per_second"])
            continue
        if spec.name == "train" and device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        extra = list(hidden)
        if spec.name == "eval" and not args.smoke and importlib.util.find_spec("vllm"):
            # vLLM serves the draft (its V2 runner on a GPU): live acceptance, the exact
            # greedy replay and parity, in the engine dtype above
            extra += ["eval.live=true", "engine=vllm", "engine.gpu_memory_utilization=0.5"]
        ok = stage(spec.name, run(spec, *extra))
        if spec.name == "train" and ok:
            summary = json.loads((work / "run" / "train_summary.json").read_text())
            tokens_per_step = summary["train_tokens_per_step"]
            tps = tokens_per_step * summary["steps"] / summary["train_seconds"]
            flops = train_flops_per_token(shape, 4, 256)
            res["train"] = {"steps": summary["steps"], "seconds": summary["train_seconds"],
                            "tokens_per_second": tps, "flops_per_token": flops,
                            "val_acc_0": summary["metrics"].get("val/acc_0"),
                            "val_accept_len": summary["metrics"].get("val/accept_len")}
            if res.get("matmul_flops"):
                res["train"]["mfu"] = tps * flops / res["matmul_flops"]
            if device == "cuda":
                res["peak_gpu_memory_gb"] = torch.cuda.max_memory_allocated() / 2 ** 30
        if spec.name == "eval" and ok:
            res["eval"] = json.loads((work / "run" / "eval.json").read_text())
    res["total_seconds"] = round(sum(s["seconds"] for s in res["stages"].values()), 1)
    save()
    print(json.dumps({k: v for k, v in res.items() if k != "stages"}, indent=1, default=str))
    bad = [k for k, v in res["stages"].items() if not v["ok"]]
    if bad:
        print("failed stages:", ", ".join(bad), file=sys.stderr)
    sys.exit(1 if args.smoke and bad else 0)


if __name__ == "__main__":
    main()
