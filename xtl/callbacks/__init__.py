"""Optional training features as Lightning callbacks."""

from xtl.callbacks.generation_eval import GenerationEval
from xtl.callbacks.hf_export import HFExport
from xtl.callbacks.throughput import Throughput

__all__ = ["GenerationEval", "HFExport", "Throughput"]
