"""The serving layer over the ops: paged KV block management, continuous batching, the model
runner (any :class:`CausalLM`), sampling and speculative decoding.

Pure Python over :mod:`pagedspec.ops`; devices are plain ``torch.device`` values.
"""
from pagedspec.engine.block_manager import BlockManager, BlockOps, BlockTable
from pagedspec.engine.kv_cache import KVCache
from pagedspec.engine.prefix_cache import Evictor, hash_block
from pagedspec.engine.model import AttendFn, CausalLM
from pagedspec.engine.runner import ModelRunner
from pagedspec.engine.sampler import SamplingRow
from pagedspec.engine.scheduler import Scheduler, SchedulerConfig, StepBatch
from pagedspec.engine.sequence import Sequence, SequenceStatus
from pagedspec.engine.controller import SpecStats, SpeculationController
from pagedspec.engine.speculative import (DraftModelProposer, NgramProposer, Verification,
                                          verify_drafts)

__all__ = ["BlockManager", "BlockOps", "BlockTable", "Evictor", "KVCache", "hash_block",
           "AttendFn", "CausalLM", "ModelRunner", "SamplingRow",
           "Scheduler", "SchedulerConfig", "StepBatch", "Sequence", "SequenceStatus",
           "SpecStats", "SpeculationController", "DraftModelProposer", "NgramProposer",
           "Verification", "verify_drafts"]
