"""The model families megatrain ships: importing this module registers each of them (megatrain/model/registry.py).

Adding a family means adding its file (which calls `register` on its family), a line here, and its tests. The
order of the lines is the order messages list the native families in.
"""

# isort: off
from megatrain.model import llama
from megatrain.model import qwen3
from megatrain.model import gemma
from megatrain.model import hf_generic
# isort: on

__all__ = ["gemma", "hf_generic", "llama", "qwen3"]
