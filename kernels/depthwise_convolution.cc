#include "kernels/depthwise_convolution.h"

#include <algorithm>
#include <vector>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/conv2d.h>
#include <ATen/record_function.h>
#include <c10/util/Exception.h>

#include "kernels/forward_scopes.h"

namespace mita::kernels {
namespace {

bool RunsInPlace(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias,
                 const at::Tensor& output) {
  const at::ScalarType type = input.scalar_type();
  if (type != at::kFloat && type != at::kDouble) return false;
  for (const at::Tensor* tensor : {&input, &weight, &bias, &output}) {
    if (!tensor->device().is_cpu() || tensor->scalar_type() != type) return false;
  }
  return input.stride(2) == 1 && output.stride(2) == 1;
}

// The in-place pass: per output token, the bias plus the taps inside the grid, summed over contiguous channels
// (vectorised by the compiler), added to the output row. Parallel over tokens in tasks of at least 2^16
// multiply-adds, so that one small image stays on the calling thread.
template <typename T>
void AddDepthwiseConvolutionInPlace(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias,
                                    int64_t rows, int64_t columns, const at::Tensor& output) {
  const int64_t batch = input.size(0), channels = input.size(2);
  const int64_t kernel_rows = weight.size(2), kernel_columns = weight.size(3);
  // Taps major, channels contiguous: [kh * kw, C].
  const at::Tensor taps = weight.reshape({channels, kernel_rows * kernel_columns}).t().contiguous();
  const at::Tensor bias_values = bias.contiguous();
  const T* tap_data = taps.data_ptr<T>();
  const T* bias_data = bias_values.data_ptr<T>();
  const T* input_data = input.data_ptr<T>();
  T* output_data = output.data_ptr<T>();
  const int64_t tokens = rows * columns;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, channels * taps.size(0)));
  at::parallel_for(0, batch * tokens, grain, [&](int64_t begin, int64_t end) {
    std::vector<T> sums(channels);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / tokens, token = task % tokens;
      const int64_t row = token / columns, column = token % columns;
      std::copy(bias_data, bias_data + channels, sums.begin());
      for (int64_t i = 0; i < kernel_rows; ++i) {
        const int64_t source_row = row + i - kernel_rows / 2;
        if (source_row < 0 || source_row >= rows) continue;
        for (int64_t j = 0; j < kernel_columns; ++j) {
          const int64_t source_column = column + j - kernel_columns / 2;
          if (source_column < 0 || source_column >= columns) continue;
          const T* source = input_data + b * input.stride(0) + (source_row * columns + source_column) * input.stride(1);
          const T* tap = tap_data + (i * kernel_columns + j) * channels;
          for (int64_t c = 0; c < channels; ++c) sums[c] += tap[c] * source[c];
        }
      }
      T* target = output_data + b * output.stride(0) + token * output.stride(1);
      for (int64_t c = 0; c < channels; ++c) target[c] += sums[c];
    }
  });
}

}  // namespace

void AddDepthwiseConvolution(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias,
                             int64_t rows, int64_t columns, const at::Tensor& output) {
  RECORD_USER_SCOPE(kDepthwiseConvolutionScope);
  TORCH_CHECK(input.dim() == 3 && output.dim() == 3 && input.sizes() == output.sizes(),
              "AddDepthwiseConvolution: input ", input.sizes(), " and output ", output.sizes(),
              " must both be [B, rows * columns, C]");
  const int64_t batch = input.size(0), channels = input.size(2);
  TORCH_CHECK(rows >= 1 && columns >= 1 && input.size(1) == rows * columns, "AddDepthwiseConvolution: ",
              input.size(1), " tokens are not a ", rows, " x ", columns, " grid");
  TORCH_CHECK(weight.dim() == 4 && weight.size(0) == channels && weight.size(1) == 1 && weight.size(2) % 2 == 1 &&
                  weight.size(3) % 2 == 1,
              "AddDepthwiseConvolution: weight ", weight.sizes(), " must be [C = ", channels, ", 1, odd, odd]");
  TORCH_CHECK(bias.dim() == 1 && bias.size(0) == channels, "AddDepthwiseConvolution: bias ", bias.sizes(),
              " must be [C = ", channels, "]");
  if (input.numel() == 0) return;
  if (RunsInPlace(input, weight, bias, output)) {
    AT_DISPATCH_FLOATING_TYPES(input.scalar_type(), "AddDepthwiseConvolution", [&] {
      AddDepthwiseConvolutionInPlace<scalar_t>(input, weight, bias, rows, columns, output);
    });
    return;
  }
  const at::Tensor grid = input.reshape({batch, rows, columns, channels}).permute({0, 3, 1, 2});
  const at::Tensor convolved = at::conv2d(grid, weight, bias, /*stride=*/{1, 1},
                                          /*padding=*/{weight.size(2) / 2, weight.size(3) / 2}, /*dilation=*/{1, 1},
                                          /*groups=*/channels);  // [B, C, rows, columns]
  output.add_(convolved.permute({0, 2, 3, 1}).reshape({batch, rows * columns, channels}));
}

}  // namespace mita::kernels
