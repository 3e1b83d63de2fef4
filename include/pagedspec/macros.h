// Portability macros for the torch-free headers shared by the CPU and CUDA kernels.
#pragma once

#if defined(__CUDACC__) || defined(__HIPCC__)
#define PS_HOST_DEVICE __host__ __device__ __forceinline__
#define PS_DEVICE __device__ __forceinline__
#else
#define PS_HOST_DEVICE inline
#define PS_DEVICE inline
#endif
