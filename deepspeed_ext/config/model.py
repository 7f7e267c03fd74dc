"""DeepSpeedConfig: the whole config, one field per upstream top-level key.

Build it with deepspeed_ext.config.parse(): the parser rewrites deprecated keys, rejects unknown
ones with their full path, and records "auto" placeholders before pydantic sees the data.

[Note: auto placeholders]
A value written "auto" (the Hugging Face Trainer's convention) is not validated; its key path is
kept in unresolved_autos() and the typed field holds upstream's default meanwhile. An integration
fills the values with with_values(); the engine calls check_resolved() before using the config,
so a placeholder never silently turns into a default.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr

from .batch import TRIAD, BatchSizes, resolve
from .errors import ConfigError
from .schema import set_path
from .sections.activation_checkpointing import ActivationCheckpointingConfig
from .sections.aio import AioConfig
from .sections.amp import AmpConfig
from .sections.autotuning import AutotuningConfig
from .sections.bf16 import BF16Config
from .sections.checkpoint import CheckpointConfig
from .sections.comet import CometConfig
from .sections.comms_logger import CommsLoggerConfig
from .sections.communication import CommunicationConfig
from .sections.compile import CompileConfig
from .sections.compression_training import CompressionTrainingConfig
from .sections.csv_monitor import CSVMonitorConfig
from .sections.curriculum_learning import LegacyCurriculumConfig
from .sections.data_efficiency import DataEfficiencyConfig
from .sections.data_types import DataTypesConfig
from .sections.eigenvalue import EigenvalueConfig
from .sections.elasticity import ElasticityConfig
from .sections.expert_parallel import ExpertParallelConfig
from .sections.flops_profiler import FlopsProfilerConfig
from .sections.fp16 import FP16Config
from .sections.gradient_compression import GradientCompressionConfig
from .sections.hybrid_engine import HybridEngineConfig
from .sections.jsonl_monitor import JsonlMonitorConfig
from .sections.nebula import NebulaConfig
from .sections.optimizer import OptimizerConfig
from .sections.pipeline import PipelineConfig, PipelineParallelismConfig
from .sections.progressive_layer_drop import ProgressiveLayerDropConfig
from .sections.quantize_training import QuantizeTrainingConfig
from .sections.scheduler import SchedulerConfig
from .sections.sparse_attention import SparseAttentionConfig
from .sections.tensor_parallel import TensorParallelConfig
from .sections.tensorboard import TensorBoardConfig
from .sections.timers import TimersConfig
from .sections.torch_autocast import TorchAutocastConfig
from .sections.wandb import WandbConfig
from .sections.weight_quantization import WeightQuantizationConfig
from .sections.zero import ZeroConfig
from .types import AUTO, Bool, Float, FreeDict, Int, Str, ToLower

PositiveInt = Annotated[Int, Field(gt=0)]


def _inf_is_never(v: Any) -> Any:
    return None if isinstance(v, float) and v == math.inf else v


CommDtype = Annotated[Literal["fp32", "fp16", "bf16"], ToLower]


class DeepSpeedConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())

    # -- batch sizes (resolve_batch derives the missing ones) ---------------------------------
    train_batch_size: PositiveInt | None = None
    train_micro_batch_size_per_gpu: PositiveInt | None = None
    gradient_accumulation_steps: PositiveInt | None = None

    # -- optimization ----------------------------------------------------------------------------
    optimizer: OptimizerConfig = OptimizerConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    # Max global gradient norm; 0 disables clipping (upstream's default became 1.0 in 0.19).
    gradient_clipping: Float = Field(default=1.0, ge=0)
    zero_optimization: ZeroConfig = ZeroConfig()
    zero_allow_untested_optimizer: Bool = False
    zero_force_ds_cpu_optimizer: Bool = True

    # -- precision -------------------------------------------------------------------------------
    fp16: FP16Config = FP16Config()
    bf16: BF16Config = BF16Config()
    torch_autocast: TorchAutocastConfig = TorchAutocastConfig()
    data_types: DataTypesConfig = DataTypesConfig()
    # Module types (class names or dotted paths, e.g. ["LayerNorm"]) that compute in fp32
    # inside an fp16/bf16 model (runtime/precision/fp32_modules.py).
    fp16_override_modules: tuple[Str, ...] = ()

    # -- gradient communication ------------------------------------------------------------------
    prescale_gradients: Bool = False
    gradient_predivide_factor: Float = Field(default=1.0, gt=0)
    gradient_allreduce_op: Annotated[Literal["mean", "sum"], ToLower] = "mean"
    # None: the training precision's dtype.
    communication_data_type: CommDtype | None = None
    seq_parallel_communication_data_type: CommDtype | None = "fp32"
    disable_allgather: Bool = False
    use_data_before_expert_parallelism: Bool = False
    # Ulysses sequence parallelism: the data-parallel size is world_size / this.
    sequence_parallel_size: PositiveInt | None = None

    # -- logging and monitoring ------------------------------------------------------------------
    # None: no periodic progress line (upstream's default since 0.15; its docs still say 10).
    # Accelerate writes float("inf") to mean "never"; it is read as None.
    steps_per_print: Annotated[PositiveInt | None, BeforeValidator(_inf_is_never)] = None
    wall_clock_breakdown: Bool = False
    memory_breakdown: Bool = False
    dump_state: Bool = False
    log_level: Str | None = None
    tensorboard: TensorBoardConfig = TensorBoardConfig()
    csv_monitor: CSVMonitorConfig = CSVMonitorConfig()
    jsonl_monitor: JsonlMonitorConfig = JsonlMonitorConfig()
    wandb: WandbConfig = WandbConfig()
    comet: CometConfig = CometConfig()
    comms_logger: CommsLoggerConfig = CommsLoggerConfig()
    flops_profiler: FlopsProfilerConfig = FlopsProfilerConfig()
    timers: TimersConfig = TimersConfig()

    # -- memory and checkpoints --------------------------------------------------------------------
    activation_checkpointing: ActivationCheckpointingConfig = ActivationCheckpointingConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    aio: AioConfig = AioConfig()
    disable_python_gc: Bool = False
    dataloader_drop_last: Bool = False
    # Only a tensor-core alignment warning upstream.
    vocabulary_size: Int | None = None

    # -- parallelism and other engines ------------------------------------------------------------
    pipeline: PipelineConfig = PipelineConfig()
    pipeline_parallelism: PipelineParallelismConfig = PipelineParallelismConfig()
    tensor_parallel: TensorParallelConfig = TensorParallelConfig()
    expert_parallel: ExpertParallelConfig = ExpertParallelConfig()
    hybrid_engine: HybridEngineConfig = HybridEngineConfig()
    compile: CompileConfig = CompileConfig()
    autotuning: AutotuningConfig = AutotuningConfig()
    data_efficiency: DataEfficiencyConfig = DataEfficiencyConfig()
    # Present means on (a dict of options, or true).
    weight_quantization: WeightQuantizationConfig | None = None
    datastates_ckpt: FreeDict | Bool | None = None
    # Present means on: the data-parallel gradient exchange compressed.
    gradient_compression: GradientCompressionConfig | None = None
    communication: CommunicationConfig = CommunicationConfig()

    # -- removed upstream in 0.19; still accepted from older configs ------------------------------
    amp: AmpConfig | None = None
    compression_training: CompressionTrainingConfig = CompressionTrainingConfig()
    elasticity: ElasticityConfig = ElasticityConfig()
    sparse_attention: SparseAttentionConfig | None = None
    curriculum_learning: LegacyCurriculumConfig = LegacyCurriculumConfig()
    progressive_layer_drop: ProgressiveLayerDropConfig = ProgressiveLayerDropConfig()
    eigenvalue: EigenvalueConfig = EigenvalueConfig()
    quantize_training: QuantizeTrainingConfig = QuantizeTrainingConfig()
    nebula: NebulaConfig = NebulaConfig()
    sparse_gradients: Bool = False
    graph_harvesting: Bool = False

    # deepspeed_ext: false turns unknown keys from errors into one warning.
    strict: Bool = True

    _raw: dict[str, Any] = PrivateAttr(default_factory=dict)  # what the user gave
    _canonical: dict[str, Any] = PrivateAttr(default_factory=dict)  # aliases applied, autos kept
    _autos: tuple[str, ...] = PrivateAttr(default=())
    _source: str = PrivateAttr(default="<dict>")

    # -- what is not a plain field -------------------------------------------------------------
    @property
    def raw(self) -> dict[str, Any]:
        """A copy of the config as the user gave it."""
        return copy.deepcopy(self._raw)

    @property
    def source(self) -> str:
        """The file it came from, or "<dict>" / "<base64>"."""
        return self._source

    def to_dict(self) -> dict[str, Any]:
        """The effective config: every key with its value or default ("auto" where unfilled)."""
        out = self.model_dump(mode="json")
        for path in self._autos:
            set_path(out, path, AUTO)
        return out

    # Upstream's engine.config is the dict the user passed, and callers read it as one (the HF
    # Trainer: engine.config.get("zero_optimization", {}).get("stage")); plain values from to_dict.
    def get(self, key: str, default: Any = None) -> Any:
        return self.to_dict().get(key, default)

    def __getitem__(self, key: str) -> Any:
        return self.to_dict()[key]

    # -- "auto" placeholders (see [Note: auto placeholders]) ---------------------------------------
    def unresolved_autos(self) -> list[str]:
        return list(self._autos)

    def with_values(self, values: Mapping[str, Any]) -> DeepSpeedConfig:
        """A new config with the given dotted key paths set (how an integration fills "auto")."""
        from .parse import build  # parse builds this class

        data = copy.deepcopy(self._canonical)
        for path, value in values.items():
            set_path(data, path, value)
        return build(data, self._source, raw=self._raw)

    def check_resolved(self) -> None:
        if not self._autos:
            return
        keys = ", ".join(self._autos)
        raise ConfigError(
            f'{len(self._autos)} value(s) still "auto": {keys}. "auto" is a placeholder that an '
            "integration (e.g. the Hugging Face Trainer) must fill in; without one, set a value "
            "in the config",
            self._source,
        )

    # -- what the engine asks ------------------------------------------------------------------
    def model_parallel_size(self) -> int:
        """Ranks per model replica the config asks for: tensor slices x pipeline stages."""
        tp = max(self.tensor_parallel.autotp_size, 1)
        return tp * (self.pipeline_parallelism.num_stages or 1)

    def resolve_batch(
        self, world_size: int, world_size_source: str = "the world_size argument"
    ) -> BatchSizes:
        """train_batch_size, micro batch and accumulation steps for this data-parallel size."""
        autos = [k for k in TRIAD if k in self._autos]
        if autos:
            raise ConfigError(
                f'{", ".join(autos)} still "auto": an integration (e.g. the Hugging Face Trainer) '
                "must fill them in before the batch sizes can be resolved",
                self._source,
            )
        return resolve(
            self.train_batch_size,
            self.train_micro_batch_size_per_gpu,
            self.gradient_accumulation_steps,
            world_size,
            world_size_source,
        )
