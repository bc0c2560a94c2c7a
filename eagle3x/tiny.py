"""The embedded default verifier: a tiny Llama and a tokenizer, both made locally.

Built on first use into a folder with ``save_pretrained`` and then loaded through the
same code as any real verifier folder. Nothing is downloaded. The model is random-
initialised (fixed seed) and then fitted for a fixed number of steps to the bundled
conversations: a purely random model predicts a near-uniform distribution (its greedy
tokens are spread over most of the vocabulary), which no draft can learn and which would
make every acceptance figure of the demo meaningless.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from eagle3x.resources import resource

#: Change when anything below changes what the built model or tokenizer is.
SPEC_ID = "tiny-llama-v2"

SPEC = dict(
    vocab_size=1024,  # tokenizer vocabulary trained to this size
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=8,
    num_attention_heads=2,  # head_dim 64: supported by vLLM's CPU attention
    num_key_value_heads=2,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    initializer_range=0.1,
    tie_word_embeddings=False,
)
#: The short fit after random init: steps, sequences per step, tokens per sequence, lr.
FIT = dict(steps=160, batch=8, seq_len=256, lr=3e-3, seed=0)

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<pad>", "<s>", "<|im_start|>", "<|im_end|>"]


def config_dict() -> dict:
    """The config.json fields of the tiny verifier, known before it is built."""
    return dict(SPEC, architectures=["LlamaForCausalLM"], model_type="llama")


def _corpus():
    with open(resource("sample_conversations.jsonl"), encoding="utf-8") as f:
        for line in f:
            for m in json.loads(line)["messages"]:
                yield f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"


def _build_tokenizer(out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=SPEC["vocab_size"], special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>", pad_token="<pad>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def _fit(model, tok) -> None:
    """A few hundred deterministic AdamW steps of next-token prediction on the sample data."""
    import json as _json

    import torch

    ids = []
    with open(resource("sample_conversations.jsonl"), encoding="utf-8") as f:
        for line in f:
            text = tok.apply_chat_template(_json.loads(line)["messages"], tokenize=False)
            ids.extend(tok(text, add_special_tokens=False).input_ids)
    n, L = FIT["batch"], FIT["seq_len"]
    data = torch.tensor(ids[: (len(ids) // L) * L]).view(-1, L)
    g = torch.Generator().manual_seed(FIT["seed"])
    opt = torch.optim.AdamW(model.parameters(), lr=FIT["lr"], weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    model.train()
    for _ in range(FIT["steps"]):
        batch = data[torch.randint(len(data), (n,), generator=g)]
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    model.eval()


def build(path: str | Path) -> Path:
    """Build the tiny verifier at `path` unless it is already there; return the path."""
    path = Path(path)
    if (path / "config.json").exists() and (path / "model.safetensors").exists():
        return path
    from filelock import FileLock

    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        if (path / "config.json").exists() and (path / "model.safetensors").exists():
            return path
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        tmp = Path(tempfile.mkdtemp(prefix=path.name + ".tmp-", dir=path.parent))
        os.chmod(tmp, 0o755)
        try:
            tok = _build_tokenizer(tmp)
            cfg = LlamaConfig(
                **{k: v for k, v in SPEC.items() if k != "vocab_size"},
                vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
            )
            cfg.dtype = "float32"
            torch.manual_seed(0)
            model = LlamaForCausalLM(cfg)
            _fit(model, tok)
            model.save_pretrained(tmp, safe_serialization=True)
            with open(tmp / "eagle3x_tiny.json", "w") as f:
                json.dump({"spec_id": SPEC_ID}, f)
            if path.exists():
                shutil.rmtree(path)
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return path


def build_random(path: str | Path, device: str = "cpu", dtype: str = "bfloat16", **shape) -> Path:
    """A random-initialised Llama of any shape with the tiny tokenizer (benchmarks only).

    `shape` holds LlamaConfig fields (hidden_size, num_hidden_layers, vocab_size, ...); a
    vocabulary larger than the tokenizer's is allowed (the extra rows are never read).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = _build_tokenizer(path)
    fields = dict(SPEC, **shape)
    fields["vocab_size"] = max(fields["vocab_size"], len(tok))
    cfg = LlamaConfig(**fields, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    cfg.dtype = dtype
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(getattr(torch, dtype))
    model.save_pretrained(path, safe_serialization=True)
    return path
