"""Training-time-test memory against sequence length: the dense implementation eagle3x had
(eagle3x/testing/dense_ttt.py) and today's (blocked attention recomputed in backward, chunked
loss), side by side in one run.

    python bench/ttt_memory.py                  # measured sweep + extrapolation table
    python bench/ttt_memory.py --lengths 512,1024 --skip-extrapolation
    python bench/ttt_memory.py --device cuda --real Llama-3-8B --lengths 2048,8192,32768 \
        --dense-max 8192 --skip-extrapolation        # on a GPU: checks the table below

1. Measured (CPU): one forward + backward of `ttt_step_metrics` per (implementation, T),
   each in a fresh process; peak memory is the growth of the process's peak RSS
   (ru_maxrss) over what it held after building the draft and inputs and a warm-up at
   T=64. Step time is the median of `--repeats` runs after one untimed run at that T.
   Growth ratios per doubling of T. (`--device cuda`: the allocator's peak instead.)
2. Extrapolation: what autograd keeps for backward is counted exactly, on PyTorch's `meta`
   device (shapes only, no arithmetic), for real draft shapes and T up to 64K, through
   saved-tensor hooks (distinct storages); at small shapes the count is printed next to
   the measured RSS growth as a check. Peak GPU memory is then modelled as
       weights + grads + AdamW (16 bytes per trained parameter, float32)
     + frozen embedding and verifier head (float32) + the batch (aux 3H + last H, bf16)
     + kept activations (counted) + the largest transient (attention block of
       [heads, block, T] scores, or a loss chunk of [chunk, draft vocab], x4 copies in fp32)
   against 80 GB and 141 GB with 10% held back. The longest T that fits is printed, with
   the assumptions. float32 training (eagle3x's default precision "32"); bf16-mixed halves
   the activation terms.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SMALL = dict(hidden=256, heads=4, kv_heads=4, intermediate=688, draft_vocab=4096,
             target_vocab=32000)
# Draft shapes for real verifiers: one Llama decoder layer at the verifier's hidden size and
# heads (eagle3x.draft.shape.draft_shape), the verifier's vocabulary, a 32K draft vocabulary.
REAL = {
    "Llama-3-8B": dict(hidden=4096, heads=32, kv_heads=8, intermediate=14336,
                       draft_vocab=32000, target_vocab=128256),
    "Llama-3-70B": dict(hidden=8192, heads=64, kv_heads=8, intermediate=28672,
                        draft_vocab=32000, target_vocab=128256),
    "Kimi-K2 (H=7168)": dict(hidden=7168, heads=64, kv_heads=64, intermediate=18432,
                             draft_vocab=32000, target_vocab=163840),
}


def build(shape: Dict[str, int], t: int, device: str, block: int):
    import torch

    from eagle3x.draft.model import DraftShape, Eagle3Draft

    h = shape["hidden"]
    s = DraftShape(hidden_size=h, target_hidden_size=h, intermediate_size=shape["intermediate"],
                   num_heads=shape["heads"], num_kv_heads=shape["kv_heads"],
                   head_dim=h // shape["heads"], draft_vocab_size=shape["draft_vocab"],
                   target_vocab_size=shape["target_vocab"])
    with torch.device(device):
        d2t = torch.zeros(s.draft_vocab_size, dtype=torch.long)
        t2d = torch.zeros(s.target_vocab_size, dtype=torch.bool)
        draft = Eagle3Draft(s, d2t, t2d)
        draft.embed_tokens.weight.requires_grad_(False)
        draft.midlayer.self_attn.block = block
        head = torch.randn(s.target_vocab_size, h) * 0.02
        batch = {"input_ids": torch.randint(0, s.target_vocab_size, (1, t)),
                 "loss_mask": torch.ones(1, t, dtype=torch.uint8),
                 "lengths": torch.tensor([t]),
                 "aux_hidden": torch.randn(1, t, 3 * h), "last_hidden": torch.randn(1, t, h)}
    return draft, batch, head


def metrics_fn(impl: str):
    if impl == "dense":
        from eagle3x.testing.dense_ttt import dense_step_metrics

        return lambda d, b, h, steps, chunk: dense_step_metrics(d, b, h, steps, 0.8)
    from eagle3x.draft.ttt import ttt_step_metrics

    return lambda d, b, h, steps, chunk: ttt_step_metrics(d, b, h, steps, 0.8, chunk=chunk)


def kept_bytes(impl: str, shape: Dict[str, int], t: int, steps: int, block: int,
               chunk: int) -> int:
    """Bytes of the distinct storages autograd keeps for backward (meta device: exact)."""
    import torch

    import torch.fx.experimental._config as fx_config

    # nonzero() on meta: every position counts as trained (the batch's mask is all ones)
    fx_config.meta_nonzero_assume_all_nonzero = True
    draft, batch, head = build(shape, t, "meta", block)
    seen: Dict[tuple, int] = {}

    def pack(x):
        st = x.untyped_storage()
        key = (id(st), st.nbytes()) if x.device.type == "meta" else (st.data_ptr(),)
        seen[key] = st.nbytes()
        return x

    fn = metrics_fn(impl)
    keep = []
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = fn(draft, batch, head, steps, chunk)
        keep.append(out["loss"])
    return sum(seen.values())


def child(args: argparse.Namespace) -> None:
    """One measurement in this fresh process; prints a json line."""
    import torch

    torch.manual_seed(0)
    shape = json.loads(args.shape)
    fn = metrics_fn(args.impl)
    cuda = args.device == "cuda"
    warm_d, warm_b, warm_h = build(shape, 64, args.device, args.block)
    fn(warm_d, warm_b, warm_h, args.steps, args.chunk)["loss"].backward()
    del warm_d, warm_b, warm_h
    draft, batch, head = build(shape, args.t, args.device, args.block)
    if cuda:  # GPU: the allocator's own peak over what the model and inputs hold
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() / 1024
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # an untimed run at this T first: oneDNN builds its kernels per matrix shape on the
    # first call (seconds on this CPU), which is not training speed
    fn(draft, batch, head, args.steps, args.chunk)["loss"].backward()
    times = []
    for _ in range(args.repeats):
        draft.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        fn(draft, batch, head, args.steps, args.chunk)["loss"].backward()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated() / 1024 if cuda
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    times.sort()
    print(json.dumps({"impl": args.impl, "t": args.t, "grow_mb": (peak - base) / 1024,
                      "seconds": times[len(times) // 2]}))


def measure(impl: str, t: int, a: argparse.Namespace) -> Dict:
    cmd = [sys.executable, __file__, "--child", "--impl", impl, "--t", str(t),
           "--device", a.device, "--shape", json.dumps(a.shape), "--steps", str(a.steps),
           "--block", str(a.block),
           "--chunk", str(a.chunk), "--repeats", str(a.repeats)]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=3600)
    if r.returncode != 0:
        return {"impl": impl, "t": t, "error": r.stderr.strip().splitlines()[-1]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def fmt_mb(x: float) -> str:
    return f"{x / 1024:.2f} GB" if x >= 1024 else f"{x:.0f} MB"


def measured_table(a: argparse.Namespace) -> None:
    lengths = [int(x) for x in a.lengths.split(",")]
    sh = a.shape
    print(f"## Measured on this machine ({a.device}, float32, batch 1, {a.steps} TTT steps; "
          f"draft H={sh['hidden']}, {sh['heads']} heads ({sh['kv_heads']} kv), intermediate "
          f"{sh['intermediate']}, draft vocab {sh['draft_vocab']}, verifier vocab "
          f"{sh['target_vocab']}; block {a.block}, loss chunk {a.chunk})\n")
    print("| T | dense: peak growth | dense: s/step | linear: peak growth | linear: s/step "
          "| memory ratio | time ratio | linear: kept (meta count) |")
    print("|---|---|---|---|---|---|---|---|")
    prev = {}
    rows = []
    for t in lengths:
        dense = measure("dense", t, a) if t <= a.dense_max else {"error": "skipped"}
        new = measure("linear", t, a)
        kept = kept_bytes("linear", a.shape, t, a.steps, a.block, a.chunk) / 2 ** 20
        rows.append((t, dense, new))

        def cell(m, key):
            if "error" in m:
                return m["error"][:40]
            return fmt_mb(m["grow_mb"]) if key == "grow_mb" else f"{m['seconds']:.2f}"

        ratio_m = (f"{dense['grow_mb'] / new['grow_mb']:.1f}x" if "error" not in dense
                   and "error" not in new and new["grow_mb"] > 0 else "-")
        ratio_t = (f"{new['seconds'] / dense['seconds']:.2f}" if "error" not in dense
                   and "error" not in new else "-")
        print(f"| {t} | {cell(dense, 'grow_mb')} | {cell(dense, 'seconds')} | "
              f"{cell(new, 'grow_mb')} | {cell(new, 'seconds')} | {ratio_m} | {ratio_t} | "
              f"{fmt_mb(kept)} |", flush=True)
        prev[t] = (dense, new)
    print("\nGrowth per doubling of T (peak growth ratio):")
    for (t0, d0, n0), (t1, d1, n1) in zip(rows, rows[1:]):
        if t1 != 2 * t0:
            continue
        dr = (f"{d1['grow_mb'] / d0['grow_mb']:.2f}" if "error" not in d0 and "error" not in d1
              else "-")
        nr = f"{n1['grow_mb'] / n0['grow_mb']:.2f}" if "error" not in n0 and "error" not in n1 else "-"
        print(f"  {t0} -> {t1}: dense x{dr}, linear x{nr}")


def extrapolation(a: argparse.Namespace) -> None:
    steps, block, chunk = a.steps, a.block, a.chunk
    print(f"\n## Extrapolation to real draft shapes ({steps} TTT steps, batch 1, float32 "
          f"training, block {block}, loss chunk {chunk})\n")
    print("Kept activations counted on the meta device at T = 8K, 16K, 32K (linear: exactly "
          "linear, so per-token bytes extend to any T; dense: its T^2 term fitted from the "
          "same three points).\n")
    print("| draft shape | trained params | fixed | linear: kept per token | dense: kept at 32K "
          "| longest T, 80 GB: dense / linear | longest T, 141 GB: dense / linear |")
    print("|---|---|---|---|---|---|---|")
    for name, shape in REAL.items():
        h, v, vd = shape["hidden"], shape["target_vocab"], shape["draft_vocab"]
        draft, _, _ = build(shape, 8, "meta", block)
        trained = sum(p.numel() for p in draft.parameters() if p.requires_grad)
        frozen = draft.embed_tokens.weight.numel() + v * h  # embedding + verifier head
        fixed = 16 * trained + 4 * frozen
        ts = [8192, 16384, 32768]
        lin = [kept_bytes("linear", shape, t, steps, block, chunk) for t in ts]
        den = [kept_bytes("dense", shape, t, steps, block, chunk) for t in ts]
        per_tok = (lin[2] - lin[0]) / (ts[2] - ts[0])
        # dense: a + b T + c T^2 through the three points
        import numpy as np

        c2, c1, c0 = np.polyfit(np.array(ts, float), np.array(den, float), 2)

        def peak(t: int, dense: bool) -> float:
            batch = t * 4 * h * 2  # aux 3H + last H, bf16
            if dense:
                act = c0 + c1 * t + c2 * t * t
                transient = 4 * 4 * shape["heads"] * t * t
            else:
                act = lin[0] + per_tok * (t - ts[0])
                transient = 4 * 4 * max(shape["heads"] * block * t, min(chunk, t) * vd)
            return fixed + batch + act + transient

        def longest(budget_gb: float, dense: bool) -> str:
            budget = 0.9 * budget_gb * 1e9
            best = 0
            t = 256
            while t <= 1 << 22 and peak(t, dense) <= budget:
                best, t = t, t * 2
            if best == 0:
                return "none"
            lo, hi = best, best * 2  # refine between powers of two
            while hi - lo > 256:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if peak(mid, dense) <= budget else (lo, mid)
            return f"{lo // 1024}K" if lo >= 1024 else str(lo)

        print(f"| {name} (H={h}, {shape['heads']} heads, I={shape['intermediate']}, "
              f"vocab {v}) | {trained / 1e6:.0f}M | {fixed / 1e9:.1f} GB | "
              f"{per_tok / 2 ** 20:.2f} MB | {den[2] / 1e9:.0f} GB | "
              f"{longest(80, True)} / {longest(80, False)} | "
              f"{longest(141, True)} / {longest(141, False)} |", flush=True)
        if name == "Llama-3-8B":
            t32 = 32768
            print(f"|  ↳ Llama-3-8B draft at T=32K: linear peak {peak(t32, False) / 1e9:.1f} GB, "
                  f"dense {peak(t32, True) / 1e9:.0f} GB | | | | | | |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", default="512,1024,2048,4096,8192,16384")
    p.add_argument("--dense-max", type=int, default=4096,
                   help="longest T the dense implementation is run at (it grows as T^2)")
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--block", type=int, default=512)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cuda: measure on the GPU (allocator peak) instead of the CPU (RSS)")
    p.add_argument("--real", default=None, choices=sorted(REAL),
                   help="measure a real draft shape (e.g. Llama-3-8B on a GPU) instead of "
                        "the small one")
    p.add_argument("--skip-measured", action="store_true")
    p.add_argument("--skip-extrapolation", action="store_true")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--impl", default="linear", help=argparse.SUPPRESS)
    p.add_argument("--t", type=int, default=512, help=argparse.SUPPRESS)
    p.add_argument("--shape", default=json.dumps(SMALL), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        child(a)
        return
    a.shape = REAL[a.real] if a.real else SMALL
    import torch

    print(f"# bench/ttt_memory.py — {time.strftime('%Y-%m-%d %H:%M')}, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs\n")
    if not a.skip_measured:
        measured_table(a)
    if not a.skip_extrapolation:
        extrapolation(a)


if __name__ == "__main__":
    main()
