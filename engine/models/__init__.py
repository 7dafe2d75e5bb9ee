"""Model families: one decoder covers Llama (incl. SmolLM2), Qwen3, Qwen3-MoE and Mixtral."""

from .decoder import DecoderModel

__all__ = ["DecoderModel"]
