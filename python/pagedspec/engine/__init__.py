"""The serving layer over the ops: the :class:`Engine` (add / abort / step) and its
:class:`AsyncEngine` driver, one :class:`EngineConfig`, and what the engine is made of: paged KV
block management, continuous batching, the model runner (any :class:`CausalLM`), sampling,
speculative decoding and output processing.

Pure Python over :mod:`pagedspec.ops`; devices are plain ``torch.device`` values.
"""
from pagedspec.engine.async_engine import (AsyncEngine, EngineDeadError,
                                           EngineOverloadedError, RequestStream)
from pagedspec.engine.block_manager import BlockManager, BlockOps, BlockTable
from pagedspec.engine.config import EngineConfig
from pagedspec.engine.engine import Engine
from pagedspec.engine.metrics import FinishedRequestStats, SpecDecodingStats, StepStats
from pagedspec.engine.outputs import (CompletionOutput, Logprob, RequestMetrics, RequestOutput,
                                      RequestOutputKind, SamplingParams)
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

__all__ = ["AsyncEngine", "Engine", "EngineConfig", "EngineDeadError", "EngineOverloadedError",
           "RequestStream", "CompletionOutput", "Logprob", "RequestMetrics", "RequestOutput",
           "RequestOutputKind", "SamplingParams", "FinishedRequestStats", "SpecDecodingStats",
           "StepStats", "BlockManager", "BlockOps", "BlockTable", "Evictor", "KVCache", "hash_block",
           "AttendFn", "CausalLM", "ModelRunner", "SamplingRow",
           "Scheduler", "SchedulerConfig", "StepBatch", "Sequence", "SequenceStatus",
           "SpecStats", "SpeculationController", "DraftModelProposer", "NgramProposer",
           "Verification", "verify_drafts"]
