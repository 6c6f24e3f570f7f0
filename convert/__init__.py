"""Weight conversion: GGUF files and HF checkpoints -> (ModelConfig, params); orbax I/O.

Knows nothing about decoding. Key maps per family live in `keymaps.py`.
"""

from .checkpoint import restore_checkpoint, save_checkpoint
from .gguf_weights import config_from_gguf, load_gguf, open_gguf
from .hf_weights import load_hf_dir, params_from_hf_state_dict
from .tokenizer import IncrementalDetokenizer, NoChatTemplateError, Tokenizer

__all__ = [
    "config_from_gguf", "load_gguf", "load_hf_dir", "open_gguf", "params_from_hf_state_dict",
    "restore_checkpoint", "save_checkpoint", "Tokenizer", "IncrementalDetokenizer",
    "NoChatTemplateError",
]
