"""HiddenStateDataModule: extracted shards as Lightning train / validation loaders.

Takes plain arguments (folder, split, batch size, seed, workers). Handed a
``HiddenStates`` source, `prepare_data()` builds whatever is missing (prepared data,
hidden states) through the extraction layer and engine, the same code ``stage=extract``
runs. `setup()` opens the shards memory-mapped. Training batches are packed (several
samples per row, `collate_packed`), validation batches pad to the longest sample; both
carry lengths and loss masks.
The training order is a pure function of the seed and the global sample index
(`StepBatchSampler`): a resumed run reads the same batches from the step it stopped at,
on any number of processes with the same global batch.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from eagle3x.config.schema import (EngineConfig, ExtractConfig, HiddenConfig, HiddenSource,
                                   LossOn, TrainConfig)
from eagle3x.data.extraction import HiddenStates
from eagle3x.data.shards import ShardReader
from eagle3x.plan import RunPlan, Split


def every_position(sample: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """`sample` with every position trained (train.loss_on=all): its loss mask all ones."""
    sample["loss_mask"] = torch.ones_like(sample["loss_mask"])
    return sample


class HiddenStateDataset(Dataset):
    """Samples `indices` of the shards; `all_positions`: each one's loss mask all ones."""

    def __init__(self, reader: ShardReader, indices: Sequence[int], all_positions: bool = False):
        self.reader, self.indices, self.all_positions = reader, list(indices), all_positions

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        s = self.reader[self.indices[i]]
        s["input_ids"] = s["input_ids"].long()
        if self.all_positions:
            every_position(s)
        return s  # aux_hidden and the teacher: last_hidden, or topk_ids + topk_logp


class OnlineDataset(Dataset):
    """The samples `indices` of the prepared data, their hidden states made by
    `features` (eagle3x.data.online.OnlineFeatures) a batch at a time; `all_positions`:
    each one's loss mask all ones."""

    def __init__(self, features: Any, indices: Sequence[int], all_positions: bool = False):
        self.features, self.indices, self.all_positions = features, list(indices), all_positions

    def __len__(self) -> int:
        return len(self.indices)

    def __getitems__(self, positions: Sequence[int]) -> List[Dict[str, torch.Tensor]]:
        out = self.features.samples([self.indices[p] for p in positions])
        for s in out:
            s["input_ids"] = s["input_ids"].long()
            if self.all_positions:
                every_position(s)
        return out

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        return self.__getitems__([i])[0]

    def schedule(self, batches: Sequence[Sequence[int]]) -> None:
        """Hand the features the batches (dataset positions) that come next."""
        self.features.schedule([[self.indices[p] for p in b] for b in batches])


def collate(samples: List[Dict[str, torch.Tensor]], steps: int = 0) -> Dict[str, torch.Tensor]:
    """Right-pad to the longest sample; `lengths` marks the real tokens. With `steps` (the
    training-time-test steps), also each step's trained positions (`with_positions`)."""
    lengths = torch.tensor([len(s["input_ids"]) for s in samples])
    t = int(lengths.max())
    out: Dict[str, torch.Tensor] = {"lengths": lengths}
    for key in samples[0]:
        first = samples[0][key]
        buf = first.new_zeros((len(samples), t, *first.shape[1:]))
        for i, s in enumerate(samples):
            buf[i, : len(s[key])] = s[key]
        out[key] = buf
    return with_positions(out, steps)


def collate_packed(samples: List[Dict[str, torch.Tensor]], steps: int = 0,
                   width: Optional[int] = None) -> Dict[str, torch.Tensor]:
    """The same samples packed into as few rows as first-fit-decreasing allows, each row as
    long as the longest sample, or `width` (a fixed shape: token-sized batches), no sample
    split: less padding to compute. Each position carries its document in the row
    (`docs`, -1 for padding), its position in that document (`positions`) and where the
    document ends (`doc_end`); `lengths` is each row's filled length; `cu_seqlens` cuts
    the flattened positions into the documents and padding tails (the fused attention
    kernel's segments). The draft's attention and training-time test keep the documents
    apart, so a packed batch gives the unpacked batch's loss and accuracy."""
    lengths = [len(s["input_ids"]) for s in samples]
    cap = max(max(lengths), width or 0)
    rows: List[List[int]] = []
    fill: List[int] = []
    for i in sorted(range(len(samples)), key=lambda i: (-lengths[i], i)):
        for r in range(len(rows)):
            if fill[r] + lengths[i] <= cap:
                rows[r].append(i)
                fill[r] += lengths[i]
                break
        else:
            rows.append([i])
            fill.append(lengths[i])
    b = len(rows)
    out: Dict[str, torch.Tensor] = {"lengths": torch.tensor(fill)}
    for key in samples[0]:
        first = samples[0][key]
        out[key] = first.new_zeros((b, cap, *first.shape[1:]))
    docs = torch.full((b, cap), -1, dtype=torch.long)
    positions = torch.zeros(b, cap, dtype=torch.long)
    doc_end = torch.zeros(b, cap, dtype=torch.long)
    cuts = [0]
    for r, members in enumerate(rows):
        at = 0
        for d, i in enumerate(members):
            n = lengths[i]
            for key in samples[i]:
                out[key][r, at:at + n] = samples[i][key]
            docs[r, at:at + n] = d
            positions[r, at:at + n] = torch.arange(n)
            doc_end[r, at:at + n] = at + n
            at += n
            cuts.append(r * cap + at)
        if at < cap:
            cuts.append((r + 1) * cap)
    out.update(docs=docs, positions=positions, doc_end=doc_end,
               cu_seqlens=torch.tensor(cuts, dtype=torch.int32))
    return with_positions(out, steps)


def with_positions(batch: Dict[str, torch.Tensor], steps: int) -> Dict[str, torch.Tensor]:
    """Add the batch's real tokens as a host int (`n_tokens`: throughput without reading
    the device) and, for `steps` > 0, each training-time-test step's trained positions
    (`select`: flat indices, draft.ttt.trained_positions) and their counts (`counts`),
    computed here on the host so the training step never waits on the device for them."""
    batch["n_tokens"] = int(batch["lengths"].sum())  # real tokens, readable on the host
    if steps > 0:
        from eagle3x.draft.ttt import trained_positions

        select = trained_positions(batch["loss_mask"], batch["lengths"], steps,
                                   batch.get("doc_end"))
        batch["select"] = select
        batch["counts"] = torch.tensor([len(x) for x in select])
    return batch


def token_batches(order: Sequence[int], lengths: Sequence[int], max_tokens: int) -> List[List[int]]:
    """`order` cut into consecutive micro-batches of at most `max_tokens` tokens each (a
    sample longer than that alone; startup refuses train.max_tokens < extract.max_seq_len)."""
    out: List[List[int]] = []
    cur: List[int] = []
    used = 0
    for i in order:
        n = int(lengths[i])
        if cur and used + n > max_tokens:
            out.append(cur)
            cur, used = [], 0
        cur.append(int(i))
        used += n
    if cur:
        out.append(cur)
    return out


class StepBatchSampler:
    """Batches as a function of the seed and the global sample index, whatever the number
    of processes.

    Each epoch e of the sample stream is a permutation seeded by (seed, e), cut into
    micro-batches: `batch_size` samples each, or (`max_tokens`, token-sized batches) as
    many consecutive samples as fit in `max_tokens` tokens (`token_batches`, by the
    samples' `lengths`). Optimizer step s reads the next world x accumulate micro-batches
    of the stream (the global batch); micro-batch i of that step on rank r of `world` is
    the (i*world + r)-th of them. An epoch ends at its last whole global batch. So one
    process with batch_size=G and two with G/2 train on the same samples at every step
    (sample-count batches), and a run resumed on another number of processes with the
    same global batch continues where it stopped (a global batch larger than the data:
    all of it, for one process; refused with several, whose slices would repeat samples).
    Iteration starts at micro-batch `start()`.
    """

    def __init__(self, n: int, batch_size: int, seed: int, start: Callable[[], int],
                 rank: int = 0, world: int = 1, accumulate: int = 1, total: int = 10 ** 9,
                 ahead: Optional[Callable[[List[List[int]]], None]] = None, ahead_n: int = 0,
                 horizon: Optional[int] = None, lengths: Optional[Sequence[int]] = None,
                 max_tokens: Optional[int] = None):
        from eagle3x.data.conversations import DataError

        if max_tokens is not None and lengths is None:
            raise ValueError("token-sized batches need the samples' lengths")
        if max_tokens is None:
            if world * accumulate == 1:
                batch_size = min(batch_size, n)  # a batch larger than the data: all of it
            elif batch_size * world * accumulate > n:
                raise DataError(
                    f"the global batch ({batch_size} x {world} processes x {accumulate} "
                    f"accumulated = {batch_size * world * accumulate} samples) is larger than "
                    f"the {n} training samples; lower train.batch_size or use more data")
        self.n, self.bs, self.seed, self.start = n, batch_size, seed, start
        self.lengths, self.max_tokens = lengths, max_tokens
        self.rank, self.world, self.accumulate, self.total = rank, world, accumulate, total
        self.per_step = world * accumulate  # micro-batches in one global batch
        self.global_batch = batch_size * world * accumulate
        if max_tokens is not None and len(self._epoch(0)) < self.per_step:
            raise DataError(
                f"the global batch ({world} processes x {accumulate} accumulated micro-batches "
                f"of train.max_tokens={max_tokens}) needs more tokens than the "
                f"{n} training samples hold; lower train.max_tokens or use more data")
        self._steps_before: List[int] = [0]  # global steps before epoch e (grown lazily)
        #: told the `ahead_n` batches after each one handed out (online hidden states),
        #: none at or past micro-batch `horizon` (the run's last: nothing made for nothing)
        self.ahead, self.ahead_n = ahead, ahead_n
        self.horizon = min(total, horizon if horizon is not None else total)

    def _epoch(self, epoch: int) -> List[List[int]]:
        """Epoch `epoch`'s micro-batches, cut to whole global batches (the last two kept)."""
        cache = self.__dict__.setdefault("_cuts", {})
        if epoch in cache:
            return cache[epoch]
        perm = np.random.default_rng([self.seed, epoch]).permutation(self.n)
        if self.max_tokens is None:
            cut = [perm[a:a + self.bs].tolist()
                   for a in range(0, self.n - self.bs + 1, self.bs)]
        else:
            cut = token_batches(perm, self.lengths, self.max_tokens)
        whole = max(len(cut) // self.per_step, 1) * self.per_step
        if len(cache) >= 2:
            cache.pop(next(iter(cache)))
        cache[epoch] = cut[:whole]
        return cache[epoch]

    def _locate(self, step: int) -> tuple:
        """(epoch, step within it) of global step `step`."""
        while self._steps_before[-1] <= step:
            e = len(self._steps_before) - 1
            self._steps_before.append(self._steps_before[-1] + len(self._epoch(e)) // self.per_step)
        e = int(np.searchsorted(self._steps_before, step, side="right")) - 1
        return e, step - self._steps_before[e]

    def batch(self, micro: int) -> List[int]:
        step, i = divmod(micro, self.accumulate)
        epoch, j = self._locate(step)
        return list(self._epoch(epoch)[j * self.per_step + i * self.world + self.rank])

    def tokens_per_batch(self) -> float:
        """Mean real tokens of a micro-batch over the first epoch (throughput figures)."""
        first = self._epoch(0)
        if self.lengths is None:
            return float(self.bs)
        return sum(int(self.lengths[i]) for b in first for i in b) / max(len(first), 1)

    def __iter__(self) -> Iterator[List[int]]:
        m = self.start()
        while m < self.total:
            if self.ahead is not None:
                self.ahead([self.batch(j) for j in range(m, min(m + 1 + self.ahead_n,
                                                               self.horizon))])
            yield self.batch(m)
            m += 1

    def __len__(self) -> int:
        return self.total


class HiddenStateDataModule(L.LightningDataModule):
    """Train / validation loaders over the hidden states in `hidden_dir`.

    `split` says which samples are held out (validation) and which train. Handed `source`
    (the plan, extraction settings and engine), ``prepare_data()`` first makes whatever is
    missing through the extraction layer; without it the folder must already be whole.
    """

    def __init__(self, hidden_dir: str | Path, split: Split, *, batch_size: int, seed: int = 0,
                 num_workers: Optional[int] = 0, verify: str = "size", pack: bool = True,
                 source: Optional[HiddenStates] = None,
                 online: Optional[Callable[[], Any]] = None, steps: int = 0,
                 max_tokens: Optional[int] = None, all_positions: bool = False):
        """`steps`: the training-time-test steps, for which each batch carries its trained
        positions (computed in the loader, not in the training step). `max_tokens`: batches
        of as many samples as fit in that many tokens, each packed into one row of exactly
        that width (one shape for every training batch), instead of `batch_size` samples.
        `num_workers` None: loader processes chosen for the device (`loader_workers`).
        `all_positions` (train.loss_on=all): training samples train every position;
        validation keeps the loss masks."""
        super().__init__()
        self.pack = pack
        self.hidden_dir, self.split, self.source = Path(hidden_dir), split, source
        #: hidden=online: makes the OnlineFeatures (engine opened) at setup; nothing stored
        self.online, self.features = online, None
        self.batch_size, self.seed, self.num_workers, self.verify = (
            batch_size, seed, num_workers, verify)
        self.steps, self.max_tokens, self.all_positions = steps, max_tokens, all_positions
        self.train_set: Optional[HiddenStateDataset] = None
        self.val_set: Optional[HiddenStateDataset] = None
        self._sampler: Optional[StepBatchSampler] = None

    @classmethod
    def from_plan(cls, plan: RunPlan, train: TrainConfig, extract: ExtractConfig,
                  engine: Optional[EngineConfig] = None,
                  hidden: Optional[HiddenConfig] = None) -> "HiddenStateDataModule":
        """The plan's hidden states with the training settings; given an engine, it builds
        missing prepared data and hidden states in ``prepare_data()``. With `hidden`
        online or server, they are made batch by batch while training
        (`hidden.prefetch` batches ahead) by the engine or the servers; none stored."""
        source = HiddenStates(plan, extract, engine or EngineConfig()) if (
            engine is not None or hidden is not None) else None
        make = None
        if hidden is not None and hidden.source is not HiddenSource.offline:
            make = functools.partial(online_features, plan, source, hidden)
        return cls(plan.hidden.folder, plan.split, batch_size=train.batch_size, seed=train.seed,
                   num_workers=train.num_workers, verify=extract.verify.value,
                   pack=train.pack, source=source, online=make, steps=train.ttt_steps,
                   max_tokens=train.max_tokens, all_positions=train.loss_on is LossOn.all)

    def prepare_data(self) -> None:
        """Make prepared data and hidden states when a source was handed over (online:
        the prepared data only)."""
        if self.online is not None:
            from eagle3x.data import prepared

            prepared.build(self.source.plan)
        elif self.source is not None:
            self.source.make()

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_set is not None:
            return
        if self.online is not None:
            # each training process makes its own batches with its own engine, on its device
            self.features = self.online(str(self.trainer.strategy.root_device)
                                        if self.trainer else None)
            n = self.split.extract_until(self.features.data["n"])
            hold, end = self.split.bounds(n)
            self.val_set = OnlineDataset(self.features, range(0, hold))
            self.train_set = OnlineDataset(self.features, range(hold, end), self.all_positions)
            return
        reader = ShardReader(self.hidden_dir, verify=self.verify,
                             repair_hint="python -m eagle3x stage=extract extract.verify=sha256")
        hold, end = self.split.bounds(len(reader))
        self.val_set = HiddenStateDataset(reader, range(0, hold))
        self.train_set = HiddenStateDataset(reader, range(hold, end), self.all_positions)

    def teardown(self, stage: Optional[str] = None) -> None:
        self.close()

    def close(self) -> None:
        """Stop the online engine (nothing to do offline)."""
        if self.features is not None:
            self.features.close()

    def mean_tokens_per_batch(self) -> float:
        """Average real tokens in a training batch (for throughput figures)."""
        if self._sampler is not None and self.max_tokens is not None:
            return self._sampler.tokens_per_batch()
        lengths = self._lengths(self.train_set.indices)
        return sum(lengths) / max(len(lengths), 1) * min(self.batch_size, len(lengths))

    def train_lengths(self) -> List[int]:
        """Every training sample's length in tokens (cost figures)."""
        return self._lengths(self.train_set.indices)

    def _lengths(self, indices: Sequence[int]) -> List[int]:
        source = self.features if self.features is not None else self.train_set.reader
        return [source.length(i) for i in indices]

    def _device(self) -> Optional[torch.device]:
        return self.trainer.strategy.root_device if self.trainer else None

    def loader_workers(self) -> int:
        """`num_workers`, or for None: worker processes that read and decode shards ahead
        of a GPU's step (up to 4, the CPU cores shared by the local ranks); none on the
        CPU, whose cores train, nor online (the engine lives in this process)."""
        if self.num_workers is not None:
            return self.num_workers
        device = self._device()
        if self.features is not None or device is None or device.type != "cuda":
            return 0
        import os

        ranks = max(torch.cuda.device_count(), 1)
        return max(1, min(4, (os.cpu_count() or 2) // (2 * ranks)))

    def _loader(self, data: Dataset, collate_fn: Callable, **kw: Any) -> DataLoader:
        workers = self.loader_workers()
        device = self._device()
        return DataLoader(data, collate_fn=collate_fn, num_workers=workers,
                          pin_memory=device is not None and device.type == "cuda",
                          persistent_workers=workers > 0,
                          prefetch_factor=4 if workers > 0 else None, **kw)

    def train_dataloader(self) -> DataLoader:
        trainer = self.trainer
        accumulate = trainer.accumulate_grad_batches if trainer else 1
        last = trainer.max_steps * accumulate if trainer and trainer.max_steps > 0 else None
        sampler = StepBatchSampler(
            len(self.train_set), self.batch_size, self.seed,
            start=lambda: (trainer.global_step * accumulate) if trainer else 0,
            rank=trainer.global_rank if trainer else 0, world=trainer.world_size if trainer else 1,
            accumulate=accumulate,
            ahead=self.train_set.schedule if self.features is not None else None,
            ahead_n=self.features.prefetch if self.features is not None else 0, horizon=last,
            lengths=self._lengths(self.train_set.indices) if self.max_tokens else None,
            max_tokens=self.max_tokens)
        self._sampler = sampler
        if self.pack:
            width = self.max_tokens
            collate_fn = functools.partial(collate_packed, steps=self.steps, width=width)
        else:
            collate_fn = functools.partial(collate, steps=self.steps)
        return self._loader(self.train_set, collate_fn, batch_sampler=sampler)

    def val_dataloader(self) -> Any:
        """The held-out samples; with several processes each takes every world-th one
        (when there are enough for all), and the module sums the counts across ranks.
        Token-sized training batches make token-sized validation batches too (the held-out
        samples in order, packed)."""
        if not self.val_set or len(self.val_set) == 0:
            return []
        rank, world = ((self.trainer.global_rank, self.trainer.world_size) if self.trainer
                       else (0, 1))
        data = self.val_set
        if self.val_sharded():
            mine = self.val_set.indices[rank::world]
            data = (OnlineDataset(self.features, mine) if self.features is not None
                    else HiddenStateDataset(self.val_set.reader, mine))
        if self.max_tokens is None:
            return self._loader(data, functools.partial(collate, steps=self.steps),
                                batch_size=self.batch_size)
        batches = token_batches(range(len(data)), self._lengths(data.indices), self.max_tokens)
        return self._loader(data, functools.partial(collate_packed, steps=self.steps),
                            batch_sampler=batches)

    def val_sharded(self) -> bool:
        world = self.trainer.world_size if self.trainer else 1
        return world > 1 and self.val_set is not None and len(self.val_set) >= world


def online_features(plan: RunPlan, source: HiddenStates, hidden: HiddenConfig,
                    device: Optional[str] = None) -> Any:
    """OnlineFeatures for the plan: its prepared data, the configured engine (opened
    now, in this thread) or the hidden-state servers, the run's storage format and dtype,
    the top-k head if needed. An hf engine with engine.device=auto goes on the training
    process's own GPU (`device`, the strategy's root device: cuda:2 for the first rank of
    trainer.devices=[2,3])."""
    from eagle3x.data import prepared
    from eagle3x.data.extraction import _teacher_head
    from eagle3x.data.online import OnlineFeatures
    from eagle3x.engines.base import open_engine
    from eagle3x.weights import FINAL_NORM_NAMES, find_tensor, torch_dtype

    def engine() -> Any:
        if hidden.source is HiddenSource.server:
            from eagle3x.engines.server import ServerEngine

            return ServerEngine(hidden.urls, find_tensor(plan.verifier.path, FINAL_NORM_NAMES),
                                plan.verifier.rms_norm_eps, len(plan.aux_layer_ids))
        settings = source.engine
        if settings.device == "auto" and device and device.startswith("cuda"):
            settings = dataclasses.replace(settings, device=device)
        # vLLM's captures pass through a hidden temporary folder in the run folder,
        # removed with the engine: nothing is left behind
        return open_engine(settings, plan.verifier, plan.aux_layer_ids,
                           source.extract.max_seq_len, plan.run_dir)

    data = prepared.load(plan.prepared.folder)
    head = _teacher_head(plan)
    return OnlineFeatures(data, engine, dict(plan.hidden_format),
                          torch_dtype(source.extract.dtype.value),
                          head.get if head is not None else None, hidden.prefetch)
