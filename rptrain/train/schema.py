"""Dataclass schemas for every config group, registered in Hydra's ConfigStore.

The YAML files in conf/ hold the values; these classes fix which keys exist and
their types, so a misspelled key or a wrong type fails while Hydra composes the
config, before anything runs. Groups whose options differ in shape (model, data)
have one schema per shape under ``schema/<group>/``; each YAML option names its
schema in its defaults list.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


# Enum members are lower case so that YAML and overrides spell them as users expect.
class Dtype(Enum):
    float16 = "float16"
    bfloat16 = "bfloat16"
    float32 = "float32"
    float64 = "float64"


class MasterDtype(Enum):
    fp32 = "fp32"
    bf16 = "bf16"  # stepped with stochastic rounding (rptrain.optim.Adam/AdamW)


class StateDtype(Enum):
    fp32 = "fp32"
    bf16 = "bf16"
    int8 = "int8"  # block-wise 8-bit moments


class Pipeline(Enum):
    tensor = "tensor"  # uint8 tensors in memory, whole-batch augmentation (fast)
    torchvision = "torchvision"  # the tutorial's per-sample PIL transforms behind a DataLoader


class AugmentDevice(Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class Grain(Enum):
    stage = "stage"
    layer = "layer"


class Decay(Enum):
    constant = "constant"
    cosine = "cosine"


class OnNonfinite(Enum):
    stop = "stop"  # one line naming the step, exit 2; the last checkpoint is kept
    skip = "skip"  # that step's update is skipped (as GradScaler does)


class ChatFormat(Enum):
    auto = "auto"  # told apart record by record by their keys
    messages = "messages"  # OpenAI's, tool calls included
    sharegpt = "sharegpt"  # {"conversations": [{"from", "value"}]}
    prompt_completion = "prompt_completion"
    alpaca = "alpaca"


class TrainOn(Enum):
    assistant = "assistant"  # every assistant turn
    completion = "completion"  # the last assistant turn
    all = "all"


class TooLong(Enum):
    truncate = "truncate"
    drop = "drop"


class Backend(Enum):
    auto = "auto"  # nccl when CUDA is available, gloo otherwise
    nccl = "nccl"
    gloo = "gloo"


# ----------------------------------------------------------------------------- model
class LoraExport(Enum):
    merged = "merged"  # RUN_DIR/hf: the base weights with the adapters folded in
    adapter = "adapter"  # RUN_DIR/adapter: the adapters alone, in PEFT's format


@dataclass
class LoraConfig:
    """model.lora for every decoder: the values are in conf/model/lora/default.yaml, which each
    decoder's model file includes (`- lora: default` in its defaults list)."""

    rank: int = MISSING  # 0: full fine-tuning; >0: LoRA adapters of this rank, the base weights frozen
    alpha: float = MISSING
    dropout: float = MISSING
    targets: list[str] = MISSING
    train_router: bool = MISSING
    export: LoraExport = MISSING


@dataclass
class ResNetConfig:
    _target_: str = "rptrain.models.build_model"
    name: str = MISSING
    num_classes: int = MISSING
    stem_channels: int = 32
    widths: list[int] = field(default_factory=lambda: [64, 128, 256, 512])


@dataclass
class LlamaModelConfig:
    _target_: str = "rptrain.models.build_model"
    name: str = MISSING
    vocab_size: Optional[int] = None  # None: the data's vocabulary (tokenizer or synthetic_tokens)
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: Optional[int] = None
    ffn_hidden: Optional[int] = None
    multiple_of: int = 256
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scale_factor: float = 1.0  # Llama 3.1/3.2 long-context rotary scaling; 1: none
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    init_std: float = 0.02
    loss_chunk_tokens: int = 4096
    fused: bool = False  # rptrain.models.DecoderConfig.fused: the elementwise work between the matmuls torch.compile'd
    weights: Optional[str] = None  # a local checkpoint (rptrain.models.load_weights), or a finished run: its directory or checkpoints/last.pt
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class Qwen3ModelConfig:
    """A published Qwen3 shape (rptrain.models.hf_presets), random init; the keys are config.json's."""

    _target_: str = "rptrain.models.build_model"
    name: str = MISSING
    vocab_size: Optional[int] = None  # None: the data's vocabulary (tokenizer or synthetic_tokens)
    hidden_size: int = MISSING
    intermediate_size: int = MISSING
    num_hidden_layers: int = MISSING
    num_attention_heads: int = MISSING
    num_key_value_heads: int = MISSING
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    tie_word_embeddings: bool = False
    max_seq_len: int = 40960  # rotary positions up to this (config.json's max_position_embeddings)
    init_std: float = 0.02
    loss_chunk_tokens: int = 4096
    fused: bool = False  # rptrain.models.DecoderConfig.fused: the elementwise work between the matmuls torch.compile'd
    weights: Optional[str] = None  # as LlamaModelConfig.weights


@dataclass
class MoeModelConfig:
    """A published mixture-of-experts shape (rptrain.models.hf_presets.MOE_PRESETS), random init, for
    benchmarks; the keys are config.json's, null keeps the published value."""

    _target_: str = "rptrain.models.build_model"
    name: str = MISSING
    vocab_size: Optional[int] = None  # None: the data's vocabulary (tokenizer or synthetic_tokens)
    hidden_size: Optional[int] = None
    intermediate_size: Optional[int] = None
    moe_intermediate_size: Optional[int] = None  # Qwen3-MoE's expert width (GPT-OSS: intermediate_size)
    num_hidden_layers: Optional[int] = None
    num_attention_heads: Optional[int] = None
    num_key_value_heads: Optional[int] = None
    head_dim: Optional[int] = None
    num_experts: Optional[int] = None
    num_experts_per_tok: Optional[int] = None
    output_router_logits: Optional[bool] = None  # true: the load-balancing loss joins the loss
    max_seq_len: int = MISSING  # rotary positions up to this (config.json's max_position_embeddings)
    init_std: float = 0.02
    loss_chunk_tokens: int = 4096
    fused: bool = False
    weights: Optional[str] = None  # as LlamaModelConfig.weights
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class HFModelConfig:
    """model=hf: a Hugging Face folder; the architecture comes from its config.json alone."""

    _target_: str = "rptrain.models.build_model"
    name: str = "hf"
    path: str = MISSING  # folder with config.json and *.safetensors (model.safetensors.index.json when sharded)
    max_seq_len: Optional[int] = None  # None: config.json's max_position_embeddings (x factor for dynamic rope)
    loss_chunk_tokens: int = 4096
    fused: bool = False  # rptrain.models.DecoderConfig.fused: the elementwise work between the matmuls torch.compile'd
    attention: str = "auto"  # auto | sdpa | flex (FlexAttention block masks on CUDA for packed rows and sliding windows)
    weights: Optional[str] = None  # another checkpoint of this model to load after the folder's weights
    lora: LoraConfig = field(default_factory=LoraConfig)


# ----------------------------------------------------------------------------- data
@dataclass
class CifarDataConfig:
    name: str = MISSING  # cifar10 | cifar100
    root: str = "data"
    download: bool = True
    verify_checksums: bool = True
    num_classes: int = MISSING
    pipeline: Pipeline = Pipeline.tensor
    augment_device: AugmentDevice = AugmentDevice.auto
    prefetch: bool = False  # prepare the next batch on a background thread while the engine's call waits
    chunk_batches: int = 16  # batches gathered and augmented together (tensor pipeline): fewer kernel launches per batch
    crop_padding: int = 4
    flip: bool = True
    mean: list[float] = MISSING
    std: list[float] = MISSING


@dataclass
class SyntheticImagesConfig:
    name: str = "synthetic"
    num_train: int = 10000
    num_test: int = 2000
    num_classes: int = 100
    image_size: int = 32
    noise: float = 40.0
    seed: int = 0
    augment_device: AugmentDevice = AugmentDevice.auto
    prefetch: bool = False  # prepare the next batch on a background thread while the engine's call waits
    chunk_batches: int = 16  # batches gathered and augmented together (tensor pipeline): fewer kernel launches per batch
    crop_padding: int = 4
    flip: bool = True
    mean: list[float] = field(default_factory=lambda: [0.5, 0.5, 0.5])
    std: list[float] = field(default_factory=lambda: [0.25, 0.25, 0.25])


@dataclass
class TextDataConfig:
    name: str = "text"
    path: str = MISSING
    tokenizer: Optional[str] = None  # byte | a tokenizer.json or its folder | None: the model's (model=hf), else byte
    eos_token: Optional[str] = None  # the token closing each document; None: tokenizer_config.json's, else a usual name
    seq_len: int = 256
    val_fraction: float = 0.1
    glob: Optional[str] = None  # a file pattern under data.path (e.g. "**/*.jsonl.txt"); None: .txt and .md files
    cache_dir: Optional[str] = None  # where the token cache goes; None: data.path/.rptrain_cache (a folder) or beside the file


@dataclass
class ChatDataConfig:
    name: str = "chat"
    path: str = MISSING
    format: ChatFormat = ChatFormat.auto
    tokenizer: Optional[str] = None  # byte | a tokenizer.json or its folder | None: the model's (model=hf), else byte
    eos_token: Optional[str] = None  # None: tokenizer_config.json's, else a usual name; generation stops there
    chat_template: Optional[str] = None  # None: the tokenizer's own (ChatML without one) | chatml | a .jinja file
    train_on: TrainOn = TrainOn.assistant
    max_seq_len: Optional[int] = None  # None: model.max_seq_len, at most 4096 (rptrain.train.data.CHAT_SEQ_LEN)
    too_long: TooLong = TooLong.truncate
    pack: bool = True
    val_fraction: float = 0.0


@dataclass
class SyntheticTokensConfig:
    name: str = "synthetic_tokens"
    num_train: int = 2048
    num_val: int = 128
    seq_len: int = 256
    vocab_size: int = 512
    branching: Optional[int] = 4
    seed: int = 0


# ----------------------------------------------------------------------------- precision
@dataclass
class GradScalerConfig:
    _target_: str = "rptrain.GradScaler"
    enabled: bool = False
    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000


@dataclass
class PrecisionConfig:
    compute_dtype: Dtype = Dtype.float16  # the engine's compute copy (the model's dtype)
    grad_scaler: GradScalerConfig = field(default_factory=GradScalerConfig)


# ----------------------------------------------------------------------------- run_config
@dataclass
class ExecutePlanConfig:
    """Fixed stage boundaries (rptrain.ExecutePlan.from_cuts); both None: the engine's planner decides."""

    forward: Optional[list[int]] = None  # layer indices where forward stages start (after layer 0)
    backward: Optional[list[int]] = None  # None: the forward cuts


@dataclass
class RunConfigConfig:
    """Every RoundPipeRunConfig field; None means the engine's default."""

    num_microbatch: Optional[int] = None
    requires_grad: Optional[bool] = None
    output_device: Optional[str] = None
    preserve_rng_state: Optional[bool] = None
    recompute_grain: Optional[Grain] = None
    split_input: Optional[str] = None  # import path of a callable, e.g. mypkg.batching:split
    split_label: Optional[str] = None
    merge_output: Optional[str] = None
    execute_plan: ExecutePlanConfig = field(default_factory=ExecutePlanConfig)


# ----------------------------------------------------------------------------- optim
@dataclass
class OptimizerConfig:
    _target_: str = "rptrain.optim.Adam"
    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.0
    amsgrad: bool = False


@dataclass
class ScheduleConfig:
    _target_: str = "rptrain.train.schedule.warmup_cosine"
    warmup_steps: int = 0
    decay: Decay = Decay.constant
    decay_steps: Optional[int] = None  # None: until the last step of the run
    min_lr_ratio: float = 0.0


@dataclass
class OptimConfig:
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    clip_grad_norm: Optional[float] = None
    master_dtype: MasterDtype = MasterDtype.fp32  # the engine's master weights (RoundPipe's optim_dtype); gradients follow
    state_dtype: StateDtype = StateDtype.fp32  # the optimizer's moments (its state_dtype argument)
    compile_step: bool = True  # torch.compile the low-precision step at first use (its compile_step argument)


# ----------------------------------------------------------------------------- trainer
@dataclass
class TrainerConfig:
    epochs: int = 20
    max_steps: Optional[int] = None  # stops after this many optimizer steps; wins over epochs
    batch_size: int = 128
    eval_batch_size: Optional[int] = None  # None: batch_size
    eval_num_microbatch: Optional[int] = None  # microbatches of an evaluation batch; None: run_config.num_microbatch
    drop_last: bool = False
    eval_interval: Optional[int] = None  # steps; None: at the end of every epoch (and always at the end)
    log_interval: int = 50
    checkpoint_interval: Optional[int] = None  # steps; None: at the end of every epoch (and always at the end)
    seed: int = 0
    num_workers: int = 2
    resume: Optional[str] = None  # None | auto | a checkpoint file or run directory
    async_step: bool = True
    progress: Optional[bool] = None  # None: a live bar on a terminal, plain log lines otherwise
    keep_checkpoints: int = 2  # the newest N checkpoints stay (checkpoints/step-*.pt)
    on_nonfinite: OnNonfinite = OnNonfinite.stop  # a NaN/inf loss without a GradScaler
    hf_export: bool = True  # language models: write the final weights as a Hugging Face folder, RUN_DIR/hf
    sample_prompts: Any = None  # None | a list of prompts | a text file, one prompt a line: generated at every evaluation
    sample_max_tokens: int = 64
    sample_temperature: float = 0.0  # 0: greedy
    objective: str = "test_loss"  # what the job returns to a sweeper (hydra/sweeper=optuna): a final metric


# ----------------------------------------------------------------------------- dist
@dataclass
class DistConfig:
    """Used only under torchrun (WORLD_SIZE > 1); rank, world size and devices come from its environment."""

    backend: Backend = Backend.auto
    timeout_s: float = 600.0  # a collective waits this long for a peer before the run fails


# ----------------------------------------------------------------------------- engine
@dataclass
class EngineConfig:
    """RoundPipe's remaining constructor arguments, and cuDNN's algorithm search."""

    cuda_graphs: bool = True
    compile: bool = False  # torch.compile the stage inside the whole-call graph (Tuning.compile_stages: engine/wholecall.py)
    fuse_microbatches: bool = True  # one GPU: a call's microbatches as one batch where exact (Tuning.fuse_microbatches: engine/fused_call.py)
    threads: Optional[int] = None  # PyTorch's intra-op threads; None: the cores free to the process (train/threads.py)
    optimizer_threads: Optional[int] = None  # None: the engine's default
    channels_last: Optional[bool] = None  # None: on for convolution models on CUDA (train/memory_format.py)
    cudnn_benchmark: bool = True  # torch.backends.cudnn.benchmark for the full training batches (train/kernels.py)
    max_host_memory: Optional[str] = None  # bytes or e.g. "96GiB"; None: physical memory less a reserve (engine/fit.py)
    max_gpu_memory: Optional[str] = None  # None: the GPU's free memory
    gpu_state: bool = True  # the leading layers' optimizer state on the GPU where it fits (engine/gpushare.py)
    single_version: Optional[bool] = None  # one version of the weights, synchronous steps; None: where two do not fit (engine/host.py)


# ----------------------------------------------------------------------------- logger
@dataclass
class JsonlLoggerConfig:
    """metrics.jsonl/.csv: always written; an option so that logger=[jsonl, ...] reads naturally."""


@dataclass
class TensorBoardLoggerConfig:
    log_dir: str = "tensorboard"  # relative: under the run directory


@dataclass
class WandbLoggerConfig:
    project: str = "rptrain"
    entity: Optional[str] = None
    name: Optional[str] = None  # None: the run directory's name
    tags: list[str] = field(default_factory=list)
    mode: str = "offline"  # offline | online | disabled


@dataclass
class MlflowLoggerConfig:
    tracking_uri: Optional[str] = None  # None: a file store under the run directory (mlruns/)
    experiment_name: str = "rptrain"
    run_name: Optional[str] = None  # None: the run directory's name


@dataclass
class LoggerConfig:
    """logger=[jsonl, tensorboard, wandb, mlflow]: each chosen option fills its field (train/loggers.py)."""

    jsonl: Optional[JsonlLoggerConfig] = None
    tensorboard: Optional[TensorBoardLoggerConfig] = None
    wandb: Optional[WandbLoggerConfig] = None
    mlflow: Optional[MlflowLoggerConfig] = None


@dataclass
class RPTrainConfig:
    model: Any = MISSING
    data: Any = MISSING
    precision: PrecisionConfig = MISSING
    run_config: RunConfigConfig = MISSING
    optim: OptimConfig = MISSING
    trainer: TrainerConfig = MISSING
    dist: DistConfig = MISSING
    engine: EngineConfig = MISSING
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    output_root: str = "outputs"


def register_configs() -> None:
    """Idempotent: the ConfigStore replaces nodes stored under the same name."""
    from .auto_precision import register_resolver

    register_resolver()  # precision=auto's ${rptrain.auto_precision:...}
    cs = ConfigStore.instance()
    cs.store(name="rptrain_schema", node=RPTrainConfig)
    cs.store(group="schema/model", name="resnet", node=ResNetConfig)
    cs.store(group="schema/model", name="llama", node=LlamaModelConfig)
    cs.store(group="schema/model", name="qwen3", node=Qwen3ModelConfig)
    cs.store(group="schema/model", name="hf", node=HFModelConfig)
    cs.store(group="schema/model", name="moe", node=MoeModelConfig)
    cs.store(group="schema/data", name="cifar", node=CifarDataConfig)
    cs.store(group="schema/data", name="synthetic", node=SyntheticImagesConfig)
    cs.store(group="schema/data", name="text", node=TextDataConfig)
    cs.store(group="schema/data", name="synthetic_tokens", node=SyntheticTokensConfig)
    cs.store(group="schema/data", name="chat", node=ChatDataConfig)
