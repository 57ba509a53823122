// The row-wise kernels as one translation unit (a unity build): each source
// parses ATen's headers once per instruction-set copy instead of once per
// file, which is most of the compile time. setup.py checks that every
// csrc/cpu/*.cpp is in exactly one bundle.
#include "../budget.cpp"
#include "../chain.cpp"
#include "../kernel_table.cpp"
#include "../losses.cpp"
#include "../normalizers.cpp"
#include "../normmax.cpp"
#include "../structured.cpp"
