"""Compiling the Relax Llama: the ``sandwich`` Relax pipeline and the cached artifact."""

from .artifact import CompiledModel, compile_model
from .pipeline import Elementwise, sandwich_pipeline

__all__ = ["CompiledModel", "compile_model", "Elementwise", "sandwich_pipeline"]
