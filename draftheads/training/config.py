"""Typed configuration schemas behind ``conf/`` (Hydra structured configs): what every job shares.

Each drafter extends :class:`RunConfig` in its own folder (``draftheads/drafters/<name>/config.py``) and
``conf/<name>.yaml`` extends that schema; every field is documented where it is declared, a key that is not
declared is an error, and a choice field (an :class:`~draftheads.choice.Choice` enum) is checked when the config
is composed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf

from draftheads.choice import Choice
from draftheads.data.generation import GenerationSettings
from draftheads.data.regenerate import Reasoning
from draftheads.data.sources import PromptSource, Source
from draftheads.data.state_cache import StatesDtype
from draftheads.models.decoding import GenerationDefaults, target_sampling
from draftheads.models.speculative import Proposal, Sampling
from draftheads.models.target import TargetSpec
from draftheads.training.objectives import Objective

CONTEXT_BUCKETS = (0, 256, 512, 1024, 2048, 4096, 8192)
"""Default ``eval.context_buckets``: edges in tokens; the last bucket holds every longer context."""


class Format(Choice):
    """Row format of a data source (``data.format``)."""
    auto = "auto"
    messages = "messages"
    sharegpt = "sharegpt"
    prompt = "prompt"
    tokenized = "tokenized"


class Overlong(Choice):
    """What happens to a row over ``data.max_length``."""
    truncate = "truncate"
    drop = "drop"


class TrainOn(Choice):
    """Assistant turns trained on (``data.train_on``)."""
    all = "all"
    last = "last"


class SystemPolicy(Choice):
    """A leading system prompt (``data.system``)."""
    auto = "auto"
    keep = "keep"
    fold = "fold"
    drop = "drop"


class TargetStates(Choice):
    """Where training gets the target's states from (``data.target_states``): the outputs of the target layers
    a drafter reads (for Medusa, its last hidden state)."""
    online = "online"
    """A target forward (no autograd) per batch: least memory, most compute; drafters that read target layers
    only (DFlash, EAGLE-3)."""
    memory = "memory"
    """Computed once at the start of each run, kept in RAM."""
    disk = "disk"
    """Read from ``data.target_states_dir``, written once by ``train/cache_hidden_states.py`` with the same
    config."""


class MixedPrecision(Choice):
    """Autocast of training forwards (``trainer.mixed_precision``; in YAML write ``'no'`` quoted)."""
    auto = "auto"
    """bf16 where this machine computes it natively (a GPU; a CPU with AVX512-BF16 or AMX), float32 where bf16
    would be emulated, tens of times slower (:func:`~draftheads.models.precision.choose_precision`). The choice is
    printed at the start and recorded in ``config.yaml`` and the report."""
    bf16 = "bf16"
    fp16 = "fp16"
    no = "no"


class Optimizer(Choice):
    """The optimizer (``trainer.optimizer``), at ``trainer.lr`` and ``trainer.weight_decay`` either way."""
    adamw = "adamw"
    """AdamW (torch's, default betas) on every trainable parameter."""
    muon = "muon"
    """Muon (Jordan et al. 2024; torch's, momentum 0.95 Nesterov, 5 Newton-Schulz steps) on the hidden 2-D weight
    matrices, AdamW on embeddings, LM heads, norms and biases (``draftheads/training/optimizer.py``). Muon's rate is
    matched to AdamW's update RMS (Liu et al. 2025, "Muon is scalable for LLM training"), so the ``trainer.lr`` and
    ``weight_decay`` tuned for AdamW carry over, by their finding. DDP or one process only (refused under FSDP and
    DeepSpeed)."""
    auto = "auto"
    """Muon where it is cheap and allowed: bf16 native on this device (torch's Muon orthogonalises each update in
    bfloat16, which a CPU without bf16 instructions emulates, 10x slower per EAGLE-3 step) and DDP or one process;
    AdamW otherwise. Settled when the job starts (:func:`~draftheads.training.runtime.settle_optimizer`), printed,
    and recorded in ``config.yaml`` as the optimizer in effect; a resumed run keeps its own."""


class NonFinite(Choice):
    """What a NaN/inf loss does (``trainer.nonfinite``)."""
    stop = "stop"
    skip = "skip"


class UnusablePeers(Choice):
    """What a peer run that cannot be measured does (``eval.unusable_peers``)."""
    fail = "fail"
    skip = "skip"


class Tracker(Choice):
    """Experiment tracker (``tracker.name``)."""
    wandb = "wandb"
    tensorboard = "tensorboard"
    none = "none"


@dataclass
class ServerConfig:
    """An OpenAI-compatible server that answers instead of the in-process target (``vllm serve``, SGLang)."""
    base_url: str | None = None
    """e.g. ``http://localhost:8000/v1``; null: the target answers in-process through transformers."""
    model: str = "default"
    """The served model name."""
    api_key: str = "EMPTY"
    concurrency: int = 16
    """Requests in flight."""
    max_retries: int = 3
    """Retries per request (with backoff) before the conversation is counted as failed."""
    timeout_s: float = 600.0


@dataclass
class MixtureSource(PromptSource):
    """One component of a data mixture."""
    weight: float = 1.0
    """Share of the rows (training and validation) drawn from this source, relative to the other components."""


@dataclass
class DataConfig(PromptSource):
    """Training conversations (from any :class:`PromptSource`), answered by the target itself
    (self-distillation). Validation rows are chitchat's val split, or else the end of the source's list."""
    mixture: list[MixtureSource] = field(default_factory=list)
    """Several sources with weights; when set, the source fields above are ignored, unless they name a single
    source of their own (``data.path``, or a ``data.source`` other than chitchat): that source then replaces the
    mixture, so ``data.source=jsonl data.path=...`` trains on the file under a job whose default data is a mixture
    (``data=general``)."""
    format: Format = Format.auto
    """Row format: messages (OpenAI role/content), sharegpt (conversations from/value), prompt (prompt, question,
    instruction(+input) or turns), tokenized (input_ids + loss_mask, used as given); auto tells them apart."""
    num_train_prompts: int = 320
    """Rows read for training (bad rows count; they are skipped and reported)."""
    num_val_prompts: int = 32
    """Held-out rows (never trained on) for validation loss, head accuracy and stage-2 drift."""
    max_length: int = 384
    """Tokens per row (conversation rendered by the chat template)."""
    overlong: Overlong = Overlong.truncate
    """A row over max_length: truncate (kept if >= 2 trainable tokens remain) or drop; counted either way."""
    regenerate: bool = True
    """Replace every assistant turn by the target's own answer, turn by turn (self-distillation); false trains
    on the dataset's own assistant turns."""
    max_failed_fraction: float = 0.01
    """The share of conversations the regeneration may fail on (a server's errors or timeouts) before the job
    stops, naming them; below it they are left out and counted (``failed``). 1% by default: a few transient
    failures in a large regeneration, not a broken server training on what happened to come back."""
    train_on: TrainOn = TrainOn.all
    """Assistant turns trained on: all, or the last one only."""
    system: SystemPolicy = SystemPolicy.auto
    """A leading system prompt: auto (kept when the template accepts system turns, else folded into the first
    user turn), keep, fold, drop."""
    strict: bool = False
    """Fail on the first bad row (file, row, field) instead of skipping and counting it."""
    target_states: TargetStates = TargetStates.memory
    """Where training gets the target's states: online (per batch), memory (computed at the start of each run)
    or disk (the state cache at ``target_states_dir``); see :class:`TargetStates`."""
    target_states_dir: str | None = None
    """The state cache folder (safetensors shards + manifest); default ``<output_dir>/hidden_states``."""
    target_states_dtype: StatesDtype = StatesDtype.bfloat16
    """Dtype of the state cache on disk: bfloat16, float16, float32, or float8_e4m3fn (fp8 with a float32 scale
    per row and position, about half of bf16's bytes; :class:`~draftheads.data.state_cache.StatesDtype`); read
    back in the target's dtype, fp8 dequantised. Read by the cache only: states kept in memory
    (``target_states=memory``) stay in the target's dtype."""
    target_batch_size: int = 16
    """Rows per target forward outside training: the states computed at the start of a run or into the state
    cache, and the held-out validation."""
    hidden_states: str | None = None
    """Removed (:data:`RENAMED`): ``data.target_states``."""
    hidden_states_dir: str | None = None
    """Removed (:data:`RENAMED`): ``data.target_states_dir``."""
    hidden_states_dtype: str | None = None
    """Removed (:data:`RENAMED`): ``data.target_states_dtype``."""
    cache_shard_rows: int = 256
    """Rows per cache shard (the unit a killed caching run resumes from)."""
    generation: GenerationSettings = field(default_factory=GenerationSettings)
    server: ServerConfig = field(default_factory=ServerConfig)
    """Regenerate through a served model instead of the in-process target (same answers, real scale)."""
    reasoning: Reasoning = Reasoning.auto
    """A reasoning model's reasoning text that ``data.server`` returns apart from the answer: auto (kept where
    the chat template renders it: reasoning_content when it reads that, inline <think> blocks when it parses
    them, else dropped), inline, field (reasoning_content), drop."""
    thinking_fraction: float | None = None
    """For a reasoning target whose chat template has a thinking switch (``enable_thinking``, Qwen3): the share
    of rows, in [0, 1], rendered, answered and trained with thinking on; the others have it off (their prompt
    ends with the template's empty ``<think>`` block). Which rows is fixed per row by ``data.generation.seed``
    (training and validation rows each get the share). null: every row in the template's default rendering. A
    template with no switch is refused. See docs/data.md, "Reasoning modes"."""

    def __post_init__(self):
        if self.mixture and (self.path is not None or self.source != Source.chitchat):
            self.mixture = []  # a single source named (the command line's) replaces the preset's mixture
        if self.target_batch_size < 1:
            raise ValueError(f"data.target_batch_size={self.target_batch_size} must be >= 1")
        if self.thinking_fraction is not None and not 0 <= self.thinking_fraction <= 1:
            raise ValueError(f"data.thinking_fraction={self.thinking_fraction} must be in [0, 1] (or null: the "
                             "template's default rendering)")


@dataclass
class EvalSetConfig(PromptSource):
    """One held-out evaluation set for the speculative evaluator: chitchat's eval split (disjoint from
    training), HumanEval rows 0..39 (disjoint from data=humaneval), a jsonl file, or a hub dataset, e.g.
    ``{name: gsm8k, source: hub, path: openai/gsm8k, subset: main, split: test}``."""
    name: str = MISSING
    source: Source = MISSING
    num_prompts: int = 12
    min_prompt_tokens: int = 0
    """0: the source's prompts as they are. > 0: long prompts, for tau by context length: each joins consecutive
    pieces of the source (chitchat: its conversations' messages, in order; other sources: their prompts),
    separated by a blank line, until the prompt the target reads (chat template applied) holds at least this
    many of its tokens (``{name: long_chitchat, source: chitchat, min_prompt_tokens: 2048}``;
    :func:`~draftheads.data.conversations.long_prompts`). Keep it under the target's context length."""
    thinking: Any = None
    """For a chat template with a thinking switch (``enable_thinking``, Qwen3): the mode the prompts are rendered
    in: true, false, or both (measured once per mode, reported as two sets, ``<name>[thinking]`` and
    ``<name>[no_thinking]``); null: the template's default rendering, under the set's own name. A template with
    no switch is refused. (Typed Any: YAML's true/false are booleans, and a structured field cannot be a
    boolean or a word.)"""

    def __post_init__(self):
        if self.min_prompt_tokens < 0:
            raise ValueError(f"eval set {self.name!r}: min_prompt_tokens={self.min_prompt_tokens} must be >= 0")
        if self.thinking not in (None, True, False, "both"):
            raise ValueError(f"eval set {self.name!r}: thinking={self.thinking!r} must be true, false, both or null "
                             "(the template's default)")


@dataclass
class EvalConfig:
    """The speculative evaluator run at the end of training (and by ``train/evaluate.py``)."""
    enabled: bool = True
    max_new_tokens: int = 64
    """Tokens generated per prompt, by plain greedy decoding and by speculative decoding alike."""
    sets: list[EvalSetConfig] = field(default_factory=lambda: [
        EvalSetConfig(name="chitchat", source="chitchat"), EvalSetConfig(name="humaneval", source="humaneval")])
    tie_tolerance: float = 1e-4
    """A greedy mismatch whose top-2 target logits differ by less than this, or than the logits' resolution in
    their dtype (finfo.eps * |top-1 logit|: 0.125 for a bf16 logit of 20), is a floating-point tie."""
    temperatures: list[float] = field(default_factory=lambda: [0.0])
    """Each is a full evaluation. 0: greedy verification (output must equal plain greedy). > 0: lossless
    speculative sampling, target and draft processed with this temperature, top_k and top_p; the tree then
    uses typical acceptance at that temperature. ``[0, 0.7]`` puts both in one report."""
    top_k: int = 0
    top_p: float = 1.0
    proposal: Proposal = Proposal.argmax
    """How chain drafters propose at temperature > 0 (both lossless): argmax (q's argmax, verified with q one-hot:
    accepted with probability p(d), as vLLM's Medusa, EAGLE and DFlash proposers and SGLang propose: what the
    export does when served) or sample (drafts drawn from q, accepted with min(1, p/q): Leviathan et al.,
    z-lab's reference dflash package)."""
    seed: int = 0
    """Seed of the sampling generator (baseline and speculative draw from it in turn)."""
    peers: list[str] | None = None
    """Methods measured beside the drafter under test, by report name: medusa_chain, medusa_tree,
    medusa_tree_typical, dflash, dflash_denoise<N>, eagle3, dspark, dspark_adaptive (a peer run's too),
    prompt_lookup. null: all the run offers; []: none. A name no method has is refused when the job opens; one
    nothing measured (a skipped peer run's) is noted in the report's ``peer_runs``."""
    peer_runs: list[str] = field(default_factory=list)
    """Finished runs of any drafter for the same target, measured beside this run's drafter on the same
    prompts (each contributes its own methods: medusa_chain and medusa_tree, dflash, eagle3...). One that is
    missing, unfinished or made for another target fails the evaluation (a missing one when the job opens),
    unless ``unusable_peers: skip``."""
    unusable_peers: UnusablePeers = UnusablePeers.fail
    """A peer run that cannot be measured: fail (the job or ``train/evaluate.py`` stops naming it and why) or skip
    (a WARNING line and a note in the report's ``peer_runs``; what the default jobs ask for their sibling jobs'
    runs, which a user may not have trained)."""
    prompt_lookup_tokens: int = 10
    """Also measure transformers' prompt-lookup decoding (a model-free peer) with this many draft tokens,
    at every temperature; 0 skips it."""
    context_buckets: list[int] = field(default_factory=lambda: list(CONTEXT_BUCKETS))
    """Edges, in tokens, of the context-length buckets that ``by_context_length`` reports tau and acceptance per
    position in (a verification step's context: the prompt plus the tokens generated before it): bucket i holds
    steps at ``[edge i, edge i+1)``, the last every longer one. Starts at 0, strictly increasing. Long prompts
    to fill the upper buckets: an eval set's ``min_prompt_tokens``."""

    def samplings(self) -> list[Sampling]:
        """One :class:`~draftheads.models.speculative.Sampling` per temperature. Raises ``ValueError`` for a
        negative temperature or top_k, or top_p outside (0, 1]."""
        return [Sampling(t, self.top_k, self.top_p, self.proposal) for t in self.temperatures]

    def __post_init__(self):
        self.samplings()  # invalid sampling settings fail when the config is made, not after training
        edges = list(self.context_buckets)
        if not edges or edges[0] != 0 or any(b <= a for a, b in zip(edges, edges[1:])):
            raise ValueError(f"eval.context_buckets={edges}: edges in tokens, starting at 0, strictly increasing "
                             f"(e.g. {list(CONTEXT_BUCKETS)})")


@dataclass
class StageConfig:
    """One training stage."""
    enabled: bool = True
    epochs: float = 1.0
    """Passes over the training rows (fractions allowed)."""
    max_steps: int | None = None
    """Stop after this many optimizer steps, whatever ``epochs`` says."""


@dataclass
class TrainerConfig:
    """Optimisation and the checkpoint policy, shared by every stage and drafter."""
    lr: float = 1e-3
    optimizer: Optimizer = Optimizer.adamw
    """adamw, or muon on hidden weight matrices with AdamW on the rest (:class:`Optimizer`)."""
    mixed_precision: MixedPrecision = MixedPrecision.auto
    """Autocast for training forwards: auto (bf16 where native, else float32), bf16, fp16 or no. Weights and
    optimizer states stay float32. The LM-head projections that dominate head training run ~2.4x faster in bf16 on
    CPUs with AVX512-BF16, and tens of times slower on CPUs without it (an explicit bf16 there is kept, with a
    warning)."""
    weight_decay: float = 0.0
    warmup_ratio: float = 0.05
    max_grad_norm: float = 1.0
    batch_size: int = 8
    """Rows per process per micro-batch, right-padded to the longest: read only with ``tokens_per_batch: null``
    (packed micro-batches, the default, are sized by tokens)."""
    tokens_per_batch: int | None = 1280
    """Micro-batches sized by tokens (the default; ``null``: ``batch_size`` rows, padded), for every drafter and
    stage: 1280 give the embedded jobs' 384 rows 48 micro-batches an epoch, as 8 padded rows did (a target's
    preset may set its own: ``conf/model/gemma3.yaml``). Rows are packed into one sequence of at
    most this many tokens per process, without padding (positions restart per row; a longer row is a micro-batch
    alone). Attention and labels never cross rows, and no row's scores are computed against another's (except
    with ``eager`` attention, which stays dense): the target attends row by row (flash-attention's varlen kernel,
    or ``sdpa`` once per row: :func:`~draftheads.models.packed_attention.rows_attend_alone`), and DFlash's and
    EAGLE-3's drafters read the rows one per line (:func:`~draftheads.data.batching.unpack`), their batches
    keeping rows times the longest row within the budget. Every process runs the same number of micro-batches
    per epoch: a share that packs into fewer splits some in two (:class:`~draftheads.data.batching.BatchPlan`)."""
    grad_accum: int = 1
    seed: int = 0
    log_every: int = 10
    checkpoint_every: int = 100
    """Optimizer steps between checkpoints (one is always written at the end of a stage)."""
    keep_last: int = 2
    """Checkpoints kept; older ones are deleted after a new one is complete."""
    hidden_states_batch_size: int | None = None
    """Removed (:data:`RENAMED`): ``data.target_batch_size``."""
    collective_timeout_min: int = 180
    """How long ranks wait at a barrier: for the slowest rank's share of the regeneration, and for rank 0's
    final validation, export and evaluation. A rank that fails still ends the others at once (accelerate
    launch / torchrun stops them)."""
    nonfinite: NonFinite = NonFinite.stop
    """A NaN/inf loss on any rank: stop (error naming stage, step, batch and rows) or skip the batch (counted
    as ``<stage>/skipped_nonfinite``; needs grad_accum 1). Checked every micro-batch (one scalar sync)."""
    count_flops: bool = False
    """Count the model FLOPs of the first micro-batch (forward + backward matrix products, attention scores
    excluded; torch's FlopCounterMode) and log ``perf/tflops_per_s`` per process from them: divided by the
    device's peak, model FLOPs utilisation."""

    def __post_init__(self):
        positive = {"lr": self.lr, "batch_size": self.batch_size, "grad_accum": self.grad_accum,
                    "log_every": self.log_every, "checkpoint_every": self.checkpoint_every,
                    "max_grad_norm": self.max_grad_norm,
                    "tokens_per_batch": 1 if self.tokens_per_batch is None else self.tokens_per_batch}
        bad = [f"trainer.{k}={v}" for k, v in positive.items() if not v > 0]
        bad += [f"trainer.{k}={v}" for k, v in (("weight_decay", self.weight_decay), ("keep_last", self.keep_last))
                if v < 0]
        if bad or not 0 <= self.warmup_ratio <= 1:
            raise ValueError(f"{', '.join(bad) or f'trainer.warmup_ratio={self.warmup_ratio}'}: learning rate, batch "
                             f"sizes, intervals and the clipping norm must be > 0, weight decay and keep_last >= 0, "
                             f"warmup_ratio in [0, 1]")


@dataclass
class TrackerConfig:
    """Experiment tracking through accelerate's trackers."""
    name: Tracker = Tracker.wandb
    """wandb (offline unless logged in), tensorboard, or none."""
    project: str = "draftheads"


class TargetBackend(Choice):
    """Who runs the target to make the state cache (``target_backend``)."""
    transformers = "transformers"
    """The target in process, under accelerate (each rank its share of the shards)."""
    vllm = "vllm"
    """vLLM, in its own environment, with its own parallelism (``vllm.*``): for a target one trainer cannot hold."""


@dataclass
class VllmEngineConfig:
    """vLLM as the target's engine (``target_backend=vllm``) and as the serving preflight's server
    (``serving.preflight``)."""
    venv: str | None = None
    """vLLM's environment, made on first use (default ``$DRAFTHEADS_CACHE/vllm-venv``, as ``train/vllm_parity.py``);
    also the serving preflight's (``serving.preflight``; there null reads ``$DRAFTHEADS_VLLM_VENV``)."""
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    engine_args: dict[str, Any] = field(default_factory=dict)
    """Any other argument of vLLM's ``LLM`` (``gpu_memory_utilization``, ``max_num_seqs``, ``quantization``...)."""

    def engine(self) -> dict[str, Any]:
        """The ``LLM`` arguments: the parallel sizes and ``engine_args``."""
        return {"tensor_parallel_size": self.tensor_parallel_size,
                "pipeline_parallel_size": self.pipeline_parallel_size,
                "data_parallel_size": self.data_parallel_size, **self.engine_args}


class Preflight(Choice):
    """Whether a training job runs the serving preflight (``serving.preflight``;
    :mod:`draftheads.serving.preflight`) before computing any target state."""
    auto = "auto"
    """When a vLLM environment is named (``vllm.venv`` or ``$DRAFTHEADS_VLLM_VENV``), its vLLM serves the drafter's
    method (read from its source) and the drafter has a preflight (not Medusa); else skipped, saying why."""
    on = "on"
    """Always: the vLLM environment is made on first use (as ``train/vllm_parity.py``), and a vLLM that does not
    serve the drafter, an engine that refuses the export or a drafter without a preflight stops the job."""
    off = "off"
    """Never."""


@dataclass
class ServingConfig:
    """Serving the export while training: the preflight that has vLLM read the untrained export first."""
    preflight: Preflight = Preflight.auto
    """auto, on or off (:class:`Preflight`): vLLM loads the untrained export, drafts a few tokens of one prompt,
    and its engine's readings (target layer ids, EAGLE-3.1 norm flags, draft length, draft vocabulary, mask
    token, draft max_model_len) are held to what the job means; a mismatch stops the job before any target state
    is computed, naming the key, our value and the server's (docs/serving.md, "Preflight"). The engine is
    ``vllm.*``'s (``vllm.engine_args``: on a GPU the training job shares, e.g. ``gpu_memory_utilization``)."""
    llamacpp_preflight: Preflight = Preflight.off
    """The same check in llama.cpp's llama-server (:func:`~draftheads.runs.preflight.llamacpp_preflight`): the
    untrained export made a GGUF by llama.cpp's converter, loaded beside the target's float GGUF, a few tokens
    drafted, and what the server says it read (target layers, mask token, draft length) held to what the job
    means; settings llama.cpp does not read (EAGLE-3.1's ``norm_output``, ``fc_norm``, the last layer's output as
    a feature) fail it too. ``auto``: when a llama.cpp build is found (``$DRAFTHEADS_LLAMACPP``,
    ``$DRAFTHEADS_CACHE/llamacpp``); ``on``: built on first use; ``off`` (default): never."""
    preflight_tokens: int = 8
    """Tokens generated for the one prompt the preflight drafts on."""

    def __post_init__(self):
        if self.preflight_tokens < 2:
            raise ValueError(f"serving.preflight_tokens={self.preflight_tokens} must be >= 2 (a draft needs a "
                             f"verified token before it)")


@dataclass
class DrafterConfig(Objective):
    """What every drafter's config section (``medusa``, ``dflash``, ``eagle3``, ``dspark``) has, whatever the
    drafter: its training objective (:class:`~draftheads.training.objectives.Objective`) and where its weights
    start."""
    init_from: str | None = None
    """null (default): random initialisation. A finished run's folder (its saved drafter) or an export folder in a
    format draftheads writes (``<run>/export/<name>``; Medusa's ``export/vllm``, ``export/tgi`` or
    ``medusa_heads``) to start training from, made for a target of the same sizes (a target fine-tuned since is
    what it is for: docs/refresh.md). DSpark also starts from a DFlash run or export (its Markov and confidence
    heads fresh); Medusa's heads start stage 1 (stage 2 continues from stage 1 as always). Checked when the job
    opens, before any work: another target's sizes, other target layers, another depth or head count are refused
    naming the key, the file and both values. ``resume=true`` with a checkpoint ignores it. What was loaded is in
    ``report.json`` (``init_from``); see :mod:`draftheads.training.warm_start`."""


@dataclass
class RunConfig:
    """What every training job shares: target, data, optimisation, evaluation, tracking, run directory."""
    model: TargetSpec = field(default_factory=TargetSpec)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    tracker: TrackerConfig = field(default_factory=TrackerConfig)
    output_dir: str = "runs/run"
    """Run directory: config.yaml, checkpoints/, report.json, plots, export/. The same on every rank."""
    cache_dir: str = "${oc.env:DRAFTHEADS_CACHE,${oc.env:HOME}/.cache/draftheads}"
    """Converted models and regenerated data, reused across runs."""
    resume: bool = False
    """Continue from the latest checkpoint in output_dir."""
    overwrite: bool = False
    """Start afresh in an output_dir that holds a training run: the old run's files (``RUN_ENTRIES`` in
    draftheads/runs/output_dir.py: checkpoints, ledger, report, saved drafter, exports, tracker files) are
    deleted first, all but the state cache this job reads (``data.target_states=disk``); a folder that also holds
    files no run writes is refused. Without it such an output_dir is refused unless resuming."""
    export: bool = True
    """Write the drafter's server formats under output_dir/export at the end (a drafter whose export is also
    its saved model, like DFlash's export/dflash, writes it either way)."""
    target_backend: TargetBackend = TargetBackend.transformers
    """Who computes the states ``train/cache_hidden_states.py`` writes: the target in process (transformers) or
    vLLM (then the job holds only the target's ends, ``model.partial``, and vLLM the whole target)."""
    vllm: VllmEngineConfig = field(default_factory=VllmEngineConfig)
    serving: ServingConfig = field(default_factory=ServingConfig)
    """The serving preflight (:class:`ServingConfig`)."""
    drafter: str = MISSING
    """The drafter this run trains, a name in the registry (``draftheads.drafters.DRAFTERS``); set by each
    drafter's schema and recorded in the run's config.yaml, where evaluation, export, parity and the state
    cache read it."""


@dataclass
class RegenerateConfig:
    """``train/regenerate.py``: a dataset answered by the target, turn by turn, written as JSONL."""
    model: TargetSpec = field(default_factory=TargetSpec)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Not read here: declared so that a target's preset sizing the training jobs as well
    (``conf/model/gemma3.yaml`` sets ``trainer.tokens_per_batch``) composes with regeneration too."""
    output: str = "regenerated.jsonl"
    """Output JSONL (``messages`` per conversation); resumable: a rerun continues it."""
    vllm: VllmEngineConfig = field(default_factory=VllmEngineConfig)
    """vLLM's environment and parallelism, for ``data.generation.engine=vllm``."""
    limit: int | None = None
    """Rows read from the source (null: all)."""
    cache_dir: str = "${oc.env:DRAFTHEADS_CACHE,${oc.env:HOME}/.cache/draftheads}"
    """Converted models (GGUF targets)."""


def apply_generation_defaults(conf, generation_config) -> None:
    """With ``model.generation_defaults=apply``, the target's sampling defaults (``generation_config``'s
    do_sample, temperature, top_k, top_p: :func:`~draftheads.models.decoding.target_sampling`) replace
    ``data.generation``'s and, on a :class:`RunConfig`, the evaluation's (one temperature) in place; with
    ``ignore`` nothing changes. Raises ``ValueError`` for a default no path can apply."""
    if conf.model.generation_defaults != GenerationDefaults.apply:
        return
    temperature, top_k, top_p = target_sampling(generation_config)
    conf.data.generation = dataclasses.replace(conf.data.generation, temperature=temperature, top_k=top_k,
                                               top_p=top_p)
    if isinstance(conf, RunConfig):
        conf.eval = dataclasses.replace(conf.eval, temperatures=[temperature], top_k=top_k, top_p=top_p)


RENAMED = {"data.hidden_states": "data.target_states (memory as before; offline is now disk)",
           "data.hidden_states_dir": "data.target_states_dir", "data.hidden_states_dtype": "data.target_states_dtype",
           "trainer.hidden_states_batch_size": "data.target_batch_size",
           "dflash.features": "data.target_states (precomputed is now memory or disk; online stays online)",
           "eagle3.features": "data.target_states (precomputed is now memory or disk; online stays online)",
           "medusa.decay": "medusa.position_decay (the same form: head k weighs position_decay ** k)",
           "eagle3.step_decay": "eagle3.position_decay (the same weights: step k weighs position_decay ** k)",
           "dflash.loss_decay": "dflash.position_decay (exp(-(k-1)/d) is position_decay = exp(-1/d))"}
"""Keys that were one knob's halves, said "hidden states" for the target's states, or named per-position loss
weights three ways, and what replaced them:
still declared (None) so that a config setting one composes, then is refused naming its successor."""


def to_schema(cfg: DictConfig):
    """The composed config as typed objects. Raises ``ValueError`` naming any key the schema does not declare
    (Hydra lets ``+group.key=...`` add keys to a structured node; they would be silently ignored) or a
    :data:`RENAMED` key that is set, naming what replaced it."""
    _reject_undeclared(cfg, "")
    renamed = [f"{old} is now {new}" for old, new in RENAMED.items() if OmegaConf.select(cfg, old) is not None]
    if renamed:
        raise ValueError(f"removed config key(s): {'; '.join(renamed)}")
    conf = OmegaConf.to_object(cfg)
    _check_stages(conf)
    return conf


def _check_stages(conf) -> None:
    """``ValueError`` naming each enabled stage (a :class:`StageConfig` field) that would train nothing:
    ``epochs`` not above 0, ``max_steps`` below 1 (the spine would still take a step and call it finished)."""
    bad = []
    for f in dataclasses.fields(conf) if dataclasses.is_dataclass(conf) else ():
        stage = getattr(conf, f.name)
        if isinstance(stage, StageConfig) and stage.enabled:
            bad += [f"{f.name}.epochs={stage.epochs}"] if not stage.epochs > 0 else []
            bad += [f"{f.name}.max_steps={stage.max_steps}"] if stage.max_steps is not None and stage.max_steps < 1 \
                else []
    if bad:
        raise ValueError(f"{', '.join(bad)}: an enabled stage trains for epochs > 0 and max_steps >= 1 (null: no cap); "
                         f"<stage>.enabled=false skips a stage")


def _reject_undeclared(node, path: str) -> None:
    if isinstance(node, DictConfig):
        schema = OmegaConf.get_type(node)
        if dataclasses.is_dataclass(schema):
            declared = {f.name for f in dataclasses.fields(schema)}
            unknown = sorted(set(node.keys()) - declared)
            if unknown:
                raise ValueError(f"unknown config key(s) {[path + k for k in unknown]}; "
                                 f"{path.rstrip('.') or 'the root'} declares {sorted(declared)}")
        for key in node.keys():
            _reject_undeclared(node._get_node(key), f"{path}{key}.")
    elif isinstance(node, ListConfig):
        for i in range(len(node)):
            _reject_undeclared(node._get_node(i), f"{path}{i}.")
