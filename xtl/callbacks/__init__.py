"""Optional training features as Lightning callbacks."""

from xtl.callbacks.activation_checkpointing import ActivationCheckpointing
from xtl.callbacks.activation_offload import ActivationOffload, OffloadStats
from xtl.callbacks.checkpoint import TrainingCheckpoint
from xtl.callbacks.compile import Compile
from xtl.callbacks.fp8 import FP8Training
from xtl.callbacks.generation_eval import GenerationEval
from xtl.callbacks.hf_export import HFExport
from xtl.callbacks.lm_eval import LMEval
from xtl.callbacks.lora import LoRA
from xtl.callbacks.parity_check import HFParityCheck
from xtl.callbacks.progress import StepProgressBar
from xtl.callbacks.qlora import QLoRA
from xtl.callbacks.rollout_trace import RolloutTrace
from xtl.callbacks.throughput import Throughput
from xtl.callbacks.watchdog import RankWatchdog

__all__ = [
    "ActivationCheckpointing",
    "ActivationOffload",
    "Compile",
    "FP8Training",
    "GenerationEval",
    "HFExport",
    "HFParityCheck",
    "LMEval",
    "LoRA",
    "OffloadStats",
    "QLoRA",
    "RankWatchdog",
    "RolloutTrace",
    "StepProgressBar",
    "Throughput",
    "TrainingCheckpoint",
]
