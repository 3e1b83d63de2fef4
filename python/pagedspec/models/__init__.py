"""Model implementations over the ops, one file per architecture family, and the checkpoint
loader. ``llama.py`` covers ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` and ``MistralForCausalLM``.

    ckpt = load_checkpoint("/path/to/hf-dir")        # config, weight index, tokenizer path
    model = ckpt.load_model(torch.bfloat16, "cpu")   # a pagedspec.engine.model.CausalLM
"""
from pagedspec.models.llama import LlamaConfig, LlamaForCausalLM
from pagedspec.models.loader import (Checkpoint, CheckpointError, GenerationDefaults,
                                     load_checkpoint, resolve_model_path)

__all__ = ["Checkpoint", "CheckpointError", "GenerationDefaults", "LlamaConfig",
           "LlamaForCausalLM", "load_checkpoint", "resolve_model_path"]
