/// \file cli.cpp
/// \brief Flag parsing for the runners and the bench: one small table-driven parser.
#include "fa/cli.h"

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <sstream>

#include "fa/flops.h"

namespace fa {
namespace {

/// One flag: its name, whether it takes a value, and what to do with it.
struct Flag {
  const char* name;
  bool takes_value;
  std::function<bool(const std::string& value, std::string* error)> apply;
};

bool parse_int(const std::string& flag, const std::string& text, int* out, std::string* error) {
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || errno != 0 || v < INT_MIN || v > INT_MAX) {
    *error = flag + " expects an integer (got '" + text + "')";
    return false;
  }
  *out = static_cast<int>(v);
  return true;
}

bool parse_u64(const std::string& flag, const std::string& text, uint64_t* out,
               std::string* error) {
  errno = 0;
  char* end = nullptr;
  const unsigned long long v = std::strtoull(text.c_str(), &end, 10);
  if (text.empty() || text[0] == '-' || *end != '\0' || errno != 0) {
    *error = flag + " expects a non-negative integer (got '" + text + "')";
    return false;
  }
  *out = v;
  return true;
}

bool parse_float(const std::string& flag, const std::string& text, float* out, std::string* error) {
  errno = 0;
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  // ERANGE on underflow still gives a usable (tiny) value; overflow gives +-HUGE_VAL: both are
  // judged by the callers' range checks, so only a text that is not a number fails here.
  if (text.empty() || *end != '\0' || (errno != 0 && errno != ERANGE)) {
    *error = flag + " expects a number (got '" + text + "')";
    return false;
  }
  *out = static_cast<float>(v);
  return true;
}

bool parse_positive(const std::string& flag, const std::string& text, int* out,
                    std::string* error) {
  if (!parse_int(flag, text, out, error)) return false;
  if (*out < 1) {
    *error = flag + " must be >= 1 (got " + text + ")";
    return false;
  }
  return true;
}

std::vector<std::string> split(const std::string& text) {
  std::vector<std::string> parts;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) parts.push_back(item);
  return parts;
}

bool parse_int_list(const std::string& flag, const std::string& text, std::vector<int>* out,
                    std::string* error) {
  out->clear();
  for (const std::string& part : split(text)) {
    int v = 0;
    if (!parse_int(flag, part, &v, error)) return false;
    out->push_back(v);
  }
  if (out->empty()) {
    *error = flag + " expects a comma-separated list";
    return false;
  }
  return true;
}

/// Runs the table over `args`: "--flag value" and "--flag=value" are both accepted.
bool parse_flags(const std::vector<std::string>& args, const std::vector<Flag>& flags,
                 std::string* error) {
  for (size_t i = 0; i < args.size(); ++i) {
    std::string name = args[i], value;
    bool has_inline = false;
    const size_t eq = name.find('=');
    if (name.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_inline = true;
    }
    const Flag* flag = nullptr;
    for (const Flag& f : flags)
      if (name == f.name) flag = &f;
    if (flag == nullptr) {
      *error = "unknown flag '" + args[i] + "' (see --help)";
      return false;
    }
    if (flag->takes_value && !has_inline) {
      if (i + 1 >= args.size()) {
        *error = name + " needs a value";
        return false;
      }
      value = args[++i];
    } else if (!flag->takes_value && has_inline) {
      *error = name + " takes no value";
      return false;
    }
    if (!flag->apply(value, error)) return false;
  }
  return true;
}

bool parse_dtype_flag(const std::string& text, fa_dtype* out, std::string* error) {
  if (parse_dtype(text, out)) return true;
  *error = "--dtype must be fp16 or bf16 (got '" + text + "')";
  return false;
}

/// The flags the runner and the bench share: how to check, time and report a run.
template <typename Options>
void add_run_flags(std::vector<Flag>* flags, Options* o) {
  const std::vector<Flag> shared = {
      {"--seed", true, [o](auto& v, auto* e) { return parse_u64("--seed", v, &o->seed, e); }},
      {"--warmup", true,
       [o](auto& v, auto* e) {
         if (!parse_int("--warmup", v, &o->warmup, e)) return false;
         if (o->warmup >= 0) return true;
         *e = "--warmup must be >= 0";
         return false;
       }},
      {"--warmup-ms", true,
       [o](auto& v, auto* e) {
         if (!parse_int("--warmup-ms", v, &o->warmup_ms, e)) return false;
         if (o->warmup_ms >= 0) return true;
         *e = "--warmup-ms must be >= 0";
         return false;
       }},
      {"--repeats", true,
       [o](auto& v, auto* e) { return parse_positive("--repeats", v, &o->repeats, e); }},
      {"--no-check", false, [o](auto&, auto*) { return !(o->check = false); }},
      {"--check-rows", true,
       [o](auto& v, auto* e) { return parse_positive("--check-rows", v, &o->check_rows, e); }},
      {"--deterministic", false, [o](auto&, auto*) { return o->deterministic = true; }},
      {"--out", true,
       [o](auto& v, auto* e) {
         o->out = v;
         if (!v.empty()) return true;
         *e = "--out needs a file name";
         return false;
       }},
      {"--help", false, [o](auto&, auto*) { return o->help = true; }},
      {"-h", false, [o](auto&, auto*) { return o->help = true; }},
  };
  flags->insert(flags->end(), shared.begin(), shared.end());
}

/// The help lines of the flags add_run_flags() adds, with the defaults of `d`.
template <typename Options>
std::string run_flags_usage(const Options& d) {
  char text[640];
  std::snprintf(text, sizeof text,
                "  --seed N           input seed (fresh each run, printed)\n"
                "  --warmup N         untimed runs, at least (%d)\n"
                "  --warmup-ms N      and untimed runs until N ms have passed (%d)\n"
                "  --repeats N        timed runs, median reported (%d)\n"
                "  --no-check         skip the oracle checks\n"
                "  --check-rows N     rows sampled per check (%d)\n"
                "  --deterministic    backward with the same bits every run\n"
                "  --out FILE         also write the results as .csv or .json\n",
                d.warmup, d.warmup_ms, d.repeats, d.check_rows);
  return text;
}

}  // namespace

bool parse_runner_args(const std::vector<std::string>& args, RunnerOptions* o, std::string* error) {
  *o = RunnerOptions();
  o->shape.batch = 1;
  o->shape.heads = 16;
  o->shape.seqlen_q = o->shape.seqlen_k = 4096;
  o->shape.head_dim = 128;
  ProblemShape& s = o->shape;
  bool heads_kv_set = false, scale_set = false;
  std::string scale_text, magnitude_text = "1";
  std::vector<Flag> flags = {
      {"--batch", true, [&](auto& v, auto* e) { return parse_int("--batch", v, &s.batch, e); }},
      {"--heads", true, [&](auto& v, auto* e) { return parse_int("--heads", v, &s.heads, e); }},
      {"--heads-kv", true,
       [&](auto& v, auto* e) {
         heads_kv_set = true;
         return parse_int("--heads-kv", v, &s.heads_kv, e);
       }},
      {"--seqlen", true,
       [&](auto& v, auto* e) {
         return parse_int("--seqlen", v, &s.seqlen_q, e) &&
                parse_int("--seqlen", v, &s.seqlen_k, e);
       }},
      {"--seqlen-q", true,
       [&](auto& v, auto* e) { return parse_int("--seqlen-q", v, &s.seqlen_q, e); }},
      {"--seqlen-k", true,
       [&](auto& v, auto* e) { return parse_int("--seqlen-k", v, &s.seqlen_k, e); }},
      {"--head-dim", true,
       [&](auto& v, auto* e) { return parse_int("--head-dim", v, &s.head_dim, e); }},
      {"--dtype", true, [&](auto& v, auto* e) { return parse_dtype_flag(v, &s.dtype, e); }},
      {"--causal", false, [&](auto&, auto*) { return s.causal = true; }},
      {"--scale", true,
       [&](auto& v, auto* e) {
         scale_set = true;
         scale_text = v;
         return parse_float("--scale", v, &s.scale, e);
       }},
      {"--magnitude", true,
       [&](auto& v, auto* e) {
         magnitude_text = v;
         return parse_float("--magnitude", v, &o->magnitude, e);
       }},
      {"--backward", false, [&](auto&, auto*) { return o->backward = true; }},
      {"--no-ceilings", false, [&](auto&, auto*) { return !(o->ceilings = false); }},
  };
  add_run_flags(&flags, o);
  if (!parse_flags(args, flags, error)) return false;
  if (!heads_kv_set) s.heads_kv = s.heads;  // an explicit --heads-kv 0 goes to the API as 0
  if (scale_set && s.scale == 0.f) {
    // ProblemShape's scale 0 means "1/sqrt(d)": an explicit 0 (or -0, or 1e-50, which is 0 in
    // fp32) must not quietly become that.
    *error = "--scale must be > 0 (got '" + scale_text + "', which is 0 in fp32)";
    return false;
  }
  const double largest = s.dtype == FA_BF16 ? 3.3895313892515355e38 : 65504.0;
  if (!std::isfinite(o->magnitude) || o->magnitude < 0.f || o->magnitude > largest) {
    *error = "--magnitude must be a finite number from 0 to " +
             std::string(s.dtype == FA_BF16 ? "3.39e38" : "65504") + " (the largest " +
             dtype_name(s.dtype) + " value) (got '" + magnitude_text + "')";
    return false;
  }
  if (o->deterministic && !o->backward) {
    *error = "--deterministic applies to the backward pass: add --backward";
    return false;
  }
  return true;
}

std::string runner_usage(const std::string& program) {
  return "usage: " + program +
         " [flags]\n"
         "Runs this step once on random inputs, checks it against the fp64 oracle, times it.\n"
         "  --batch N          batch size (1)\n"
         "  --heads N          query heads (16)\n"
         "  --heads-kv N       key/value heads, must divide --heads (= heads)\n"
         "  --seqlen N         query and key length (4096)\n"
         "  --seqlen-q N       query length\n"
         "  --seqlen-k N       key length\n"
         "  --head-dim N       head dimension (128)\n"
         "  --dtype T          fp16 or bf16 (fp16)\n"
         "  --causal           causal mask, bottom-right aligned\n"
         "  --scale X          softmax scale (1/sqrt(head dim))\n"
         "  --magnitude X      Q, K uniform in [-X, X] (1)\n"
         "  --backward         time the backward pass (after a forward)\n"
         "  --no-ceilings      skip measuring the ceilings (mma.sync, cuBLAS, copy, wgmma)\n" +
         run_flags_usage(RunnerOptions());
}

bool parse_bench_args(const std::vector<std::string>& args, BenchOptions* o, std::string* error) {
  *o = BenchOptions();
  bool dims_given = false, causal_given = false, direction_given = false;
  std::vector<Flag> flags = {
      {"--steps", true,
       [&](auto& v, auto* e) {
         o->steps = split(v);
         if (!o->steps.empty()) return true;
         *e = "--steps expects a comma-separated list of step names";
         return false;
       }},
      {"--seqlens", true,
       [&](auto& v, auto* e) { return parse_int_list("--seqlens", v, &o->seqlens, e); }},
      {"--head-dims", true,
       [&](auto& v, auto* e) {
         dims_given = true;
         return parse_int_list("--head-dims", v, &o->head_dims, e);
       }},
      {"--causal", true,
       [&](auto& v, auto* e) {
         causal_given = true;
         if (v == "both")
           o->causal = {0, 1};
         else if (v == "on")
           o->causal = {1};
         else if (v == "off")
           o->causal = {0};
         else {
           *e = "--causal must be on, off or both (got '" + v + "')";
           return false;
         }
         return true;
       }},
      {"--direction", true,
       [&](auto& v, auto* e) {
         direction_given = true;
         if (v == "both")
           o->directions = {"fwd", "bwd"};
         else if (v == "fwd" || v == "bwd")
           o->directions = {v};
         else {
           *e = "--direction must be fwd, bwd or both (got '" + v + "')";
           return false;
         }
         return true;
       }},
      {"--dtype", true, [&](auto& v, auto* e) { return parse_dtype_flag(v, &o->dtype, e); }},
      {"--tokens", true,
       [&](auto& v, auto* e) { return parse_positive("--tokens", v, &o->tokens, e); }},
      {"--hidden", true,
       [&](auto& v, auto* e) { return parse_positive("--hidden", v, &o->hidden, e); }},
      {"--decode", false, [&](auto&, auto*) { return o->decode = true; }},
      {"--seqlens-q", true,
       [&](auto& v, auto* e) { return parse_int_list("--seqlens-q", v, &o->seqlens_q, e); }},
      {"--seqlens-k", true,
       [&](auto& v, auto* e) { return parse_int_list("--seqlens-k", v, &o->seqlens_k, e); }},
      {"--batches", true,
       [&](auto& v, auto* e) { return parse_int_list("--batches", v, &o->batches, e); }},
      {"--heads", true,
       [&](auto& v, auto* e) { return parse_positive("--heads", v, &o->heads, e); }},
      {"--heads-kv", true,
       [&](auto& v, auto* e) { return parse_int_list("--heads-kv", v, &o->heads_kv, e); }},
      {"--max-kv-mib", true,
       [&](auto& v, auto* e) { return parse_positive("--max-kv-mib", v, &o->max_kv_mib, e); }},
      {"--heat-ms", true,
       [&](auto& v, auto* e) {
         if (!parse_int("--heat-ms", v, &o->heat_ms, e)) return false;
         if (o->heat_ms >= 0) return true;
         *e = "--heat-ms must be >= 0";
         return false;
       }},
      {"--rounds", true,
       [&](auto& v, auto* e) { return parse_positive("--rounds", v, &o->rounds, e); }},
  };
  add_run_flags(&flags, o);
  if (!parse_flags(args, flags, error)) return false;
  if (o->decode) {  // decoding: d = 128, no mask (seqlen_q = 1 sees every key anyway), forward
    if (!dims_given) o->head_dims = {128};
    if (!causal_given) o->causal = {0};
    if (!direction_given) o->directions = {"fwd"};
  }
  for (const std::vector<int>* list : {&o->seqlens_q, &o->seqlens_k, &o->batches, &o->heads_kv})
    for (int n : *list)
      if (n < 1) {
        *error = "--seqlens-q, --seqlens-k, --batches and --heads-kv values must be >= 1";
        return false;
      }
  for (int n : o->seqlens)
    if (n < 1) {
      *error = "--seqlens values must be >= 1";
      return false;
    }
  for (int d : o->head_dims)
    if (d < 1) {
      *error = "--head-dims values must be >= 1";
      return false;
    }
  if (o->deterministic &&
      std::find(o->directions.begin(), o->directions.end(), "bwd") == o->directions.end()) {
    *error = "--deterministic applies to the backward pass, which --direction fwd leaves out";
    return false;
  }
  return true;
}

std::string bench_usage(const std::string& program) {
  return "usage: " + program +
         " [flags]\n"
         "Runs every registered step over the paper's sweep: tokens fixed, batch = tokens /\n"
         "seqlen, heads = hidden / head dim. Times every step on a shape, one after another,\n"
         "then checks each result, and prints each step's speed-up over the step before it\n"
         "and over the first.\n"
         "  --steps A,B,...    steps to run (all registered)\n"
         "  --seqlens N,...    sequence lengths (512,1024,2048,4096,8192,16384)\n"
         "  --head-dims N,...  head dims (64,128)\n"
         "  --causal X         on, off or both (both)\n"
         "  --direction X      fwd, bwd or both (both; bwd only for steps that have one)\n"
         "  --dtype T          fp16 or bf16 (fp16)\n"
         "  --tokens N         tokens per batch (16384)\n"
         "  --hidden N         hidden size = heads * head dim (2048)\n"
         "  --decode           the decode sweep instead: few query rows against long key\n"
         "                     sequences (head dim 128, no mask, forward unless given); the\n"
         "                     table adds GB/s of K and V read against the copy ceiling\n"
         "  --seqlens-q N,...  decode: query lengths (1,16)\n"
         "  --seqlens-k N,...  decode: key lengths (1024,4096,16384,65536)\n"
         "  --batches N,...    decode: batch sizes (1,4,16)\n"
         "  --heads N          decode: query heads (32)\n"
         "  --heads-kv N,...   decode: key/value heads (8,32)\n"
         "  --max-kv-mib N     decode: skip shapes whose K and V take more (1024)\n"
         "  --heat-ms N        before a shape's cells are timed, run its first untimed for N ms,\n"
         "                     so that the GPU, idle during the last shape's checks, is at the\n"
         "                     clocks of a sustained load for every cell (2000; 0: off)\n"
         "  --rounds N         time every cell of a shape N times, the steps in their order,\n"
         "                     then reversed, and so on; a cell's figure is the median of all\n"
         "                     its runs, so that a drift of the clocks through a shape touches\n"
         "                     neighbouring steps alike (2)\n" +
         run_flags_usage(BenchOptions());
}

std::vector<ProblemShape> decode_shapes(const BenchOptions& o) {
  std::vector<ProblemShape> shapes;
  for (int d : o.head_dims)
    for (int causal : o.causal)
      for (int heads_kv : o.heads_kv)
        for (int seqlen_q : o.seqlens_q)
          for (int batch : o.batches)
            for (int seqlen_k : o.seqlens_k) {
              if (o.heads % heads_kv != 0) continue;
              if (kv_bytes(batch, heads_kv, seqlen_k, d) > o.max_kv_mib * 1048576.0) continue;
              shapes.push_back(make_shape(batch, o.heads, heads_kv, seqlen_q, seqlen_k, d,
                                          causal != 0, o.dtype));
            }
  return shapes;
}

}  // namespace fa
