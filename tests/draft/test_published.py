"""draft.init: published EAGLE-3 drafts in every layout read back exactly, and export.format
writes each; the startup refusals of a draft that does not fit the verifier.

The layouts are written here from each project's loader or writer (eagle3x.published has
the rules and their sources): vLLM's / SGLang's / EAGLE's / SpecForge's
LlamaForCausalLMEagle3 (midlayer.*, the aux ids at the top in vLLM's numbering or nested
in SGLang's, or none), speculators 0.9.0's eagle3 (transformer_layer_config, layers.0.*),
ModelOpt's export (LlamaForCausalLM + eagle_config, no t2d).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from eagle3x import published
from eagle3x.draft.model import DraftShape, Eagle3Draft, RMSNorm
from eagle3x.draft.save import FORMATS, load_published, save

SMALL = dict(hidden_size=32, target_hidden_size=32, intermediate_size=40, num_heads=4,
             num_kv_heads=2, head_dim=8, draft_vocab_size=20, target_vocab_size=50)


def make(seed: int, **shape) -> Eagle3Draft:
    s = DraftShape(**{**SMALL, **shape})
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    chosen = torch.randperm(s.target_vocab_size, generator=g)[:s.draft_vocab_size].sort().values
    t2d = torch.zeros(s.target_vocab_size, dtype=torch.bool)
    t2d[chosen] = True
    draft = Eagle3Draft(s, chosen - torch.arange(s.draft_vocab_size), t2d)
    with torch.no_grad():
        for m in draft.modules():
            if isinstance(m, RMSNorm):
                m.weight.uniform_(0.5, 1.5, generator=g)
        draft.embed_tokens.weight.normal_(generator=g)
    return draft


def same_tensors(a: Eagle3Draft, b: Eagle3Draft) -> list:
    sb = b.state_dict()
    return [k for k, v in a.state_dict().items()
            if not k.startswith("embed_tokens") and not torch.equal(v, sb[k])]


def third_party(folder: Path, drop=("eagle3x",), **changes) -> Path:
    """The folder as another project writes it: without eagle3x's own key."""
    cfg = json.loads((folder / "config.json").read_text())
    for k in drop:
        cfg.pop(k, None)
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


OPTION_SETS = [dict(), dict(num_layers=2, norm_before_fc=True, norm_before_residual=True,
                            norm_output=True),
               dict(fc_norm=True, sliding_window=6, num_layers=3)]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("options", OPTION_SETS, ids=["plain", "norms", "fcnorm-window"])
def test_each_export_format_reads_back_as_the_same_draft(tmp_path, fmt, options):
    """export.format -> draft.init: the same architecture, aux ids and every tensor, read
    from the layout's own keys (eagle3x's key removed) and from eagle3x's."""
    if fmt == "sglang" and (options.get("num_layers", 1) > 1 or options.get("fc_norm")):
        pytest.skip("refused for SGLang (tested below)")
    draft = make(1, **options)
    out = save(draft, tmp_path / fmt, [1, 3, 5], dtype=torch.float32, fmt=fmt, verifier="v")
    ours = published.read(out)
    theirs = published.read(third_party(out))
    assert theirs.layout == ("speculators" if fmt == "speculators" else "llama-eagle3")
    for p in (ours, theirs):
        assert p.shape == draft.shape.to_dict(), p.layout
        assert p.aux_layer_ids == (1, 3, 5)
        assert same_tensors(draft, load_published(p)) == []


def test_sglang_format_refuses_a_draft_sglang_computes_otherwise(tmp_path):
    from eagle3x.artifacts import ArtifactError

    with pytest.raises(ArtifactError, match="norm_before_fc"):
        save(make(2, norm_before_fc=True), tmp_path / "s", [1, 3, 5], fmt="sglang")


def test_the_nested_sglang_ids_and_no_ids_are_read_in_their_numbering(tmp_path):
    draft = make(3)
    out = save(draft, tmp_path / "d", [1, 3, 5], dtype=torch.float32)
    cfg = json.loads((out / "config.json").read_text())
    third_party(out, drop=("eagle3x", "eagle_aux_hidden_state_layer_ids"))
    assert published.read(out).aux_layer_ids == (1, 3, 5)  # SGLang's nested: k as written
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]
    third_party(out, drop=("eagle_config",))  # EAGLE's own folders name none
    p = published.read(out)
    assert p.aux_layer_ids is None and same_tensors(draft, load_published(p)) == []


def test_a_speculators_folder_as_speculators_writes_it(tmp_path):
    """speculators' save_pretrained of Eagle3DraftModel: layers.0.* (first layer with
    hidden_norm), no verifier_* tensors kept by a loader, embed_tokens saved, the aux ids
    in vLLM's numbering, norm_before_residual false when absent (its config's default)."""
    from safetensors.torch import load_file, save_file

    draft = make(4, num_layers=2, norm_before_fc=True)
    out = save(draft, tmp_path / "s", [0, 2, 4], dtype=torch.float32, fmt="speculators")
    w = load_file(str(out / "model.safetensors"))
    assert "layers.0.hidden_norm.weight" in w and "layers.1.self_attn.q_proj.weight" in w
    assert not any(k.startswith("midlayer") for k in w)
    w["verifier_norm.weight"] = torch.ones(32)  # written by older speculators; never loaded
    w["embed_tokens.weight"] = draft.embed_tokens.weight.detach()
    save_file(w, str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]
    third_party(out, drop=("eagle3x", "norm_before_residual"))
    p = published.read(out)
    assert p.layout == "speculators" and p.aux_layer_ids == (0, 2, 4)
    assert p.shape["norm_before_residual"] is False and p.shape["norm_before_fc"] is True
    back = load_published(p)
    assert same_tensors(draft, back) == []
    assert torch.equal(back.embed_tokens.weight, draft.embed_tokens.weight)


def test_a_modelopt_export_with_no_t2d(tmp_path):
    """ModelOpt's hf_spec_export: architectures [LlamaForCausalLM], eagle_config with its
    layernorm flags and aux ids, midlayer.* / fc / norm / lm_head / d2t, no t2d."""
    from safetensors.torch import load_file, save_file

    draft = make(5)
    out = save(draft, tmp_path / "m", [1, 3, 5], dtype=torch.float32)
    w = load_file(str(out / "model.safetensors"))
    del w["t2d"]
    save_file(w, str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "num_hidden_layers", "rms_norm_eps", "rope_theta", "vocab_size",
            "draft_vocab_size", "max_position_embeddings")
    modelopt = {k: cfg[k] for k in keep}
    modelopt.update(architectures=["LlamaForCausalLM"], model_type="llama",
                    eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 5],
                                  "use_aux_hidden_state": True,
                                  "use_input_layernorm_in_first_layer": True,
                                  "use_last_layernorm": True, "use_mtp_layernorm": False})
    (out / "config.json").write_text(json.dumps(modelopt))
    p = published.read(out)
    assert p.layout == "modelopt" and p.aux_layer_ids == (1, 3, 5)
    back = load_published(p)
    assert same_tensors(draft, back) == []  # t2d rebuilt from d2t equals the original
    modelopt["eagle_config"]["use_mtp_layernorm"] = True
    (out / "config.json").write_text(json.dumps(modelopt))
    with pytest.raises(published.LayoutError, match="use_mtp_layernorm"):
        published.read(out)


def test_an_unreadable_layout_names_the_keys_it_found(tmp_path):
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Foo"], "hidden_size": 8}))
    save_file({"encoder.w": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(published.LayoutError, match="encoder.w"):
        published.read(tmp_path)


# ---- against the tiny verifier: startup refusals (exit 2, within a second) ----------------

def verifier_draft(tiny: Path, tmp: Path, name: str = "pub", seed: int = 7,
                   embed_from_verifier: bool = True, fmt: str = "vllm", **shape) -> Path:
    """A published draft made for the tiny verifier (its sizes, its embedding rows)."""
    from eagle3x.verifier import read_info
    from eagle3x.weights import EMBED_NAMES, find_tensor

    info = read_info(tiny)
    s = dict(hidden_size=info.hidden_size, target_hidden_size=info.hidden_size,
             intermediate_size=64, num_heads=info.num_heads, num_kv_heads=info.num_kv_heads,
             head_dim=info.hidden_size // info.num_heads, draft_vocab_size=256,
             target_vocab_size=info.vocab_size, **shape)
    draft = make(seed, **s)
    if embed_from_verifier:
        with torch.no_grad():
            draft.embed_tokens.weight.copy_(find_tensor(tiny, EMBED_NAMES).float())
    return save(draft, tmp / name, [1, 3, 4], dtype=torch.bfloat16, include_embeddings=True,
                fmt=fmt, verifier=str(tiny))


def refused(cli, *args):
    """The command refused with status 2, within a second and a half of composing (the
    process's one-time imports are warmed by a first refusal, untimed)."""
    if not getattr(refused, "warm", False):
        cli("stage=train", "engine=hf", "logger=none", "vocab.remap=true")
        refused.warm = True
    t0 = time.perf_counter()
    r = cli("stage=train", "engine=hf", "logger=none", *args)
    took = time.perf_counter() - t0
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert took < 1.5, took
    return r.stderr


def test_mismatched_drafts_are_refused_at_startup_naming_the_mismatch(cli, store, tiny_verifier,
                                                                      tmp_path):
    good = verifier_draft(tiny_verifier, tmp_path, "good")
    bad_hidden = third_party(verifier_draft(tiny_verifier, tmp_path, "h"), target_hidden_size=96)
    err = refused(cli, f"draft.init={bad_hidden}")
    assert "draft.init" in err and "target_hidden_size" in err
    other = verifier_draft(tiny_verifier, tmp_path, "v", embed_from_verifier=False)
    err = refused(cli, f"draft.init={other}")
    assert "embed_tokens rows" in err and "another verifier" in err
    ids = third_party(verifier_draft(tiny_verifier, tmp_path, "ids"),
                      eagle_aux_hidden_state_layer_ids=[2, 4, 40])
    err = refused(cli, f"draft.init={ids}")
    assert "39" in err and "outside the verifier's layers" in err
    err = refused(cli, f"draft.init={good}", "extract.aux_layer_ids=[0,2,3]")
    assert "extract.aux_layer_ids" in err and "[1, 3, 4]" in err
    err = refused(cli, f"draft.init={tmp_path / 'nothing'}")
    assert "draft.init" in err and "no such folder" in err
    err = refused(cli, "vocab.remap=true")
    assert "vocab.remap" in err
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "config.json").write_text(json.dumps({"architectures": ["X"]}))
    from safetensors.torch import save_file

    save_file({"weird.w": torch.zeros(1)}, str(junk / "model.safetensors"))
    err = refused(cli, f"draft.init={junk}")
    assert "weird.w" in err


def test_a_different_vocabulary_size_is_refused(cli, store, tiny_verifier, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = verifier_draft(tiny_verifier, tmp_path, "voc")
    w = load_file(str(folder / "model.safetensors"))
    w["t2d"] = torch.cat([w["t2d"], torch.zeros(64, dtype=torch.bool)])
    w["embed_tokens.weight"] = torch.cat([w["embed_tokens.weight"],
                                          torch.zeros(64, w["embed_tokens.weight"].shape[1],
                                                      dtype=w["embed_tokens.weight"].dtype)])
    save_file(w, str(folder / "model.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    third_party(folder, vocab_size=cfg["vocab_size"] + 64)
    err = refused(cli, f"draft.init={folder}")
    assert "vocabulary of" in err and str(cfg["vocab_size"] + 64) in err


def test_export_format_sglang_is_refused_for_a_draft_sglang_computes_otherwise(cli, store):
    err = refused(cli, "export.format=[sglang]", "draft.norm_before_fc=true")
    assert "export.format" in err and "norm_before_fc" in err


def test_speculators_loads_the_speculators_export_with_its_own_from_pretrained(tiny_verifier,
                                                                            tmp_path):
    """speculators 0.9.0's Eagle3DraftModel.from_pretrained (installed beside eagle3x:
    `pip install --no-deps speculators==0.9.0 hs-connectors`) loads export.format=speculators
    with every tensor as eagle3x wrote it and the aux ids in its (vLLM's) numbering."""
    pytest.importorskip("speculators")
    from speculators.models.eagle3 import Eagle3DraftModel

    folder = verifier_draft(tiny_verifier, tmp_path, "spec", fmt="speculators", num_layers=2,
                            norm_before_fc=True, norm_before_residual=True, norm_output=True)
    model = Eagle3DraftModel.from_pretrained(str(folder))
    theirs = model.state_dict()
    ours = load_published(published.read(folder)).state_dict()
    from eagle3x.draft.save import stored_name

    compared = 0
    for name, t in ours.items():
        key = stored_name(name, "speculators")
        if name.startswith("embed_tokens"):
            continue
        assert key in theirs, key
        assert torch.equal(theirs[key].float(), t.float()), key
        compared += 1
    assert compared >= 20
    assert model.config.eagle_aux_hidden_state_layer_ids == [2, 4, 5]
    assert model.config.norm_before_residual and model.config.norm_output


@pytest.mark.slow
def test_a_draft_init_refusal_imports_no_heavy_library(cli, store, tiny_verifier, tmp_path):
    """The checks read config.json, safetensors headers and a few embedding rows (numpy):
    the refusal comes before torch, vLLM, Lightning or transformers are imported."""
    import subprocess
    import sys

    from tests.config.test_refusals import HEAVY

    other = verifier_draft(tiny_verifier, tmp_path, "o", embed_from_verifier=False)
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "eagle3x", "stage=train",
                        f"draft.init={other}"], cwd=cli.cwd, capture_output=True, text=True)
    assert r.returncode == 2 and "another verifier" in r.stderr
    imported = {line.split("|")[-1].strip().split(".")[0] for line in r.stderr.splitlines()
                if line.startswith("import time:")}
    assert imported and not imported & set(HEAVY), imported & set(HEAVY)


def test_a_hub_id_is_found_in_the_huggingface_hub_cache(tmp_path, monkeypatch):
    """huggingface_hub's cache layout: <cache>/models--<org>--<name>/refs/main holds the
    revision whose snapshot folder holds the files; nothing is downloaded."""
    draft = make(8)
    snap = tmp_path / "hub" / "models--someone--eagle3-draft" / "snapshots" / "abc123"
    save(draft, snap, [1, 3, 5], dtype=torch.float32)
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    assert published.locate("someone/eagle3-draft") == snap
    with pytest.raises(published.LayoutError, match="huggingface-cli download"):
        published.locate("someone/other-draft")


def test_scaled_rope_is_refused_naming_it(tmp_path):
    out = save(make(9), tmp_path / "d", [1, 3, 5], dtype=torch.float32)
    third_party(out, rope_scaling={"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(published.LayoutError, match="llama3"):
        published.read(out)
