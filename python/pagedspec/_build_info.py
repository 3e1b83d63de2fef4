"""What this build of pagedspec contains (:func:`build_info`); depends on the compiled library
only, so any layer may ask without importing the package's API."""
from __future__ import annotations

import torch

from pagedspec import _C

__version__ = "0.1.0"


def build_info() -> dict:
    """What this build of pagedspec contains.

    Returns a dict with ``backends`` (``["cpu"]`` or ``["cpu", "cuda"]``), ``cuda_archs`` (the
    archs the CUDA kernels were compiled for), ``cuda_version`` (nvcc's), ``torch_built``
    (torch the extension was compiled against), ``torch_runtime``, ``cuda_available`` (whether a
    GPU can be used now), ``attention_head_sizes`` (the head sizes the attention kernels are
    built for), ``cpu_isa_levels`` (the x86 levels the CPU kernels are built for),
    ``cpu_isa_supported`` (those this CPU runs) and ``cpu_isa`` (the one in use: the best
    supported, or ``PAGEDSPEC_CPU_ISA=baseline|avx2|avx512``) and ``cpu_amx`` (whether the
    avx512 level's attention with bf16 queries, on bf16 or FP8 caches, uses AMX tile multiplies:
    only when opted in with ``PAGEDSPEC_CPU_AMX=1`` on a CPU with AMX-BF16 that the OS allows)
    and ``cpu_bf16_dot`` and ``cpu_bf16_dot_fp8`` (whether that level's attention with bf16
    queries on a bf16 / an FP8 cache scores with AVX512-BF16 dot products for the tasks the AMX
    paths leave: by default on a CPU with them and AVX512-VBMI, unless
    ``PAGEDSPEC_CPU_BF16_DOT=0``; exact products summed in float32, P.V on the FMA path). AMX
    multiplies bf16-rounded probabilities, outside the contract's float32-level bound; every
    default path keeps it. And
    ``cpu_fp8_images`` (whether the FMA path at the level in use, which the other query types
    and the tasks the dot and AMX paths leave run, reads an FP8 tile as images converted once per
    tile for tasks of several blocks of query rows: at avx2, and at avx512 where the CPU has
    AVX512-VBMI, unless ``PAGEDSPEC_CPU_FP8_IMAGES=0``). ``cpu`` is that whole CPU
    configuration as the kernels resolve it for each call (``isa``, ``amx``, ``amx_decode``,
    ``bf16_dot``, ``fp8_images``, and the feature ``avx512_vbmi``); the ``cpu_*`` keys repeat
    its fields. Each ``PAGEDSPEC_CPU_*`` variable is unset, ``0`` or ``1`` (``PAGEDSPEC_CPU_ISA``:
    a level's name); another value raises RuntimeError naming it.
    """
    with_cuda = bool(_C.with_cuda)
    cpu = _C.cpu_config()
    return {
        "version": __version__,
        "backends": ["cpu", "cuda"] if with_cuda else ["cpu"],
        "cuda_archs": [a for a in _C.cuda_archs.split(",") if a],
        "cuda_version": _C.cuda_version or None,
        "torch_built": _C.torch_version,
        "torch_runtime": torch.__version__,
        "cuda_available": with_cuda and torch.cuda.is_available(),
        "attention_head_sizes": list(_C.attention_head_sizes),
        "cpu_isa_levels": list(_C.cpu_isa_levels),
        "cpu_isa_supported": list(_C.cpu_isa_supported),
        "cpu": cpu,
        "cpu_isa": cpu["isa"],
        "cpu_amx": cpu["amx"],
        "cpu_bf16_dot": cpu["bf16_dot"],
        "cpu_bf16_dot_fp8": cpu["bf16_dot"],
        "cpu_fp8_images": cpu["fp8_images"],
    }
