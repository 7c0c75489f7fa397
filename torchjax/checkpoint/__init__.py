"""safetensors files read straight into jax arrays (sharded or not), and written back.

``load_file(path)`` returns tpu tensors whose data is a ``jax.Array`` read from the file:
no torch CPU copy is made. With a sharding (explicit, or from the active mesh), every
device's piece of a tensor is read on its own and placed on its device before the next
is read (a piece replicated on several devices is read once), so host memory holds one
device's slice at a time, not the whole tensor. ``load(path_or_dir)``
also reads Hugging Face sharded checkpoints (``model.safetensors.index.json``).
``save_file`` / ``save_model`` write ordinary safetensors files from tpu tensors.
"""

from torchjax.checkpoint._load import load as load
from torchjax.checkpoint._load import load_file as load_file
from torchjax.checkpoint._load import read_array as read_array
from torchjax.checkpoint._load import read_index as read_index
from torchjax.checkpoint._reader import SafetensorsFile as SafetensorsFile
from torchjax.checkpoint._save import load_model as load_model
from torchjax.checkpoint._save import save_file as save_file
from torchjax.checkpoint._save import save_model as save_model

__all__ = [
    "SafetensorsFile",
    "load",
    "load_file",
    "load_model",
    "read_array",
    "read_index",
    "save_file",
    "save_model",
]
