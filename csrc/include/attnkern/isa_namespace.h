// Headers shared by the CPU kernels and the CUDA kernels put their inline code
// in the per-level namespace of the CPU copy that includes them (see
// cpu_kernels.h), so that no copy links against another copy's instructions.
#pragma once

#if defined(CPU_CAPABILITY) && !defined(__CUDACC__) && !defined(__HIPCC__)
#define ATTNKERN_ISA_BEGIN inline namespace CPU_CAPABILITY {
#define ATTNKERN_ISA_END }
#else
#define ATTNKERN_ISA_BEGIN
#define ATTNKERN_ISA_END
#endif
