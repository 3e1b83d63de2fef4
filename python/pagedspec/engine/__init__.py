"""The serving layer over the ops: paged KV block management, continuous batching, a tiny model
runner and speculative decoding.

Pure Python over :mod:`pagedspec.ops`; devices are plain ``torch.device`` values.
"""
from pagedspec.engine.blocks import BlockManager, BlockOps, BlockTable, Evictor, KVCache, hash_block
from pagedspec.engine.model import ModelConfig, TinyLlama
from pagedspec.engine.runner import ModelRunner
from pagedspec.engine.scheduler import Scheduler, SchedulerConfig, StepBatch
from pagedspec.engine.sequence import Sequence, SequenceStatus
from pagedspec.engine.speculative import NgramProposer, SpeculativeDecoder

__all__ = ["BlockManager", "BlockOps", "BlockTable", "Evictor", "KVCache", "hash_block",
           "ModelConfig", "TinyLlama", "ModelRunner",
           "Scheduler", "SchedulerConfig", "StepBatch", "Sequence", "SequenceStatus",
           "NgramProposer", "SpeculativeDecoder"]
