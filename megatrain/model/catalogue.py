"""The model families megatrain ships: importing this module registers each of them (megatrain/model/registry.py).

Adding a family means adding its file (which calls `register` on its family), a line here, and its tests.
"""

from megatrain.model import gemma, hf_generic, llama, qwen3

__all__ = ["gemma", "hf_generic", "llama", "qwen3"]
