"""The speculative decoding engine shared by data generation, training and evaluation."""

from cospec.engine.config import EngineConfig
from cospec.engine.engine import Engine
from cospec.engine.trace import EngineStats, GenerationOutput, RoundTrace, SequenceResult

__all__ = ["Engine", "EngineConfig", "EngineStats", "GenerationOutput", "RoundTrace",
           "SequenceResult"]
