"""Model implementations over the ops, one file per architecture family, and the checkpoint
loader. ``llama.py`` covers ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` and ``MistralForCausalLM``;
``gguf.py`` reads GGUF files (llama, qwen2) and converts them to Hugging Face directories.

    ckpt = load_checkpoint("/path/to/hf-dir")        # config, weight index, tokenizer path
    ckpt = load_checkpoint("model.gguf")             # or a GGUF file, or "smollm2-135m"
    model = ckpt.load_model(torch.bfloat16, "cpu")   # a pagedspec.engine.model.CausalLM
"""
from pagedspec.models.llama import LlamaConfig, LlamaForCausalLM
from pagedspec.models.loader import (CACHED_MODELS, Checkpoint, CheckpointError,
                                     GenerationDefaults, cached_model, default_model,
                                     load_checkpoint,
                                     model_cache_dir, resolve_model_path)

__all__ = ["CACHED_MODELS", "Checkpoint", "CheckpointError", "GenerationDefaults", "LlamaConfig",
           "LlamaForCausalLM", "cached_model", "default_model", "load_checkpoint", "model_cache_dir",
           "resolve_model_path"]
