/// \file step.h
/// \brief What a step folder hands to the harness: its launchers, described once.
///
/// Each step's `kernel.cu` ends with one `FA_REGISTER_STEP(...)` line. CMake compiles the
/// step with `FA_STEP_NAME` (its folder name) and `FA_STEP_SYMBOL` (a C symbol made from it),
/// and generates the table of all registered steps that the C API dispatches through.
#ifndef FA_STEP_H_
#define FA_STEP_H_

#include <cuda_runtime.h>

#include "fa/api.h"

namespace fa {

/// Launches a forward pass. Arguments are already validated by the C API.
using ForwardFn = fa_status (*)(const fa_fwd_args& args, cudaStream_t stream);
/// Launches a backward pass. Arguments are already validated by the C API.
using BackwardFn = fa_status (*)(const fa_bwd_args& args, cudaStream_t stream);
/// True if the step's kernels handle head dimension d.
using HeadDimFn = bool (*)(int head_dim);

/// One registered step.
struct Step {
  const char* name;             ///< folder name, e.g. "01_naive"
  const char* summary;          ///< one line: what this step adds
  ForwardFn forward;            ///< never null
  BackwardFn backward;          ///< null if the step has no backward pass
  HeadDimFn supports_head_dim;  ///< which head dims the kernels were built for
  /// 0: runs on every sm_80+ GPU. Otherwise the one compute capability (major * 10 + minor)
  /// the step's kernels were built for, e.g. 90: sm_90a code (wgmma, setmaxnreg), which runs
  /// on an H100/H200 and on no other GPU; the C API refuses other GPUs with one clear line.
  int required_sm;
};

/// Records `message` (printf-style) as this thread's last error and returns `status`.
/// Steps call it for failures that only they can detect (e.g. out of memory).
fa_status set_error(fa_status status, const char* format, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

/// Shared memory per thread block that a launcher may opt into on the current device:
/// `cudaDevAttrMaxSharedMemoryPerBlockOptin`, lowered to the environment variable
/// `FA_SMEM_LIMIT` (bytes) when it is set. Steps that pick their tile shapes by shared memory
/// ask here, so that the tests can run the shapes a smaller GPU gets on a larger one
/// (`FA_SMEM_LIMIT=101376`: the 99 KiB of an RTX 30xx/40xx). Returns FA_OK, FA_ERR_CUDA, or
/// FA_ERR_INVALID_ARGUMENT for a value of `FA_SMEM_LIMIT` that is not a positive integer.
fa_status smem_per_block_optin(int* bytes);

}  // namespace fa

#ifndef FA_STEP_NAME
/// The step's folder name; CMake defines it for each step (fa_add_step).
#define FA_STEP_NAME "unnamed_step"
/// The C symbol of the step's descriptor; CMake defines it for each step.
#define FA_STEP_SYMBOL fa_step_unnamed
#endif

/// Registers the step compiled in this translation unit with the harness.
#define FA_REGISTER_STEP(summary, forward, backward, supports_head_dim)                 \
  extern "C" const fa::Step FA_STEP_SYMBOL = {FA_STEP_NAME, summary, forward, backward, \
                                              supports_head_dim}

/// Registers a step whose kernels run only on compute capability `sm` (e.g. 90 for sm_90a).
#define FA_REGISTER_STEP_FOR_SM(sm, summary, forward, backward, supports_head_dim)      \
  extern "C" const fa::Step FA_STEP_SYMBOL = {FA_STEP_NAME, summary,           forward, \
                                              backward,     supports_head_dim, sm}

#endif  // FA_STEP_H_
