"""The training recipe's options (train.loss, teacher_topk, optimizer, schedule,
freeze_lm_head): what each changes, in-process on a tiny draft."""

from __future__ import annotations

import pytest
import torch

from eagle3x.draft.ttt import Teacher, ttt_step_metrics
from tests.draft.test_linear_memory import draft_and_batch, grads


def teacher(draft, batch, head, **kw) -> Teacher:
    return Teacher(draft, batch, head, None, 1.0, greedy=False, chunk=64, **kw)


def test_the_hard_teacher_is_the_soft_teachers_most_likely_token():
    draft, batch, head = draft_and_batch(1, 12, [12])
    rows = torch.arange(12)
    soft = teacher(draft, batch, head).probs(rows)
    hard = teacher(draft, batch, head, hard=True).probs(rows)
    assert torch.equal(hard.argmax(-1), soft.argmax(-1))
    assert torch.equal(hard.sum(-1), torch.ones(12)) and int((hard > 0).sum()) == 12


@pytest.mark.parametrize("k", [1, 3])
def test_a_top_k_teacher_keeps_its_k_most_likely_tokens_renormalised(k):
    draft, batch, head = draft_and_batch(2, 9, [9])
    rows = torch.arange(9)
    soft = teacher(draft, batch, head).probs(rows)
    top = teacher(draft, batch, head, topk=k).probs(rows)
    assert torch.allclose(top.sum(-1), torch.ones(9))
    assert torch.equal((top > 0).sum(-1), torch.full((9,), k))
    kept = soft.topk(k, -1)
    assert torch.allclose(top.gather(1, kept.indices), kept.values / kept.values.sum(-1, True))


def test_each_loss_trains_towards_its_own_target():
    draft, batch, head = draft_and_batch(3, 15, [15, 11])
    soft = grads(draft, ttt_step_metrics(draft, batch, head, 2, 0.8)["loss"])
    hard = grads(draft, ttt_step_metrics(draft, batch, head, 2, 0.8, hard=True)["loss"])
    top = grads(draft, ttt_step_metrics(draft, batch, head, 2, 0.8, teacher_topk=2)["loss"])
    for other in (hard, top):
        assert not torch.allclose(other["lm_head.weight"], soft["lm_head.weight"])


def test_muon_takes_the_layers_matrices_and_adamw_the_rest(tiny_verifier):
    from eagle3x.draft.module import Optimizers, muon_and_adamw
    from eagle3x.draft.model import DraftShape, Eagle3Draft

    s = DraftShape(hidden_size=16, target_hidden_size=16, intermediate_size=24, num_heads=2,
                   num_kv_heads=1, head_dim=8, draft_vocab_size=10, target_vocab_size=30,
                   num_layers=2, norm_before_fc=True)
    draft = Eagle3Draft(s, torch.zeros(10, dtype=torch.long), torch.arange(30) < 10)
    draft.embed_tokens.weight.requires_grad_(False)
    named = [(n, p) for n, p in draft.named_parameters() if p.requires_grad]
    opt = muon_and_adamw(named, {"lr": 1e-3, "muon_lr": 0.02, "weight_decay": 0.0}, False)
    muon, adamw = opt.optimizers
    names = {id(p): n for n, p in named}
    in_muon = {names[id(p)] for g in muon.param_groups for p in g["params"]}
    in_adamw = {names[id(p)] for g in adamw.param_groups for p in g["params"]}
    assert "fc.weight" in in_muon and "more_layers.0.self_attn.q_proj.weight" in in_muon
    assert "midlayer.mlp.down_proj.weight" in in_muon
    assert {"lm_head.weight", "norm.weight", "input_norm.weight"} <= in_adamw
    assert not in_muon & in_adamw and len(in_muon | in_adamw) == len(named)
    assert muon.param_groups[0]["lr"] == 0.02 and adamw.param_groups[0]["lr"] == 1e-3
    # one step of both; the state dict holds both and loads back
    for p in draft.parameters():
        if p.requires_grad:
            p.grad = torch.randn_like(p)
    before = draft.fc.weight.detach().clone()
    calls = []
    opt.step(lambda: calls.append(1))
    assert calls == [1] and not torch.equal(before, draft.fc.weight)
    # AdamW-sized: an update's RMS is ~0.2 x lr (Newton-Schulz's inexact orthogonalisation
    # gives 0.16 here) whatever the matrix's shape (speculators' match_rms_adamw); torch's
    # default would give 0.044 x lr for a 64 x 512 matrix
    wide = torch.nn.Parameter(torch.zeros(64, 512))
    muon = muon_and_adamw([("fc.weight", wide)], {"lr": 0.02, "weight_decay": 0.0}, False)
    wide.grad = torch.randn_like(wide)
    muon.step()
    assert float(wide.detach().pow(2).mean().sqrt()) == pytest.approx(0.2 * 0.02, rel=0.3)
    again = muon_and_adamw(named, {"lr": 1e-3, "muon_lr": 0.02, "weight_decay": 0.0}, False)
    again.load_state_dict(opt.state_dict())
    assert isinstance(again, Optimizers) and len(again.state) == len(opt.state) > 0


@pytest.mark.parametrize("schedule,end", [("cosine", 0.1), ("linear", 0.1), ("constant", 1.0)])
def test_the_schedule_warms_up_then_ends_where_it_says(tiny_verifier, schedule, end):
    import dataclasses

    from eagle3x.config.schema import Schedule, TrainConfig
    from eagle3x.draft.module import DraftModule
    from eagle3x.stages.train import plain

    train = plain(dataclasses.asdict(TrainConfig(warmup_steps=4, lr=1.0,
                                                 schedule=Schedule(schedule))))
    shape = dict(hidden_size=128, target_hidden_size=128, intermediate_size=64, num_heads=2,
                 num_kv_heads=2, head_dim=64, draft_vocab_size=16, target_vocab_size=1024)
    m = DraftModule(shape=shape, train=train, verifier=str(tiny_verifier), tied_head=False,
                    aux_layer_ids=[1, 3, 4], max_steps=20)
    cfg = m.configure_optimizers()
    sched = cfg["lr_scheduler"]["scheduler"]
    lrs = []
    for _ in range(21):
        lrs.append(cfg["optimizer"].param_groups[0]["lr"])
        cfg["optimizer"].step()
        sched.step()
    assert lrs[0] == pytest.approx(0.25) and lrs[3] == pytest.approx(1.0)
    assert lrs[20] == pytest.approx(end)
    assert all(a >= b - 1e-12 for a, b in zip(lrs[4:], lrs[5:]))  # never up after warmup


@pytest.mark.parametrize("max_steps,warmup", [(300, 3), (20, 1)])
def test_the_default_warmup_is_one_percent_of_the_steps(tiny_verifier, max_steps, warmup):
    import dataclasses

    from eagle3x.config.schema import TrainConfig
    from eagle3x.draft.module import DraftModule
    from eagle3x.stages.train import plain

    assert TrainConfig().warmup_steps is None
    shape = dict(hidden_size=128, target_hidden_size=128, intermediate_size=64, num_heads=2,
                 num_kv_heads=2, head_dim=64, draft_vocab_size=16, target_vocab_size=1024)
    m = DraftModule(shape=shape, train=plain(dataclasses.asdict(TrainConfig(lr=1.0))),
                    verifier=str(tiny_verifier), tied_head=False, aux_layer_ids=[1, 3, 4],
                    max_steps=max_steps)
    cfg = m.configure_optimizers()
    sched = cfg["lr_scheduler"]["scheduler"]
    lrs = []
    for _ in range(warmup + 1):
        lrs.append(sched.get_last_lr()[0])
        sched.step()
    assert lrs[:warmup] == pytest.approx([(i + 1) / warmup for i in range(warmup)])
    assert lrs[warmup] == pytest.approx(1.0)  # the schedule starts at its top


def test_a_frozen_lm_head_gets_no_gradient(tiny_verifier):
    import dataclasses

    from eagle3x.config.schema import TrainConfig
    from eagle3x.draft.module import DraftModule
    from eagle3x.stages.train import plain

    shape = dict(hidden_size=128, target_hidden_size=128, intermediate_size=64, num_heads=2,
                 num_kv_heads=2, head_dim=64, draft_vocab_size=16, target_vocab_size=1024)
    m = DraftModule(shape=shape, train=plain(dataclasses.asdict(TrainConfig(freeze_lm_head=True))),
                    verifier=str(tiny_verifier), tied_head=False, aux_layer_ids=[1, 3, 4],
                    max_steps=20)
    assert not m.draft.lm_head.weight.requires_grad
    names = {id(p) for g in m.configure_optimizers()["optimizer"].param_groups for p in g["params"]}
    assert id(m.draft.lm_head.weight) not in names


@pytest.mark.parametrize("warmup", [None, 2])
def test_a_time_bound_schedule_runs_on_the_time_spent(tiny_verifier, warmup):
    """trainer.max_time: with a step cap far away the learning rate follows the fraction of
    the time budget spent (the clock moved back = that much time already trained)."""
    import dataclasses

    from eagle3x.config.schema import Schedule, TrainConfig
    from eagle3x.draft.module import DraftModule
    from eagle3x.stages.train import plain

    shape = dict(hidden_size=128, target_hidden_size=128, intermediate_size=64, num_heads=2,
                 num_kv_heads=2, head_dim=64, draft_vocab_size=16, target_vocab_size=1024)
    train = plain(dataclasses.asdict(TrainConfig(lr=1.0, schedule=Schedule.linear,
                                                 warmup_steps=warmup)))
    m = DraftModule(shape=shape, train=train, verifier=str(tiny_verifier), tied_head=False,
                    aux_layer_ids=[1, 3, 4], max_steps=10 ** 6, max_seconds=1000.0)
    cfg = m.configure_optimizers()
    sched = cfg["lr_scheduler"]["scheduler"]
    first = sched.get_last_lr()[0]
    assert first == pytest.approx(0.01 if warmup is None else 0.5)
    m.on_train_start()
    if warmup is None:  # the warmup is the first 1% of the budget (10 s here), not steps
        for _ in range(3):
            sched.step()
        assert sched.get_last_lr()[0] == pytest.approx(0.01, abs=0.01)
        m._clock -= 5.0  # noqa: SLF001 (half the warmup's time spent)
        sched.step()
        assert sched.get_last_lr()[0] == pytest.approx(0.5, abs=0.02)
        m._clock -= 5.0  # noqa: SLF001
    for _ in range(3):  # past the warmup, near the start of the budget: near the top
        sched.step()
    assert sched.get_last_lr()[0] == pytest.approx(1.0, abs=0.01)
    m._clock -= 490.0 if warmup is None else 500.0  # noqa: SLF001 (half the budget spent)
    sched.step()
    done = 0.5 if warmup is not None else (0.5 - 0.01) / 0.99
    assert sched.get_last_lr()[0] == pytest.approx(0.1 + 0.9 * (1 - done), abs=0.01)
    m._clock -= 600.0  # noqa: SLF001 (past the budget: the floor)
    sched.step()
    assert sched.get_last_lr()[0] == pytest.approx(0.1)


def test_trainer_max_time_stops_a_run_far_from_its_step_cap(tmp_path):
    import time

    import lightning as L
    from torch.utils.data import DataLoader

    from eagle3x.config.schema import TrainerConfig
    from eagle3x.stages.train import make_trainer

    class Slow(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(4))

        def training_step(self, batch, _i):
            time.sleep(0.05)
            return (self.w * batch).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self):
            return DataLoader(torch.ones(64, 4), batch_size=1)

    t = TrainerConfig(max_steps=10 ** 6, max_time=2.0, enable_progress_bar=False,
                      accelerator="cpu", devices="1", val_check_interval=10 ** 6)
    trainer = make_trainer(t, tmp_path, None)
    t0 = time.perf_counter()
    trainer.fit(Slow())
    took = time.perf_counter() - t0
    assert 10 <= trainer.global_step < 200 and 1.9 <= took < 20


def test_the_progress_line_of_a_time_bound_run_counts_down_its_time(tmp_path):
    import time

    import lightning as L
    from torch.utils.data import DataLoader

    from eagle3x.config.schema import TrainerConfig
    from eagle3x.draft.callbacks import time_left
    from eagle3x.stages.train import make_trainer

    seen = []

    class Slow(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(4))

        def training_step(self, batch, _i):
            time.sleep(0.05)
            seen.append(time_left(self.trainer))
            return (self.w * batch).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self):
            return DataLoader(torch.ones(64, 4), batch_size=1)

    t = TrainerConfig(max_steps=10 ** 6, max_time=1.0, enable_progress_bar=False,
                      accelerator="cpu", devices="1", val_check_interval=10 ** 6)
    make_trainer(t, tmp_path, None).fit(Slow())
    assert seen and 0.5 < seen[0] <= 1.0 and seen[-1] < seen[0] and min(seen) >= 0
    assert time_left(make_trainer(TrainerConfig(max_steps=5), tmp_path, None)) is None


def test_feature_noise_is_uniform_within_each_layers_own_scale():
    from eagle3x.draft.ttt import feature_noise

    g = torch.Generator().manual_seed(0)
    scales = torch.tensor([1.0, 100.0, 0.01])  # three aux layers of very different size
    aux = (torch.randn(2, 50, 3, 32, generator=g) * scales[:, None]).flatten(-2)
    before = aux.clone()
    noisy = feature_noise(aux, 3, 0.2, generator=g)
    assert torch.equal(aux, before)  # the batch's tensor is left as it was
    noise = (noisy - aux).unflatten(-1, (3, -1))
    rms = aux.unflatten(-1, (3, -1)).pow(2).mean(-1, keepdim=True).sqrt()
    bound = 0.2 * rms
    assert bool((noise.abs() <= bound * (1 + 1e-5)).all())
    share = noise.abs() / bound
    assert float(share.max()) > 0.95 and abs(float(share.mean()) - 0.5) < 0.05  # uniform
    assert abs(float((noise / bound).mean())) < 0.05  # centred
    assert feature_noise(aux, 3, 0.0) is aux
    half = feature_noise(aux.bfloat16(), 3, 0.2)
    assert half.dtype == torch.bfloat16 and half.shape == aux.shape


def test_a_training_step_with_feature_noise_sees_noisy_features(tiny_verifier):
    """train.feature_noise reaches the loss in training steps only: the same module and
    batch give another loss with it and the same loss at validation."""
    import dataclasses

    from eagle3x.config.schema import TrainConfig
    from eagle3x.draft.module import DraftModule
    from eagle3x.stages.train import plain

    shape = dict(hidden_size=128, target_hidden_size=128, intermediate_size=64, num_heads=2,
                 num_kv_heads=2, head_dim=64, draft_vocab_size=1024, target_vocab_size=1024)
    g = torch.Generator().manual_seed(1)
    t = 12
    batch = {"input_ids": torch.randint(1, 1024, (2, t), generator=g),
             "loss_mask": torch.ones(2, t, dtype=torch.uint8), "lengths": torch.tensor([t, t]),
             "aux_hidden": torch.randn(2, t, 3 * 128, generator=g),
             "last_hidden": torch.randn(2, t, 128, generator=g)}
    losses = {}
    for noise in (0.0, 0.5):
        torch.manual_seed(0)
        m = DraftModule(shape=shape, train=plain(dataclasses.asdict(TrainConfig(feature_noise=noise))),
                        verifier=str(tiny_verifier), tied_head=False, aux_layer_ids=[1, 3, 4],
                        max_steps=20, d2t=torch.zeros(1024, dtype=torch.long),
                        t2d=torch.ones(1024, dtype=torch.bool))
        m._logging_now = lambda: False
        aux = batch["aux_hidden"].clone()
        losses[noise] = float(m.training_step(dict(batch), 0))
        assert torch.equal(batch["aux_hidden"], aux)
        with torch.no_grad():
            losses[noise, "val"] = float(m._metrics(dict(batch), accuracy=False)["loss"])
    assert losses[0.5] != pytest.approx(losses[0.0], rel=1e-4)
    assert losses[0.5, "val"] == pytest.approx(losses[0.0, "val"], rel=1e-6)
    assert losses[0.0] == pytest.approx(losses[0.0, "val"], rel=1e-5)


def _muon_steps(cls, steps: int = 3, **kw):
    g = torch.Generator().manual_seed(4)
    params = [torch.nn.Parameter(torch.randn(24, 40, generator=g)),  # wide
              torch.nn.Parameter(torch.randn(40, 24, generator=g))]  # tall
    opt = cls(params, lr=0.01, weight_decay=0.1, adjust_lr_fn="match_rms_adamw", **kw)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return [p.detach().clone() for p in params], opt


def test_muon_in_bfloat16_is_torchs_muon_bit_for_bit():
    from eagle3x.draft.muon import Muon

    ours, opt = _muon_steps(Muon, ns_dtype="bfloat16")
    theirs, ref = _muon_steps(torch.optim.Muon)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
    mine = opt.state_dict()["state"][0]["momentum_buffer"]
    assert torch.equal(mine, ref.state_dict()["state"][0]["momentum_buffer"])


def test_muon_in_float32_differs_from_bfloat16_by_its_rounding_only():
    from eagle3x.draft.muon import Muon, orthogonalise

    start = _muon_steps(Muon, steps=0)[0]
    f32 = _muon_steps(Muon, ns_dtype="float32")[0]
    bf16 = _muon_steps(Muon, ns_dtype="bfloat16")[0]
    for s, a, b in zip(start, f32, bf16):
        step_a, step_b = a - s, b - s
        assert not torch.equal(step_a, step_b)
        assert float((step_a - step_b).norm() / step_b.norm()) < 0.02
    g = torch.randn(24, 40, generator=torch.Generator().manual_seed(0))
    x = orthogonalise(g, (3.4445, -4.7750, 2.0315), 5, 1e-7, torch.float32)
    assert x.dtype == torch.float32
    sv = torch.linalg.svdvals(x)  # the quintic's band around 1, not exactly 1
    assert float(sv.min()) > 0.6 and float(sv.max()) < 1.25


def test_muon_auto_takes_float32_on_the_cpu_and_bfloat16_on_an_accelerator():
    from eagle3x.draft.muon import Muon, ns_dtype_for

    assert ns_dtype_for("auto", torch.device("cpu")) == torch.float32
    assert ns_dtype_for("auto", torch.device("cuda", 0)) == torch.bfloat16
    assert ns_dtype_for("bfloat16", torch.device("cpu")) == torch.bfloat16
    with pytest.raises(ValueError, match="ns_dtype"):
        Muon([torch.nn.Parameter(torch.zeros(2, 2))], ns_dtype="fp8")
    auto = _muon_steps(Muon)[0]
    f32 = _muon_steps(Muon, ns_dtype="float32")[0]
    assert all(torch.equal(a, b) for a, b in zip(auto, f32))


def test_validation_reports_the_share_of_held_out_tokens_the_verifier_would_write(tiny_verifier):
    """val/verifier_choice: over every held-out batch, the share of step 0's positions
    whose next data token is the verifier's greedy one (ttt.verifier_choice). One batch is
    the verifier's own greedy text (every position counts), one is random tokens."""
    import dataclasses

    from eagle3x.config.schema import TrainConfig
    from eagle3x.draft.module import DraftModule
    from eagle3x.stages.train import plain

    shape = dict(hidden_size=128, target_hidden_size=128, intermediate_size=64, num_heads=2,
                 num_kv_heads=2, head_dim=64, draft_vocab_size=1024, target_vocab_size=1024)
    m = DraftModule(shape=shape, train=plain(dataclasses.asdict(TrainConfig())),
                    verifier=str(tiny_verifier), tied_head=False, aux_layer_ids=[1, 3, 4],
                    max_steps=20, d2t=torch.zeros(1024, dtype=torch.long),
                    t2d=torch.ones(1024, dtype=torch.bool))
    g = torch.Generator().manual_seed(2)
    t = 12
    batches = []
    for own in (True, False):
        last = torch.randn(2, t, 128, generator=g)
        ids = torch.randint(1, 1024, (2, t), generator=g)
        if own:  # x[p+1] is the verifier's greedy token after x[..p]
            ids[:, 1:] = (last @ m.head.T).argmax(-1)[:, :-1]
        batches.append({"input_ids": ids, "loss_mask": torch.ones(2, t, dtype=torch.uint8),
                        "lengths": torch.tensor([t, t - 3]),
                        "aux_hidden": torch.randn(2, t, 3 * 128, generator=g),
                        "last_hidden": last})
    logged = {}
    m.log_dict = lambda logs, **kw: logged.update({k: float(v) for k, v in logs.items()})
    m.log = lambda *a, **kw: None
    m.on_validation_epoch_start()
    with torch.no_grad():
        counts = [ttt_step_metrics(m.draft, dict(b), m.head, 3, 1.0) for b in batches]
        for i, b in enumerate(batches):
            m.validation_step(dict(b), i)
    m.on_validation_epoch_end()
    n = [int(c["count_0"]) for c in counts]
    hits = [int(c["verifier_choice"]) for c in counts]
    assert hits[0] == n[0] and hits[1] < n[1] // 10  # own text: all; random: about none
    assert logged["val/verifier_choice"] == pytest.approx(sum(hits) / sum(n))
