// The fused attention kernels as one translation unit (see rows.cpp).
#include "../attention.cpp"
#include "../attention_rows.cpp"
#include "../attention_softmax.cpp"
