"""The serving layer over the ops: paged KV block management and continuous batching.

Pure Python over :mod:`pagedspec.ops`; devices are plain ``torch.device`` values.
"""
from pagedspec.engine.blocks import BlockManager, BlockOps, BlockTable, Evictor, KVCache, hash_block
from pagedspec.engine.scheduler import Scheduler, SchedulerConfig, StepBatch
from pagedspec.engine.sequence import Sequence, SequenceStatus

__all__ = ["BlockManager", "BlockOps", "BlockTable", "Evictor", "KVCache", "hash_block",
           "Scheduler", "SchedulerConfig", "StepBatch", "Sequence", "SequenceStatus"]
