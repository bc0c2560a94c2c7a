"""One EAGLE-3 training forward+backward: eagle3x vs vllm-project/speculators 0.9.0, side by side.

    python bench/peer_train.py                 # defaults: about 10 min on one core
    python bench/peer_train.py --lengths 512,1024 --hidden 512 --heads 4 --kv-heads 4 ...
    python bench/peer_train.py --only peer --lengths 1024 --peer-lm-head trained

Installing the peer (kept out of eagle3x's venv; any pip will do):
    pip install --no-deps --target /work/peer-site speculators==0.9.0 hs-connectors
Its runtime dependencies (pydantic, pydantic-settings, loguru, datasets, transformers, ...)
are already in eagle3x's venv; nothing else was needed. The folder is `--peer-site`, else
$EAGLE3X_PEER_SITE, else `peer-site` next to the repository (../peer-site from the repo
root). It goes on sys.path only in the subprocesses that build the peer (and in --check's).

What is measured
    For each sequence length T and each implementation, one training step minus the
    optimizer: the implementation's own loss from the raw inputs (teacher logits included),
    then `loss.backward()`; batch 1, float32, CPU, no autocast, no torch.compile.
      eagle3x : `ttt_step_metrics(draft, batch, head, steps, step_weight)["loss"]` on an
                `Eagle3Draft`, as DraftModule trains it, with that code's default knobs -
                whatever eagle3x/draft/{model,ttt}.py hold when each child starts (each
                eagle3x point records a digest of those two files; the tree was being edited).
      peer    : `speculators.models.eagle3.Eagle3DraftModel(config).forward(...,
                verifier_last_hidden_states=..., ttt_steps=...)`, which returns (draft tokens,
                loss, metrics); config = `Eagle3SpeculatorConfig` around a one-layer
                `LlamaConfig`, random weights, no verifier checkpoint, nothing downloaded.
    Time: median of up to `--repeats` timed runs after `--warmup` untimed ones. The warmup
    runs use `--warmup-steps` TTT steps (default 2: same T, same kernels and shapes, a
    fraction of the time). Timed runs stop once they add up to `--budget-s` (at least one
    is kept), so the long sizes get one. tokens/s = T / median wall seconds. Process CPU
    time is recorded as well; with the default single torch thread wall ~= CPU time when the
    machine is quiet, and the printed "% of core busy" exposes contention. One thread
    because this 2-core VM is shared: two OpenMP threads stall on each other whenever a
    neighbour takes a core (measured: 2-3x run-to-run swings), one thread does not.
    Memory: each (implementation, T) runs in a fresh subprocess. Once model, inputs and
    verifier head exist, the kernel's RSS high-water mark is reset (write "5" to
    /proc/self/clear_refs) and the current RSS noted; peak = VmHWM at the end minus that
    baseline: activations, autograd state, gradients, masks, allocator slack. Where
    clear_refs is not writable the fallback is ru_maxrss growth over its value at the
    baseline (an underestimate only if construction spiked above the training peak). Grads
    are set to None before each run (as zero_grad does), so the peak includes allocating
    them. A size is skipped when a fit through the implementation's previous peaks (a*T +
    c*T^2) predicts more than `--mem-limit-gb`, and a watchdog thread stops a child whose
    RSS crosses it; both are reported.

Same function, same inputs
    Same H, heads, kv heads, head_dim, intermediate size, draft/target vocab, T, TTT steps
    and loss decay; the same seeded tensors: input ids, auxiliary hidden states [1,T,3H],
    verifier last hidden states [1,T,H], embedding table, verifier head (draft vocab = the
    first Vd target ids: d2t = zeros, t2d = first Vd True), and every draft weight drawn from
    a per-name seed. The peer gets the sequence as its shift_batch() leaves it (position i
    reads token x[i+1] with the features of x[i], positions from 1), so both run the same
    T positions. `--check` (default on) first runs both in one process at --check-length and
    requires their per-step draft logits to agree to float32 tolerance: the two compute the
    same draft (same TTT attention pattern: causal over step 0, same position for later
    steps; same token feeding; same residual/norm placement).

What differs (each as its own trainer runs it; the flags switch some of it)
  * Attention. speculators' TTT appends every step's keys/values to a DynamicCache, so
    step k attends over (k+1)*T keys through a mask (causal on the first T, diagonal on the
    rest). Its default `simple_flex_attention` cannot train on CPU at all: torch raises
    "NotImplementedError: FlexAttention does not support backward on CPU"
    (torch/nn/attention/flex_attention.py, _validate_device, reached from
    speculators/models/attention.py flex_attention_forward), compiled or not - and the model
    compiles only under CUDA anyway (conditional_torch_compile, speculators/models/utils.py).
    Its documented fallback `draft_attn_impl` "sdpa" | "eager" ("for hardware that doesn't
    support flex attention", speculators/train/config/schema.py) builds dense masks
    [T, (k+1)*T]: sdpa (default here, `--peer-attn`) runs the fused CPU kernel, computing
    the masked-out blocks but keeping no score matrix; eager keeps the [heads, T, (k+1)*T]
    probabilities for backward. On a GPU with compiled flex attention the peer skips the
    masked blocks, which this CPU benchmark cannot show.
  * Loss. speculators' default losses are Triton kernels ("fused"; loss_config=None also
    means the fused KL); on CPU Triton fails with "RuntimeError: 0 active drivers"
    (triton/runtime/driver.py, from speculators/losses/fused.py). Its documented
    `loss_implementation="eager"` KL is used (`--peer-loss`). Forms: speculators,
    KL(p || q) with teacher p = softmax(verifier_lm_head(verifier_norm(last))) over the
    draft vocab only, each step a mean over T-k positions, weighted decay**k. eagle3x: soft
    cross-entropy (= KL + teacher entropy: same gradient) against the verifier head applied
    to the stored (already normed) last states, over the draft vocab, plus the verifier's
    greedy token over the full target vocab for accuracy; steps over the T-2-k positions
    with a next token, weighted step_weight**k. Both compute per-step accuracies.
  * Trainable parameters. speculators freezes the draft lm_head (DraftVocabMixin) and the
    embeddings; eagle3x trains lm_head and freezes the embeddings (freeze_embeddings=true).
    `--peer-lm-head trained` gives the peer eagle3x's parameter set.
  * Left out of both: optimizer step and state, grad clipping, data loading, and the
    peer's autocast (its trainer runs under autocast to hidden_states_dtype; here fp32).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import re
import resource
import statistics
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PEER_SITE = os.environ.get("EAGLE3X_PEER_SITE") or str(REPO.parent / "peer-site")
MODELS = ("eagle3x", "peer")


# ---------------------------------------------------------------------------- memory probes

def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE).group(1))


def reset_peak() -> str:
    """Reset the RSS high-water mark if the kernel lets us; return the method in use."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return "VmHWM reset"
    except OSError:
        return "ru_maxrss growth"


def peak_kb(method: str) -> int:
    if method == "VmHWM reset":
        return _status_kb("VmHWM")
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kB on Linux


def watchdog(limit_kb: int) -> None:
    """Stop this process (exit 3) when its RSS crosses limit_kb, before the machine swaps
    or the OOM killer picks someone else's process."""
    def loop() -> None:
        while True:
            if _status_kb("VmRSS") > limit_kb:
                sys.stderr.write(f"watchdog: RSS over {limit_kb / 2**20:.1f} GB\n")
                sys.stderr.flush()
                os._exit(3)
            time.sleep(0.02)
    threading.Thread(target=loop, daemon=True).start()


# ------------------------------------------------------------------- shared inputs/weights

def seeded(shape, seed_name: str, scale: float = 0.02):
    """A float32 normal tensor drawn from a seed derived from its name, so that two
    processes (or two implementations) get bit-identical tensors."""
    import torch
    g = torch.Generator().manual_seed(zlib.crc32(seed_name.encode()))
    return torch.randn(*shape, generator=g) * scale


def shared_inputs(cfg: dict) -> dict:
    """Everything the two implementations share: one packed sequence of T tokens."""
    import torch
    T, H, Vt = cfg["length"], cfg["hidden"], cfg["target_vocab"]
    g = torch.Generator().manual_seed(1234)
    return {
        "ids": torch.randint(0, Vt, (1, T), generator=g),
        "aux": seeded((1, T, 3 * H), f"aux{T}", 1.0),
        "last": seeded((1, T, H), f"last{T}", 1.0),
        "embed": seeded((Vt, H), "embed_tokens"),
        "head": seeded((Vt, H), "verifier_head"),
    }


def layer_weights(cfg: dict) -> dict:
    """Draft weights by eagle3x parameter name (midlayer.*, fc, norm); RMSNorm gains = 1."""
    H, I = cfg["hidden"], cfg["intermediate"]
    q, kv = cfg["heads"] * cfg["head_dim"], cfg["kv_heads"] * cfg["head_dim"]
    shapes = {"fc.weight": (H, 3 * H),
              "midlayer.self_attn.q_proj.weight": (q, 2 * H),
              "midlayer.self_attn.k_proj.weight": (kv, 2 * H),
              "midlayer.self_attn.v_proj.weight": (kv, 2 * H),
              "midlayer.self_attn.o_proj.weight": (H, q),
              "midlayer.mlp.gate_proj.weight": (I, H),
              "midlayer.mlp.up_proj.weight": (I, H),
              "midlayer.mlp.down_proj.weight": (H, I)}
    return {name: seeded(shape, name) for name, shape in shapes.items()}


# ------------------------------------------------------------------------ the two builders

def build_eagle3x(cfg: dict, x: dict):
    """eagle3x's draft as DraftModule builds it (embeddings frozen, lm_head = verifier rows).
    Returns (module, step, logits): step(steps) -> the training loss; logits() -> the
    per-step draft logits, for --check."""
    import torch

    from eagle3x.draft.model import DraftShape, Eagle3Draft
    from eagle3x.draft.ttt import ttt_step_metrics

    H, Vd, Vt = cfg["hidden"], cfg["draft_vocab"], cfg["target_vocab"]
    shape = DraftShape(hidden_size=H, target_hidden_size=H, intermediate_size=cfg["intermediate"],
                       num_heads=cfg["heads"], num_kv_heads=cfg["kv_heads"],
                       head_dim=cfg["head_dim"], draft_vocab_size=Vd, target_vocab_size=Vt,
                       rms_norm_eps=cfg["eps"], rope_theta=cfg["rope_theta"],
                       max_position_embeddings=max(cfg["length"], 4096))
    d2t = torch.zeros(Vd, dtype=torch.long)  # draft id i is target id i
    t2d = torch.arange(Vt) < Vd
    draft = Eagle3Draft(shape, d2t, t2d)
    with torch.no_grad():
        for name, w in layer_weights(cfg).items():
            draft.get_parameter(name).copy_(w)
        draft.embed_tokens.weight.copy_(x["embed"])
        draft.lm_head.weight.copy_(x["head"][:Vd])
    draft.embed_tokens.weight.requires_grad_(False)  # train.freeze_embeddings defaults to true
    T = cfg["length"]
    batch = {"input_ids": x["ids"], "loss_mask": torch.ones(1, T), "lengths": torch.tensor([T]),
             "aux_hidden": x["aux"], "last_hidden": x["last"]}

    def step(steps: int = cfg["ttt_steps"]):
        return ttt_step_metrics(draft, batch, x["head"], steps, cfg["step_weight"])["loss"]

    def logits():  # for --check: the unrolled draft alone, as ttt_step_metrics feeds it
        from eagle3x.draft.ttt import shift
        ids = batch["input_ids"]
        tokens = torch.cat([shift(ids, 1), ids.new_zeros(1, cfg["ttt_steps"])], dim=1)
        return draft.unroll(batch["aux_hidden"], tokens, cfg["ttt_steps"])

    return draft, step, logits


def build_peer(cfg: dict, x: dict):
    """speculators' Eagle3DraftModel from a config (no verifier checkpoint, nothing downloaded),
    with the shared weights copied in. The peer's sequence is x's ids shifted by one, as its
    shift_batch() leaves it: position i reads token x[i+1] with the hidden state of x[i].
    Returns (module, step, logits) like build_eagle3x."""
    import torch
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    H, Vd, Vt, T = cfg["hidden"], cfg["draft_vocab"], cfg["target_vocab"], cfg["length"]
    layer = LlamaConfig(hidden_size=H, intermediate_size=cfg["intermediate"],
                        num_attention_heads=cfg["heads"], num_key_value_heads=cfg["kv_heads"],
                        head_dim=cfg["head_dim"], vocab_size=Vt, num_hidden_layers=1,
                        rms_norm_eps=cfg["eps"], rope_theta=cfg["rope_theta"],
                        max_position_embeddings=max(T + cfg["ttt_steps"] + 1, 4096),
                        attention_bias=False, mlp_bias=False)
    layer._attn_implementation = cfg["peer_attn"]  # what --draft-attn-impl sets
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=Vd, norm_before_residual=False,
        embed_requires_grad=False,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", default_proposal_method="greedy",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=cfg["ttt_steps"])],
            verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"])))
    model = Eagle3DraftModel(config)
    t2d = torch.arange(Vt) < Vd
    model.load_vocab_mappings(t2d, torch.zeros(Vd, dtype=torch.long))
    with torch.no_grad():
        for name, w in layer_weights(cfg).items():
            model.get_parameter(name.replace("midlayer.", "layers.0.")).copy_(w)
        # what load_verifier_weights() would load from the verifier checkpoint
        model.embed_tokens.weight.copy_(x["embed"])
        model.lm_head.weight.copy_(x["head"][t2d])
        model.verifier_lm_head.weight.copy_(x["head"][t2d])
    model.lm_head.weight.requires_grad_(cfg["peer_lm_head"] == "trained")
    model.train()
    loss_config = resolve_loss_config("kl_div", cfg["peer_loss"])
    ids = torch.cat([x["ids"][:, 1:], x["ids"].new_zeros(1, 1)], dim=1)
    kwargs = dict(hidden_states=x["aux"], input_ids=ids,
                  document_ids=torch.zeros(1, T, dtype=torch.long),
                  loss_mask=torch.ones(1, T, dtype=torch.bool),
                  position_ids=torch.arange(1, T + 1)[None],  # shift_batch starts them at 1
                  verifier_last_hidden_states=x["last"], ttt_steps=cfg["ttt_steps"],
                  ttt_step_loss_decay=cfg["step_weight"], loss_config=loss_config)

    def step(steps: int = cfg["ttt_steps"]):
        _tokens, loss, _metrics = model(**dict(kwargs, ttt_steps=steps))
        return loss

    def logits():  # for --check: capture lm_head's output at each TTT step
        out = []
        hook = model.lm_head.register_forward_hook(lambda m, i, o: out.append(o))
        try:
            model(**kwargs)
        finally:
            hook.remove()
        return out

    return model, step, logits


BUILDERS = {"eagle3x": build_eagle3x, "peer": build_peer}


def source_digest() -> str:
    """Which eagle3x draft code a child measured: the working tree may change between
    children (it is being edited), so each eagle3x point carries a digest of the two files."""
    import hashlib

    import eagle3x.draft.model as m
    import eagle3x.draft.ttt as t
    h = hashlib.sha256()
    for mod in (m, t):
        h.update(Path(mod.__file__).read_bytes())
    return "eagle3x draft src " + h.hexdigest()[:10]


def git_describe() -> str:
    """HEAD and whether eagle3x/ has uncommitted changes (read-only git calls)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True,
                              capture_output=True, check=False).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "eagle3x"], cwd=REPO,
                               text=True, capture_output=True, check=False).stdout.strip()
        return f"git {head}{' + uncommitted eagle3x/ changes' if dirty else ''}"
    except OSError:
        return "git unavailable"


def peer_version() -> str:
    from importlib.metadata import version
    return f"speculators {version('speculators')}"


# ------------------------------------------------------------------------------ subprocesses

def child_measure(cfg: dict) -> dict:
    """One (implementation, T) point; runs in its own process. Prints a JSON line."""
    import torch
    torch.set_num_threads(cfg["threads"])
    if cfg["model"] == "peer":
        sys.path.insert(0, cfg["peer_site"])
    x = shared_inputs(cfg)
    module, step, _ = BUILDERS[cfg["model"]](cfg, x)
    params = [p for p in module.parameters() if p.requires_grad]
    version = source_digest() if cfg["model"] == "eagle3x" else peer_version()
    gc.collect()
    method = reset_peak()
    base_kb = _status_kb("VmRSS") if method == "VmHWM reset" else peak_kb(method)
    watchdog(int(cfg["mem_limit_gb"] * 2**20) + _status_kb("VmRSS"))
    times, cpu, warm, loss = [], [], [], float("nan")
    for i in range(cfg["warmup"] + cfg["repeats"]):
        for p in params:
            p.grad = None
        steps = cfg["ttt_steps"]
        if i < cfg["warmup"] and cfg["warmup_steps"]:
            steps = min(cfg["warmup_steps"], steps)
        t0, c0 = time.perf_counter(), time.process_time()
        out = step(steps)
        out.backward()
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        loss = float(out.detach())
        if i >= cfg["warmup"]:
            times.append(dt)
            cpu.append(dc)
            if sum(times) >= cfg["budget_s"]:
                break
        else:
            warm.append(dt)
    res = {"model": cfg["model"], "length": cfg["length"], "seconds": statistics.median(times),
           "times": times, "cpu_seconds": statistics.median(cpu), "warmup_times": warm,
           "version": version, "peak_mb": (peak_kb(method) - base_kb) / 1024,
           "base_mb": base_kb / 1024, "mem_method": method, "loss": loss,
           "trainable_params": sum(p.numel() for p in params),
           "grads_ok": all(p.grad is not None for p in params)}
    print(json.dumps(res), flush=True)
    return res


def child_check(cfg: dict) -> None:
    """Both implementations in one process on the same inputs and weights: their per-step
    draft logits must agree (same function), and both losses must be finite."""
    import torch
    torch.set_num_threads(cfg["threads"])
    sys.path.insert(0, cfg["peer_site"])
    x = shared_inputs(cfg)
    report = {}
    with torch.no_grad():
        ours = BUILDERS["eagle3x"](cfg, x)[2]()
        theirs = BUILDERS["peer"](cfg, x)[2]()
    T = cfg["length"]
    diffs = []
    for k, (a, b) in enumerate(zip(ours, theirs)):
        n = T - k - 1  # positions whose tokens are real in both (the tails pad differently)
        diffs.append(float((a[:, :n] - b[:, :n]).abs().max() / b[:, :n].abs().max()))
    report["steps_compared"] = len(diffs)
    report["max_rel_diff_per_step"] = diffs
    for name in MODELS:
        report[f"loss_{name}"] = float(BUILDERS[name](cfg, x)[1]().detach())
    report["ok"] = (len(ours) == len(theirs) == cfg["ttt_steps"] and max(diffs) < 1e-4
                    and all(math.isfinite(report[f"loss_{n}"]) for n in MODELS))
    print(json.dumps(report), flush=True)


def run_child(kind: str, cfg: dict, timeout: float) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_child", kind, json.dumps(cfg)]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                           cwd=REPO, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f}s"}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode == 0 and lines:
        return json.loads(lines[-1])
    if p.returncode == 3:
        return {"error": f"stopped: RSS over the {cfg['mem_limit_gb']:g} GB limit"}
    tail = (p.stderr.strip().splitlines() or ["?"])[-1]
    return {"error": f"exit {p.returncode}: {tail[:200]}"}


def predicted_mb(points: list, length: int) -> float:
    """Peak at `length` from the last two measured (T, MB) points, fitted as a*T + c*T^2
    (c clipped at 0); with one point, assume quadratic growth (conservative)."""
    if not points:
        return 0.0
    if len(points) == 1:
        (t1, m1), = points
        return m1 * (length / t1) ** 2
    (t1, m1), (t2, m2) = points[-2:]
    c = max((m2 / t2 - m1 / t1) / (t2 - t1), 0.0)
    a = m2 / t2 - c * t2
    return a * length + c * length ** 2


# ------------------------------------------------------------------------------------- main

def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--hidden", type=int, default=1024)
    a("--heads", type=int, default=8)
    a("--kv-heads", type=int, default=8)
    a("--head-dim", type=int, default=None, help="default hidden / heads")
    a("--intermediate", type=int, default=2816)
    a("--draft-vocab", type=int, default=8192)
    a("--target-vocab", type=int, default=32000)
    a("--ttt-steps", type=int, default=7)
    a("--step-weight", type=float, default=0.8, help="per-step loss decay, both sides")
    a("--lengths", default="512,1024,2048,4096", help="comma-separated sequence lengths T")
    a("--warmup", type=int, default=1, help="untimed runs before the timed ones")
    a("--warmup-steps", type=int, default=2,
      help="TTT steps of the warmup runs (same T, same code paths, a fraction of the time); "
           "0: all --ttt-steps")
    a("--repeats", type=int, default=3)
    a("--budget-s", type=float, default=25.0,
      help="stop timing a point once its timed runs add up to this (>= 1 run is kept)")
    a("--threads", type=int, default=1,
      help="torch threads per child (1: steadier on a shared machine, see the docstring)")
    a("--mem-limit-gb", type=float, default=16.0,
      help="skip/stop a point whose peak growth would exceed this")
    a("--child-timeout", type=float, default=900.0)
    a("--peer-site", default=DEFAULT_PEER_SITE,
      help="folder holding speculators (default $EAGLE3X_PEER_SITE or ../peer-site)")
    a("--peer-attn", default="sdpa", choices=["sdpa", "eager", "simple_flex_attention"],
      help="speculators draft_attn_impl (its default, flex, is only fused under CUDA)")
    a("--peer-loss", default="eager", choices=["eager", "fused"],
      help="speculators loss_implementation (fused needs Triton on a GPU)")
    a("--peer-lm-head", default="frozen", choices=["frozen", "trained"],
      help="frozen is what speculators trains; trained matches eagle3x's parameter set")
    a("--only", choices=MODELS, default=None, help="measure one implementation")
    a("--check", action=argparse.BooleanOptionalAction, default=True,
      help="first verify both compute the same draft logits")
    a("--check-length", type=int, default=600,
      help="T of the check; past 512 so eagle3x's block-by-block attention is covered")
    a("--json", default=None, help="also write all results to this file")
    return p.parse_args()


def main() -> None:
    if len(sys.argv) >= 4 and sys.argv[1] == "--_child":
        cfg = json.loads(sys.argv[3])
        (child_measure if sys.argv[2] == "measure" else child_check)(cfg)
        return
    args = parse()
    if not (Path(args.peer_site) / "speculators").is_dir() and args.only != "eagle3x":
        sys.exit(f"speculators not found in {args.peer_site}; install it with\n  pip install "
                 f"--no-deps --target {args.peer_site} speculators==0.9.0 hs-connectors")
    base = {"hidden": args.hidden, "heads": args.heads, "kv_heads": args.kv_heads,
            "head_dim": args.head_dim or args.hidden // args.heads,
            "intermediate": args.intermediate, "draft_vocab": args.draft_vocab,
            "target_vocab": args.target_vocab, "ttt_steps": args.ttt_steps,
            "step_weight": args.step_weight, "eps": 1e-6, "rope_theta": 10000.0,
            "warmup": args.warmup, "warmup_steps": args.warmup_steps,
            "repeats": args.repeats, "budget_s": args.budget_s,
            "threads": args.threads, "mem_limit_gb": args.mem_limit_gb,
            "peer_site": str(Path(args.peer_site).resolve()), "peer_attn": args.peer_attn,
            "peer_loss": args.peer_loss, "peer_lm_head": args.peer_lm_head}
    lengths = [int(v) for v in args.lengths.split(",")]
    models = [args.only] if args.only else list(MODELS)
    import torch
    print(f"torch {torch.__version__}, {args.threads} threads, float32 CPU, batch 1; "
          f"H={base['hidden']} heads={base['heads']} kv={base['kv_heads']} "
          f"head_dim={base['head_dim']} I={base['intermediate']} Vd={base['draft_vocab']} "
          f"Vt={base['target_vocab']} ttt_steps={base['ttt_steps']} "
          f"decay={base['step_weight']}", flush=True)
    print(f"peer: speculators from {base['peer_site']}, attn={args.peer_attn}, "
          f"loss={args.peer_loss} kl_div, lm_head {args.peer_lm_head}; eagle3x: lm_head "
          f"trained; embeddings frozen in both", flush=True)

    results: dict = {"config": base, "check": None, "points": []}
    if args.check and not args.only:
        chk = run_child("check", dict(base, length=args.check_length), args.child_timeout)
        results["check"] = chk
        if "error" in chk:
            print(f"check failed to run: {chk['error']}", flush=True)
        else:
            print(f"check (T={args.check_length}): per-step draft logits max rel diff "
                  f"{max(chk['max_rel_diff_per_step']):.1e} over {chk['steps_compared']} steps; "
                  f"loss eagle3x {chk['loss_eagle3x']:.4f} (soft CE), peer "
                  f"{chk['loss_peer']:.4f} (KL) -> {'OK' if chk['ok'] else 'MISMATCH'}",
                  flush=True)

    history = {m: [] for m in models}  # measured (T, peak MB), to predict the next size
    table = {}
    for T in lengths:
        for m in models:
            guess = predicted_mb(history[m], T)
            if guess > args.mem_limit_gb * 1024:
                res = {"error": f"skipped: predicted {guess / 1024:.1f} GB > "
                                f"{args.mem_limit_gb:g} GB"}
            else:
                res = run_child("measure", dict(base, model=m, length=T), args.child_timeout)
            res.update(model=m, length=T)
            if "error" not in res:
                history[m].append((T, res["peak_mb"]))
                print(f"  {m:8s} T={T:5d}: {T / res['seconds']:8.1f} tok/s "
                      f"(runs {', '.join(f'{t:.2f}' for t in res['times'])} s wall; "
                      f"{res['cpu_seconds'] / res['seconds'] / args.threads:.0%} of "
                      f"{args.threads} core(s) busy; warmup "
                      f"{', '.join(f'{t:.1f}' for t in res['warmup_times']) or '-'} s), peak "
                      f"+{res['peak_mb']:.0f} MB over {res['base_mb']:.0f} MB, "
                      f"loss {res['loss']:.3f}", flush=True)
            else:
                print(f"  {m:8s} T={T:5d}: {res['error']}", flush=True)
            table[(m, T)] = res
            results["points"].append(res)

    def cell(m, T, key):
        r = table.get((m, T))
        if r is None:
            return "-"
        if "error" in r:
            return "skip" if r["error"].startswith("skipped") else "fail"
        return f"{T / r['seconds']:.0f}" if key == "tps" else f"{r['peak_mb']:.0f}"

    def ratio(T, key):
        a, b = table.get(("eagle3x", T), {}), table.get(("peer", T), {})
        if "error" in a or "error" in b or not a or not b:
            return "-"
        if key == "tps":
            return f"{b['seconds'] / a['seconds']:.2f}x"
        if key == "cpu":
            return f"{b['cpu_seconds'] / a['cpu_seconds']:.2f}x"
        return f"{a['peak_mb'] / b['peak_mb']:.2f}x"

    print()
    print("| T | eagle3x tok/s | peer tok/s | speed ratio | (by CPU time) | eagle3x peak MB "
          "| peer peak MB | memory ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for T in lengths:
        print(f"| {T} | {cell('eagle3x', T, 'tps')} | {cell('peer', T, 'tps')} | "
              f"{ratio(T, 'tps')} | {ratio(T, 'cpu')} | {cell('eagle3x', T, 'mb')} | "
              f"{cell('peer', T, 'mb')} | {ratio(T, 'mb')} |")
    method = next((r["mem_method"] for r in results["points"] if "mem_method" in r), "?")
    print(f"\npeak MB = RSS growth during forward+backward over the RSS after building the "
          f"model and inputs ({method}).\nspeed ratio = peer time / eagle3x time, by wall clock "
          f"(and by process CPU time, which a busy shared machine disturbs less): > 1 means "
          f"eagle3x is faster. memory ratio = eagle3x / peer: < 1 means eagle3x is smaller.")
    for r in results["points"]:
        if "error" in r:
            print(f"note: {r['model']} T={r['length']}: {r['error']}")
    versions = {m: sorted({r["version"] for r in results["points"]
                           if r["model"] == m and "version" in r}) for m in models}
    if any(versions.values()):
        print(f"measured: {'; '.join(', '.join(v) for v in versions.values() if v)} "
              f"({git_describe()})")
    if len(versions.get("eagle3x", [])) > 1:
        print("note: eagle3x's draft code changed during the run; --json says which point "
              "measured which")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
