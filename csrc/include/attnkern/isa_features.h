// The capabilities of one compiled copy of the CPU kernels, one macro each
// (0 or 1), derived from the level setup.py compiles the copy for (ATen's
// CPU_CAPABILITY_* macro): kernels test `#if ATTNKERN_HAS(AVX512)`, never the
// level names, so a new level is described here once. ATTNKERN_HAS is
// function-like so that a file testing it without this header fails to
// compile instead of reading 0.
#pragma once

#define ATTNKERN_HAS(capability) ATTNKERN_HAS_##capability

// AVX-512 F/BW/VL/DQ (the AVX512 level).
#if defined(CPU_CAPABILITY_AVX512)
#define ATTNKERN_HAS_AVX512 1
#else
#define ATTNKERN_HAS_AVX512 0
#endif

// AVX2 with FMA and F16C (the AVX2 level and every level above it).
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#define ATTNKERN_HAS_AVX2 1
#else
#define ATTNKERN_HAS_AVX2 0
#endif

// GNU C extensions: vector types, target attributes, inline assembly (g++ and
// clang; not MSVC).
#if defined(__GNUC__) && !defined(_MSC_VER)
#define ATTNKERN_HAS_GNU_EXTENSIONS 1
#else
#define ATTNKERN_HAS_GNU_EXTENSIONS 0
#endif
