"""The one prepared GPU check: every figure of a lent GPU into one json, each part bounded so
a failure or a hang in one keeps the rest.

    python bench/gpu_check.py --out DIR [--smoke]       (bench/gpu_check.sh wraps it)

Parts, in this order (each a subprocess with its own time limit, cut to what is left of
the whole check's budget, GPU_CHECK_LIMIT seconds less a margin; a part that does not
fit is recorded as skipped):
  matmul    measured bf16 matmul rate (fp32 on the CPU), the denominator of every MFU
  check     the fused training-time-test attention against the reference on this device,
            bf16 autocast, against float32 (bench/gpu_step.py --check: tolerances there)
  step_*    one optimizer step at the Llama-3-8B draft shape (H=4096, 32/8 heads, MLP
            14336, verifier vocab 128256, draft vocab 32000, 7 TTT steps, one sequence):
            eagle3x and speculators 0.9 at T=4096 and 16384, each on its own GPU recipe
            (bench/gpu_step.py): tokens/s, first step (compilation included), peak memory
            growth; the peer's fused Triton loss first, its eager loss when that fails
            (the reason is recorded); eagle3x also at T=32768 (memory)
  demo      `python -m eagle3x stage=all` on the embedded default (engine=hf, bf16-mixed)
  e2e       stage=all on a bigger random verifier (24 layers, H=2048, vocab 32000) with
            token-sized batches (train.max_tokens): the train stage's steady tokens/s and
            MFU, against the isolated step at the same batch shape (documents of the
            data's mean length packed into a row of max_tokens, the data's share of
            trained tokens)
  peer_16k  speculators at T=16384 last, with whatever time is left (its compilation took
            over 100 s on the first H200)
Ratios: eagle3x over the peer in tokens/s and peak memory at each T; the loop's tokens/s
over the isolated step's. --smoke runs every part on the CPU with tiny shapes (the test
suite does, so the script cannot rot); the sample arithmetic is the same in both modes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
STEP = str(REPO / "bench" / "gpu_step.py")

#: the e2e part's random verifier (tiny.build_random fields)
VERIFIER = {
    "gpu": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
                num_attention_heads=16, num_key_value_heads=8, vocab_size=32000),
    "smoke": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=1024),
}
#: the bundled conversations (eagle3x/resources/sample_conversations.jsonl)
BUNDLED = 320


def sample_split(available: int, smoke: bool) -> Dict[str, Any]:
    """Held-out and training samples of the bundled conversations: the same arithmetic in
    both modes (training takes all the rest, `data.num_samples=null`), so the smoke run
    meets what the GPU run meets."""
    holdout = 8 if smoke else 32
    return {"holdout": holdout, "train": available - holdout,
            "overrides": [f"data.holdout_samples={holdout}", "data.num_samples=null"]}


def model_flops_per_token(shape: Dict[str, int], ttt: int, draft_vocab: int) -> float:
    """6 x the parameters a token passes through (fc once; the decoder layer and lm_head
    once per training-time-test step): the model FLOPs of forward + backward that MFU
    counts. Attention scores and the verifier's teacher logits are left out."""
    h, i = shape["hidden"], shape["intermediate"]
    q, kv = shape["heads"] * shape["head_dim"], shape["kv_heads"] * shape["head_dim"]
    layer = 2 * h * (q + 2 * kv) + q * h + 3 * h * i
    return 6 * (3 * h * h + ttt * (layer + h * draft_vocab))


def matmul_rate(device: str) -> float:
    import torch

    n, dtype = (8192, torch.bfloat16) if device == "cuda" else (512, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    if device == "cuda":
        torch.cuda.synchronize()
    reps = 20 if device == "cuda" else 5
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    if device == "cuda":
        torch.cuda.synchronize()
    return 2 * n ** 3 * reps / (time.perf_counter() - t0)


class Check:
    def __init__(self, out: Path, smoke: bool, limit: float):
        self.out, self.smoke = out, smoke
        self.start, self.deadline = time.monotonic(), time.monotonic() + limit
        import torch

        self.device = "cuda" if torch.cuda.is_available() and not smoke else "cpu"
        self.res: Dict[str, Any] = {
            "smoke": smoke, "device": self.device, "python": platform.python_version(),
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "limit_s": limit, "parts": {}}
        if self.device == "cuda":
            self.res["gpu"] = torch.cuda.get_device_name(0)
        self.env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in [str(REPO), os.environ.get("PYTHONPATH", "")] if p))
        if smoke:
            self.env["OMP_NUM_THREADS"] = self.env.get("OMP_NUM_THREADS", "1")

    def save(self) -> None:
        self.res["seconds"] = round(time.monotonic() - self.start, 1)
        tmp = self.out / "gpu_results.json.tmp"
        tmp.write_text(json.dumps(self.res, indent=2, default=str))
        tmp.replace(self.out / "gpu_results.json")

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, name: str, argv: List[str], limit: float, need: float = 10.0,
            cwd: Optional[Path] = None, json_out: bool = True) -> Optional[Dict[str, Any]]:
        """Run one part as a subprocess within min(limit, what is left); with `json_out`
        its last json stdout line is its result (else {} on exit status 0). Records ok /
        error / timeout / skipped under parts[name]."""
        budget = min(limit, self.left() - 5)
        part: Dict[str, Any] = {"argv": " ".join(argv[1:])[-400:]}
        self.res["parts"][name] = part
        if budget < need:
            part.update(ok=False, skipped=f"{self.left():.0f}s left of the check's budget")
            self.save()
            return None
        t0 = time.monotonic()
        try:
            r = subprocess.run(argv, capture_output=True, text=True, timeout=budget, env=self.env,
                               cwd=str(cwd or REPO))
        except subprocess.TimeoutExpired as exc:
            part.update(ok=False, seconds=round(time.monotonic() - t0, 1),
                        timeout=f"did not finish within {budget:.0f}s",
                        tail=((exc.stderr or b"")[-1500:]).decode("utf-8", "replace")
                        if isinstance(exc.stderr, bytes) else str(exc.stderr or "")[-1500:])
            self.save()
            return None
        part["seconds"] = round(time.monotonic() - t0, 1)
        value = None
        for line in reversed(r.stdout.strip().splitlines()):
            try:
                value = json.loads(line)
                break
            except ValueError:
                continue
        if value is None and not json_out and r.returncode == 0:
            value = {}
        if r.returncode != 0 or value is None:
            part.update(ok=False, returncode=r.returncode,
                        error=(value or {}).get("error") if isinstance(value, dict) else None,
                        tail=(r.stdout + r.stderr)[-2500:])
        else:
            part.update(ok=True, result=value)
        self.save()
        return value if part["ok"] else None


def step_argv(smoke: bool, impl: str, length: int, extra: List[str] = ()) -> List[str]:
    argv = [sys.executable, STEP, "--impl", impl, "--length", str(length)]
    if smoke:
        argv += ["--shape", "smoke", "--device", "cpu", "--timed", "2", "--steps", "3"]
        if impl == "peer":  # on the CPU flex attention has no backward: its documented fallback
            argv += ["--peer-attn", "sdpa", "--peer-loss", "eager"]
    return argv + list(extra)


def peer_site() -> Optional[str]:
    """Where speculators lives: the venv (when importable), else $EAGLE3X_PEER_SITE, the
    carried wheels' /tmp/site, or ../peer-site beside the repository."""
    import importlib.util

    if importlib.util.find_spec("speculators"):
        return None
    for cand in (os.environ.get("EAGLE3X_PEER_SITE"), "/tmp/site", str(REPO.parent / "peer-site")):
        if cand and (Path(cand) / "speculators").is_dir():
            return cand
    return "missing"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--limit", type=float, default=float(os.environ.get("GPU_CHECK_LIMIT", 470)) - 15)
    p.add_argument("--skip", default="", help="comma-separated parts to leave out")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    c = Check(out, args.smoke, args.limit)
    skip = set(filter(None, args.skip.split(",")))
    smoke, res = args.smoke, c.res
    work = Path(tempfile.mkdtemp(prefix="eagle3x-gpu-"))
    c.env["EAGLE3X_ARTIFACTS"] = str(work / "artifacts")

    t0 = time.monotonic()
    try:
        res["matmul_flops"] = matmul_rate(c.device)
        res["parts"]["matmul"] = {"ok": True, "seconds": round(time.monotonic() - t0, 1)}
    except Exception as exc:
        res["parts"]["matmul"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    c.save()

    site = peer_site()
    if site == "missing":
        res["peer_missing"] = ("speculators is not importable and no site holds it "
                               "(bench/gpu_wheels.sh carries it in .whl/)")
    peer_extra = ["--peer-site", site] if site and site != "missing" else []

    if "check" not in skip:
        argv = [sys.executable, STEP, "--check"] + (["--device", "cpu"] if smoke else [])
        c.run("check", argv, 120 if not smoke else 240)

    shape = "smoke" if smoke else "llama3-8b"
    lengths = [64, 128] if smoke else [4096, 16384]
    big = 256 if smoke else 32768
    steps = 3 if smoke else 7
    from gpu_step import SHAPES  # bench/ is on sys.path (below)

    flops = model_flops_per_token(SHAPES[shape], steps, SHAPES[shape]["draft_vocab"])
    res["step_model_flops_per_token"] = flops
    steps_res: Dict[str, Dict[int, Dict[str, Any]]] = {"eagle3x": {}, "peer": {}}
    peer_loss = "fused"

    def peer(length: int, limit: float) -> None:
        nonlocal peer_loss
        if site == "missing":
            return
        name = f"step_peer_{length}"
        extra = list(peer_extra) + (["--peer-loss", peer_loss] if not smoke else [])
        r = c.run(name, step_argv(smoke, "peer", length, extra), limit)
        if r is None and not smoke and peer_loss == "fused":
            failed = res["parts"][name]
            res["peer_fused_loss_failure"] = failed.get("error") or failed.get("timeout") or \
                str(failed.get("tail", ""))[-600:]
            peer_loss = "eager"
            r = c.run(name + "_eager_loss", step_argv(smoke, "peer", length, list(peer_extra) +
                                                      ["--peer-loss", "eager"]), limit)
        if r is not None:
            steps_res["peer"][length] = r

    for i, length in enumerate(lengths):
        if f"step_{length}" in skip:
            continue
        r = c.run(f"step_eagle3x_{length}", step_argv(smoke, "eagle3x", length), 150)
        if r is not None:
            steps_res["eagle3x"][length] = r
        if i == 0:  # the long peer point goes last (its compilation may eat the budget)
            peer(length, 180)
    if "memory" not in skip:
        r = c.run(f"step_eagle3x_{big}", step_argv(smoke, "eagle3x", big, ["--timed", "1"]), 150)
        if r is not None:
            steps_res["eagle3x"][big] = r

    if "demo" not in skip:
        demo = [sys.executable, "-m", "eagle3x", "stage=all", "engine=hf", "logger=none",
                f"train.output_dir={work / 'demo'}", "trainer.enable_progress_bar=false"]
        demo += (["trainer.max_steps=3"] if smoke else ["trainer.precision=bf16-mixed"])
        c.run("demo", demo + ["hydra.run.dir=" + str(work / "demo-hydra")], 150, json_out=False)
        summary = work / "demo" / "summary.json"
        if summary.exists():
            res["demo"] = json.loads(summary.read_text())

    if "e2e" not in skip:
        e2e(c, work, smoke, steps)

    if not smoke and len(lengths) > 1 and "step_peer_long" not in skip:
        peer(lengths[1], c.left() - 10)

    res["steps"] = {impl: {str(k): v for k, v in d.items()} for impl, d in steps_res.items()}
    ratios = {}
    for length in lengths:
        a, b = steps_res["eagle3x"].get(length), steps_res["peer"].get(length)
        if a and b:
            ratios[str(length)] = {
                "tokens_per_second": a["tokens_per_second"] / b["tokens_per_second"],
                "peak_growth": (a.get("peak_growth_gb") or 0) / b["peak_growth_gb"]
                if b.get("peak_growth_gb") else None,
                "first_step_s": [a["first_step_s"], b["first_step_s"]]}
        if a and res.get("matmul_flops"):
            a["mfu"] = a["tokens_per_second"] * flops / res["matmul_flops"]
    res["eagle3x_over_peer"] = ratios
    c.save()
    print(json.dumps({k: v for k, v in res.items() if k != "parts"}, indent=1, default=str))
    bad = [k for k, v in res["parts"].items() if not v.get("ok")]
    if bad:
        print("parts that failed or were skipped: " + ", ".join(bad), file=sys.stderr)
    sys.exit(1 if smoke and bad else 0)


def e2e(c: Check, work: Path, smoke: bool, steps: int) -> None:
    """stage=all on a bigger random verifier with token-sized batches; the train stage's
    steady tokens/s and MFU against the isolated step at the same batch shape."""
    res = c.res
    shape = VERIFIER["smoke" if smoke else "gpu"]
    verifier = work / "verifier"
    build = [sys.executable, "-c",
             "import json,sys; from eagle3x import tiny; "
             f"tiny.build_random({str(verifier)!r}, device={('cpu' if smoke else 'cuda')!r}, "
             f"dtype={('float32' if smoke else 'bfloat16')!r}, **json.loads(sys.argv[1])); "
             "print(json.dumps({'ok': True}))", json.dumps(shape)]
    if c.run("e2e_verifier", build, 120) is None:
        return
    split = sample_split(BUNDLED, smoke)
    res["e2e_split"] = {k: split[k] for k in ("holdout", "train")}
    max_tokens = 1024 if smoke else 8192
    draft_vocab = 128 if smoke else 8192
    run = work / "e2e-run"
    argv = [sys.executable, "-m", "eagle3x", "stage=all", "verifier=local",
            f"verifier.path={verifier}", "engine=hf", "logger=none", *split["overrides"],
            "extract.max_seq_len=512", f"vocab.draft_vocab_size={draft_vocab}",
            f"train.output_dir={run}", f"train.ttt_steps={steps}", f"train.max_tokens={max_tokens}",
            "train.lr=1e-3", f"trainer.max_steps={5 if smoke else 300}",
            "trainer.enable_progress_bar=false", "eval.depth=4", "eval.max_samples=32",
            f"extract.output_dir={work / 'e2e-hidden'}", "hydra.run.dir=" + str(work / "e2e-hydra")]
    if not smoke:
        argv += ["trainer.precision=bf16-mixed", "engine.dtype=bfloat16", "extract.batch_size=32"]
    if c.run("e2e", argv, 240, json_out=False) is None:
        return
    summary = json.loads((run / "train_summary.json").read_text())
    manifest = json.loads((work / "e2e-hidden" / "manifest.json").read_text())
    doc_len = round(sum(s["tokens"] for s in manifest["shards"]) /
                    sum(s["num_samples"] for s in manifest["shards"]))
    plan = json.loads((run / "plan.json").read_text())
    stats = json.loads((Path(plan["prepared"]["folder"]) / "manifest.json").read_text())["stats"]
    trained = stats["loss_tokens"] / stats["tokens"]
    train = {k: summary.get(k) for k in ("steps", "train_seconds", "train_tokens_per_step",
                                         "train_samples", "throughput")}
    train["extract"] = manifest["runs"][-1]
    res["e2e_train"] = train
    step_shape = {"hidden": shape["hidden_size"], "heads": shape["num_attention_heads"],
                  "kv_heads": shape["num_key_value_heads"],
                  "head_dim": shape["hidden_size"] // shape["num_attention_heads"],
                  "intermediate": shape["intermediate_size"], "target_vocab": shape["vocab_size"],
                  "draft_vocab": draft_vocab}
    flops = model_flops_per_token(step_shape, steps, draft_vocab)
    iso = c.run("e2e_isolated_step", [sys.executable, STEP, "--impl", "eagle3x",
                                      "--shape-json", json.dumps(dict(step_shape, eps=1e-6,
                                                                      rope_theta=10000.0)),
                                      "--length", str(max_tokens), "--steps", str(steps),
                                      "--doc-len", str(doc_len),
                                      "--trained-fraction", f"{trained:.3f}"]
                + (["--device", "cpu", "--timed", "2"] if smoke else []), 90)
    loop = (summary.get("throughput") or {}).get("tokens_per_second")
    res["e2e_ratio"] = {"loop_tokens_per_second": loop, "doc_len": doc_len,
                        "trained_fraction": trained,
                        "model_flops_per_token": flops}
    if loop and res.get("matmul_flops"):
        res["e2e_ratio"]["loop_mfu"] = loop * flops / res["matmul_flops"]
    if iso and loop:
        res["e2e_ratio"]["isolated_tokens_per_second"] = iso["tokens_per_second"]
        res["e2e_ratio"]["loop_over_isolated"] = loop / iso["tokens_per_second"]
    c.save()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
