"""pagedspec: paged-KV attention, KV-cache management and speculative-decoding kernels.

Importing the package loads the compiled library, which registers every op under
``torch.ops.pagedspec``; :mod:`pagedspec.ops` has typed wrappers with shapes in their docstrings
and :mod:`pagedspec.reference` the pure-PyTorch meaning of each op. :class:`LLM` and
:class:`SamplingParams` are the offline serving API over local Hugging Face checkpoints;
:class:`pagedspec.engine.Engine` and :class:`pagedspec.engine.AsyncEngine` drive the same engine
one request and one step at a time.
"""
from __future__ import annotations

from pagedspec import _C  # noqa: F401  (registers torch.ops.pagedspec.*)
from pagedspec import _fake  # noqa: F401  (fake kernels for torch.compile / opcheck)
from pagedspec import ops, reference  # noqa: F401
from pagedspec._build_info import __version__, build_info  # noqa: F401
from pagedspec.engine.config import EngineConfig  # noqa: F401
from pagedspec.engine.outputs import (CompletionOutput, RequestOutput,  # noqa: F401
                                      RequestOutputKind, SamplingParams)
from pagedspec.llm import LLM  # noqa: F401

