"""One optimizer step of an EAGLE-3 draft at a real model's shape: eagle3x or speculators 0.9,
each on its own GPU recipe, in this process. Prints one json object.

    python bench/gpu_step.py --impl eagle3x --length 4096            # Llama-3-8B draft shape
    python bench/gpu_step.py --impl peer --length 4096 --peer-site /tmp/site
    python bench/gpu_step.py --impl eagle3x --shape smoke --length 64 --device cpu
    python bench/gpu_step.py --check                                  # fused vs reference

The step, as each trainer runs it (bench/gpu_check.py runs one process per point):
  eagle3x: `ttt_step_metrics` (training-time test, fused attention where the device has
           it, the fused soft cross-entropy, accuracy every trainer.log_every_n_steps=10
           steps as the Lightning module computes it: the timed steps leave it out, one
           extra step with it is timed on its own) under autocast bf16 over float32 weights,
           backward, gradient clipping at 0.5, AdamW (fused on CUDA). The batch carries the
           trained positions the loader computes on the host (datamodule.with_positions).
  peer:    speculators' `Eagle3DraftModel.forward` (compiled by speculators itself on CUDA,
           `conditional_torch_compile`), flex attention ("simple_flex_attention", its
           default; `--peer-attn`), its KL loss ("fused" Triton by default, `--peer-loss`),
           under autocast bf16 over float32 weights as its Trainer.train_epoch runs it,
           zero_grad, backward, clip_grad_norm_(1.0), AdamW.
Same shapes for both: hidden, heads, kv heads, head_dim, intermediate, verifier vocab, draft
vocab, T, TTT steps, one sequence, every position trained, aux and last hidden states in
bf16. Weights are random (speed and memory do not depend on them; tests/draft and
bench/peer_train.py --check hold the two computations equal on the CPU).

Figures: `first_step_s` (including any compilation), `step_s` (median of the timed steps),
`tokens_per_second` = T / step_s, `peak_growth_gb` = the device's peak allocated memory
during the steps minus what was allocated before the first (model, inputs: so gradients,
optimizer state and activations), `accuracy_step_s`.

--check: at a small shape on this device, the training-time test's per-step logits, loss
and gradients of the fused path and of the reference path, both in bf16 autocast, against
the reference in float32: their relative errors, and whether the fused path is within the
stated tolerance (relative error of the loss <= 2e-2 and of every gradient <= 5e-2, and no
worse than 1.5x the reference path's own bf16 error plus 1e-3).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SHAPES = {
    # Llama-3-8B's draft: the verifier's hidden size, heads and MLP, its vocabulary
    "llama3-8b": dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336,
                      target_vocab=128256, draft_vocab=32000, eps=1e-5, rope_theta=500000.0),
    "smoke": dict(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128,
                  target_vocab=512, draft_vocab=128, eps=1e-6, rope_theta=10000.0),
}


def to_device(value, device):
    """A batch entry on `device` (lists of tensors too; host ints stay as they are)."""
    if isinstance(value, list):
        return [x.to(device) for x in value]
    return value.to(device) if hasattr(value, "to") else value


def sync(device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize()


def autocast(device):
    import torch
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def hidden_dtype(device):
    import torch
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def documents(length: int, doc_len: int):
    """A packed row of `length` positions cut into documents of `doc_len` (the last
    shorter), as datamodule.collate_packed lays them out: docs, positions, doc_end,
    cu_seqlens (host tensors)."""
    import torch

    starts = list(range(0, length, doc_len))
    docs = torch.zeros(1, length, dtype=torch.long)
    positions = torch.zeros(1, length, dtype=torch.long)
    doc_end = torch.zeros(1, length, dtype=torch.long)
    for d, a in enumerate(starts):
        e = min(a + doc_len, length)
        docs[0, a:e], positions[0, a:e], doc_end[0, a:e] = d, torch.arange(e - a), e
    cu = torch.tensor(starts + [length], dtype=torch.int32)
    return {"docs": docs, "positions": positions, "doc_end": doc_end, "cu_seqlens": cu}


def eagle3x_step(shape: dict, length: int, steps: int, device, doc_len: int = 0,
                 trained: float = 1.0):
    """(params, step(accuracy) -> None) for eagle3x's draft at `shape`; with `doc_len`,
    the row packs documents of that length (else one sequence); `trained`: the share of
    positions in the loss (seeded at random; 1: all)."""
    import torch

    from eagle3x.data.datamodule import with_positions
    from eagle3x.draft.model import DraftShape, Eagle3Draft
    from eagle3x.draft.ttt import ttt_step_metrics

    s = DraftShape(hidden_size=shape["hidden"], target_hidden_size=shape["hidden"],
                   intermediate_size=shape["intermediate"], num_heads=shape["heads"],
                   num_kv_heads=shape["kv_heads"], head_dim=shape["head_dim"],
                   draft_vocab_size=shape["draft_vocab"], target_vocab_size=shape["target_vocab"],
                   rms_norm_eps=shape["eps"], rope_theta=shape["rope_theta"],
                   max_position_embeddings=max(length, 4096))
    vd, vt, h = shape["draft_vocab"], shape["target_vocab"], shape["hidden"]
    with torch.device(device):
        draft = Eagle3Draft(s, torch.zeros(vd, dtype=torch.long), torch.arange(vt) < vd)
        draft.embed_tokens.weight.requires_grad_(False)
        head = torch.randn(vt, h) * 0.02  # the verifier head, float32 as DraftModule keeps it
        dt = hidden_dtype(device)
        host = {"input_ids": torch.randint(0, vt, (1, length), device="cpu"),
                "loss_mask": (torch.rand(1, length, generator=torch.Generator().manual_seed(0),
                                         device="cpu") < trained).to(torch.uint8),
                "lengths": torch.tensor([length], device="cpu")}
        if doc_len:
            with torch.device("cpu"):
                host.update(documents(length, doc_len))
        host = with_positions(host, steps)
        batch = {k: to_device(v, device)
                 for k, v in host.items()}
        batch["aux_hidden"] = torch.randn(1, length, 3 * h, dtype=dt)
        batch["last_hidden"] = torch.randn(1, length, h, dtype=dt)
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95),
                            fused=device.type == "cuda" or None)

    def step(accuracy: bool = False) -> None:
        with autocast(device):
            m = ttt_step_metrics(draft, batch, head, steps, 0.8, accuracy=accuracy)
        m["loss"].backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return draft, step


def peer_step(shape: dict, length: int, steps: int, device, attn: str, loss_impl: str):
    """(module, step(accuracy) -> None) for speculators 0.9's Eagle3DraftModel."""
    import torch
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    vd, vt, h = shape["draft_vocab"], shape["target_vocab"], shape["hidden"]
    layer = LlamaConfig(hidden_size=h, intermediate_size=shape["intermediate"],
                        num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                        head_dim=shape["head_dim"], vocab_size=vt, num_hidden_layers=1,
                        rms_norm_eps=shape["eps"], rope_theta=shape["rope_theta"],
                        max_position_embeddings=max(length + steps + 1, 4096),
                        attention_bias=False, mlp_bias=False)
    layer._attn_implementation = attn
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=vd, norm_before_residual=False,
        embed_requires_grad=False,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", default_proposal_method="greedy",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=steps)],
            verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"])))
    with torch.device(device):
        model = Eagle3DraftModel(config)
        model.load_vocab_mappings(torch.arange(vt) < vd, torch.zeros(vd, dtype=torch.long))
    model.to(device).train()
    dt = hidden_dtype(device)
    with torch.device(device):
        kwargs = dict(hidden_states=torch.randn(1, length, 3 * h, dtype=dt),
                      input_ids=torch.randint(0, vt, (1, length)),
                      document_ids=torch.zeros(1, length, dtype=torch.long),
                      loss_mask=torch.ones(1, length, dtype=torch.bool),
                      position_ids=torch.arange(1, length + 1)[None],
                      verifier_last_hidden_states=torch.randn(1, length, h, dtype=dt),
                      ttt_steps=steps, ttt_step_loss_decay=0.8,
                      loss_config=resolve_loss_config("kl_div", loss_impl))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)

    def step(accuracy: bool = False) -> None:  # its metrics come with every step
        with autocast(device):
            _tokens, loss, _metrics = model(**kwargs)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()

    return model, step


def measure(args) -> dict:
    import torch

    device = torch.device(args.device)
    shape = json.loads(args.shape_json) if args.shape_json else SHAPES[args.shape]
    res = {"impl": args.impl, "length": args.length, "ttt_steps": args.steps,
           "shape": "custom" if args.shape_json else args.shape, "dims": shape,
           "device": str(device), "torch": torch.__version__}
    if device.type == "cuda":
        res["gpu"] = torch.cuda.get_device_name(0)
    t0 = time.perf_counter()
    if args.impl == "peer":
        res.update(peer_attn=args.peer_attn, peer_loss=args.peer_loss)
        _, step = peer_step(shape, args.length, args.steps, device, args.peer_attn, args.peer_loss)
    else:
        import eagle3x.draft.model as model

        impl = {"eagle3x": "auto", "eagle3x-reference": "reference"}[args.impl]
        model.Attention.impl = impl
        draft, step = eagle3x_step(shape, args.length, args.steps, device, args.doc_len,
                                   args.trained_fraction)
        res.update(doc_len=args.doc_len or args.length, trained_fraction=args.trained_fraction)
        with autocast(device):  # what the training step's attention takes
            res["attention"] = ("fused" if draft.midlayer.self_attn.uses_fused(
                torch.zeros(1, device=device)) else "reference")
    sync(device)
    res["setup_s"] = round(time.perf_counter() - t0, 3)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    step()
    sync(device)
    res["first_step_s"] = round(time.perf_counter() - t0, 3)
    times = []
    deadline = time.perf_counter() + args.budget_s
    for _ in range(args.timed):
        t0 = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - t0)
        if time.perf_counter() > deadline:
            break
    res["step_s"] = statistics.median(times)
    res["steps_timed"] = len(times)
    res["tokens_per_second"] = args.length / res["step_s"]
    t0 = time.perf_counter()
    step(True)
    sync(device)
    res["accuracy_step_s"] = round(time.perf_counter() - t0, 4)
    if device.type == "cuda":
        res["peak_growth_gb"] = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
    return res


def check(args) -> dict:
    """Fused vs reference attention on this device, both in bf16 autocast (float32 on a
    CPU without --check-dtype bf16), against the reference in float32."""
    import torch

    from eagle3x.data.datamodule import collate_packed
    from eagle3x.draft.model import DraftShape, Eagle3Draft
    from eagle3x.draft.ttt import ttt_step_metrics

    device = torch.device(args.device)
    small = device.type != "cuda"
    h, heads, kv, hd = (64, 4, 2, 16) if small else (512, 8, 2, 64)
    vt, vd, steps = 512, 128, 4
    s = DraftShape(hidden_size=h, target_hidden_size=h, intermediate_size=2 * h, num_heads=heads,
                   num_kv_heads=kv, head_dim=hd, draft_vocab_size=vd, target_vocab_size=vt)
    g = torch.Generator().manual_seed(0)
    lengths = [97, 31, 250, 64, 7] if small else [700, 300, 1500, 90, 1300]
    samples = [{"input_ids": torch.randint(0, vt, (n,), generator=g),
                "loss_mask": torch.randint(0, 2, (n,), generator=g, dtype=torch.uint8),
                "aux_hidden": torch.randn(n, 3 * h, generator=g),
                "last_hidden": torch.randn(n, h, generator=g)} for n in lengths]
    host = collate_packed(samples, steps=steps, width=sum(lengths) // 2 + 300)
    batch = {k: to_device(v, device)
             for k, v in host.items()}
    torch.manual_seed(0)
    draft = Eagle3Draft(s, torch.zeros(vd, dtype=torch.long), torch.arange(vt) < vd).to(device)
    head = (torch.randn(vt, h, generator=g) * 0.05).to(device)
    half = device.type == "cuda" or args.check_dtype == "bf16"

    def run(impl: str, low: bool):
        draft.midlayer.self_attn.impl = impl
        draft.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=low):
            m = ttt_step_metrics(draft, batch, head, steps, 0.8)
        m["loss"].backward()
        return (float(m["loss"].detach()),
                {n: p.grad.detach().float().clone() for n, p in draft.named_parameters()
                 if p.grad is not None})

    truth_loss, truth_grads = run("reference", False)
    out = {"device": str(device), "dtype": "bf16 autocast" if half else "float32",
           "tokens": int(host["lengths"].sum()), "rows": int(host["input_ids"].shape[0])}
    for impl in ("reference", "fused"):
        loss, grads = run(impl, half)
        rel = {n: float((grads[n] - truth_grads[n]).norm() / truth_grads[n].norm().clamp(min=1e-12))
               for n in truth_grads}
        out[impl] = {"loss_rel_err": abs(loss - truth_loss) / max(abs(truth_loss), 1e-12),
                     "grad_rel_err_max": max(rel.values()),
                     "worst_grad": max(rel, key=rel.get)}
    f, r = out["fused"], out["reference"]
    out["ok"] = bool(f["loss_rel_err"] <= 2e-2 and f["grad_rel_err_max"] <= 5e-2
                     and f["grad_rel_err_max"] <= 1.5 * r["grad_rel_err_max"] + 1e-3)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--impl", choices=["eagle3x", "eagle3x-reference", "peer"], default="eagle3x")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--steps", type=int, default=7, help="training-time-test steps")
    p.add_argument("--trained-fraction", type=float, default=1.0,
                   help="eagle3x: share of positions in the loss (the data's, for a loop comparison)")
    p.add_argument("--doc-len", type=int, default=0,
                   help="eagle3x: pack documents of this many tokens into the row (0: one)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--shape-json", default=None, help="a shape of its own (SHAPES' fields)")
    p.add_argument("--device", default=None)
    p.add_argument("--timed", type=int, default=5)
    p.add_argument("--budget-s", type=float, default=30.0, help="stop timing after this long")
    p.add_argument("--peer-site", default=os.environ.get("EAGLE3X_PEER_SITE"))
    p.add_argument("--peer-attn", default="simple_flex_attention")
    p.add_argument("--peer-loss", default="fused", choices=["fused", "eager"])
    p.add_argument("--check", action="store_true")
    p.add_argument("--check-dtype", default="float32", choices=["float32", "bf16"])
    args = p.parse_args()
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    sys.path.insert(0, str(REPO))
    if args.impl == "peer":
        # speculators from the carried site; its module-level openai / datasets imports
        # answered by placeholders (bench/peer_stubs/README.md)
        sys.path[:0] = [p for p in (args.peer_site, str(REPO / "bench" / "peer_stubs")) if p]
    try:
        res = check(args) if args.check else measure(args)
    except BaseException as exc:  # one json line either way
        res = {"impl": args.impl, "length": args.length, "error": f"{type(exc).__name__}: {exc}"[:1500],
               "trace": traceback.format_exc()[-2500:]}
    print(json.dumps(res), flush=True)
    sys.exit(0 if "error" not in res else 1)


if __name__ == "__main__":
    main()
