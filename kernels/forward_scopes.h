// Names of the RecordFunction scopes (ATen/record_function.h) that the kernels and models open around the phases of
// a forward, so that a profiler attached with at::addThreadLocalCallback can tell the phases apart (mita-forward-
// phases, tools/forward_phases.cc). With no callback attached a scope costs one check of a thread-local flag.
#pragma once

namespace mita::kernels {

inline constexpr char kLinearScope[] = "mita::linear";                 ///< a dense layer (kernels::Linear), with inputs
inline constexpr char kMitaAttentionScope[] = "mita::attention";       ///< the MiTA kernel
inline constexpr char kFullAttentionScope[] = "mita::full_attention";  ///< full attention
inline constexpr char kLandmarksScope[] = "mita::landmarks";           ///< landmarks (image or sequence)
inline constexpr char kDepthwiseConvolutionScope[] = "mita::depthwise_convolution";  ///< DWC, position convolution
inline constexpr char kEmbeddingScope[] = "mita::embedding";           ///< embedding and position encoding
inline constexpr char kLayerScope[] = "mita::layer";                   ///< one transformer block
inline constexpr char kPoolAndHeadScope[] = "mita::pool_and_head";     ///< final norm, pooling and the class head

}  // namespace mita::kernels
