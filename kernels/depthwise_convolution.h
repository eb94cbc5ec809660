// Depthwise convolutions over token rows: the image model's DWC term and the document model's position
// convolution, read and written in place in the models' token-major layout (channels contiguous) instead of
// LibTorch's channels-first copies.
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

namespace mita::kernels {

// output[b, t] += bias + sum over (i, j) of weight[:, 0, i, j] * input[b, token (row + i - kh/2, column + j - kw/2)]
// per channel, for the tokens t = row * columns + column of a rows x columns grid, zero outside it: at::conv2d with
// groups = C, stride 1 and padding (kh/2, kw/2), added to output (a 1-D convolution is a grid of one row).
// input, output: [B, rows * columns, C], any batch and token strides (views of a fused projection), not
// overlapping; weight [C, 1, kh, kw] with odd kh and kw; bias [C]. One pass in C++ for float32 and float64 CPU
// tensors whose channels are contiguous; at::conv2d for the rest (CUDA, bfloat16). The sums differ from
// at::conv2d's only by rounding. Throws (c10::Error) when the shapes disagree.
void AddDepthwiseConvolution(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias,
                             int64_t rows, int64_t columns, const at::Tensor& output);

}  // namespace mita::kernels
