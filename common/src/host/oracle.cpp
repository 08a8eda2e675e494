/// \file oracle.cpp
/// \brief The fp64 reference, row by row, spread over the machine's cores with std::thread.
#include "fa/oracle.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <set>
#include <thread>
#include <tuple>

#include "fa/metrics.h"

namespace fa {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

/// Runs fn(i) for i in [0, n) on up to hardware_concurrency threads; `work_per_item` (rough
/// multiply-adds) keeps tiny jobs on the calling thread, where starting threads costs more.
template <typename Fn>
void parallel_for(size_t n, double work_per_item, Fn fn) {
  const double total_work = work_per_item * static_cast<double>(n);
  const size_t by_work = static_cast<size_t>(total_work / (1 << 18)) + 1;
  const size_t threads =
      std::min({n, by_work, size_t{std::max(1u, std::thread::hardware_concurrency())}});
  if (threads <= 1) {
    for (size_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::atomic<size_t> next{0};
  auto worker = [&] {
    for (size_t i = next++; i < n; i = next++) fn(i);
  };
  std::vector<std::thread> pool;
  for (size_t t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (auto& t : pool) t.join();
}

/// Keys 0 .. visible_keys-1 are the ones query row i sees (bottom-right aligned causal mask).
int visible_keys(const ProblemShape& s, int i) {
  if (!s.causal) return s.seqlen_k;
  return std::clamp(i + s.seqlen_k - s.seqlen_q + 1, 0, s.seqlen_k);
}

/// First query row that sees key j under the causal mask (Nq if none does).
int first_query_seeing(const ProblemShape& s, int j) {
  if (!s.causal) return 0;
  return std::clamp(j - (s.seqlen_k - s.seqlen_q), 0, s.seqlen_q);
}

double dot(const float* a, const float* b, int n) {
  double sum = 0;
  for (int c = 0; c < n; ++c) sum += static_cast<double>(a[c]) * static_cast<double>(b[c]);
  return sum;
}

double dot(const double* a, const float* b, int n) {
  double sum = 0;
  for (int c = 0; c < n; ++c) sum += a[c] * static_cast<double>(b[c]);
  return sum;
}

/// One query row's forward in fp64: writes O_i to `o` (d values) and returns L_i.
/// `scores` is scratch of at least Nk values.
double forward_row(const HostProblem& p, int b, int h, int i, double* o,
                   std::vector<double>& scores) {
  const ProblemShape& s = p.shape;
  const int d = s.head_dim;
  const int kv_head = h / (s.heads / s.heads_kv);
  const int n_visible = visible_keys(s, i);
  std::fill(o, o + d, 0.0);
  if (n_visible == 0) return kInf;
  const double scale = s.effective_scale();
  const float* q = &p.q[p.q_index(b, i, h, 0)];
  double row_max = -kInf;
  for (int j = 0; j < n_visible; ++j) {
    scores[j] = scale * dot(q, &p.k[p.kv_index(b, j, kv_head, 0)], d);
    row_max = std::max(row_max, scores[j]);
  }
  double row_sum = 0;
  for (int j = 0; j < n_visible; ++j) {
    const double weight = std::exp(scores[j] - row_max);
    row_sum += weight;
    const float* v = &p.v[p.kv_index(b, j, kv_head, 0)];
    for (int c = 0; c < d; ++c) o[c] += weight * v[c];
  }
  for (int c = 0; c < d; ++c) o[c] /= row_sum;
  return row_max + std::log(row_sum);
}

std::vector<RowId> all_rows(int batch, int heads, int seqlen) {
  std::vector<RowId> rows;
  rows.reserve(static_cast<size_t>(batch) * heads * seqlen);
  for (int b = 0; b < batch; ++b)
    for (int h = 0; h < heads; ++h)
      for (int s = 0; s < seqlen; ++s) rows.push_back({b, h, s});
  return rows;
}

uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/// `count` distinct rows of a [batch, heads, seqlen] grid: the first and the last position of
/// the sequence in several (batch, head) pairs (always (0, 0, 0) and (B-1, H-1, N-1)), the
/// rest uniformly at random; sorted by (b, h, s).
std::vector<RowId> sample_rows(int batch, int heads, int seqlen, int count, uint64_t seed) {
  const int64_t pairs = static_cast<int64_t>(batch) * heads;
  const int64_t total = pairs * seqlen;
  if (count <= 0 || total <= 0) return {};
  if (count >= total) return all_rows(batch, heads, seqlen);
  uint64_t state = mix64(seed ^ 0x5851f42d4c957f2dull);
  auto next = [&state] {
    state += 0x9e3779b97f4a7c15ull;
    return mix64(state);
  };
  std::set<std::tuple<int, int, int>> picked;
  auto add = [&](int64_t pair, int s) {
    picked.emplace(static_cast<int>(pair / heads), static_cast<int>(pair % heads), s);
  };
  // Sequence ends: where masks, partial blocks and boundary bugs live.
  const int64_t ends = std::min<int64_t>(std::max(2, count / 8), count);
  for (int64_t t = 0; t < ends; ++t) {
    const bool last = t % 2 == 1;
    const int64_t pair = t < 2 ? (last ? pairs - 1 : 0) : static_cast<int64_t>(next() % pairs);
    add(pair, last ? seqlen - 1 : 0);
  }
  while (static_cast<int64_t>(picked.size()) < count) {
    const int64_t flat = static_cast<int64_t>(next() % static_cast<uint64_t>(total));
    add(flat / seqlen, static_cast<int>(flat % seqlen));
  }
  std::vector<RowId> rows;
  rows.reserve(picked.size());
  for (const auto& [b, h, s] : picked) rows.push_back({b, h, s});
  return rows;
}

}  // namespace

std::vector<RowId> all_q_rows(const ProblemShape& shape) {
  return all_rows(shape.batch, shape.heads, shape.seqlen_q);
}

std::vector<RowId> all_kv_rows(const ProblemShape& shape) {
  return all_rows(shape.batch, shape.heads_kv, shape.seqlen_k);
}

std::vector<RowId> sample_q_rows(const ProblemShape& shape, int count, uint64_t seed) {
  return sample_rows(shape.batch, shape.heads, shape.seqlen_q, count, seed);
}

std::vector<RowId> sample_kv_rows(const ProblemShape& shape, int count, uint64_t seed) {
  // A different stream than the query rows drawn with the same seed.
  return sample_rows(shape.batch, shape.heads_kv, shape.seqlen_k, count,
                     seed ^ 0x2545f4914f6cdd1dull);
}

void sample_group_rows(const ProblemShape& shape, int b, int kv_head, int count, uint64_t seed,
                       std::vector<RowId>* q_rows, std::vector<RowId>* kv_rows) {
  const int group = shape.heads / shape.heads_kv;
  ProblemShape one = shape;  // the group alone: batch 1, `group` query heads, 1 key/value head
  one.batch = 1;
  one.heads = group;
  one.heads_kv = 1;
  *q_rows = sample_q_rows(one, count, seed);
  *kv_rows = sample_kv_rows(one, count, seed);
  for (RowId& r : *q_rows) r = {b, kv_head * group + r.h, r.s};
  for (RowId& r : *kv_rows) r = {b, kv_head, r.s};
}

void add_attended_keys(const HostProblem& p, const std::vector<RowId>& q_rows, int max_added,
                       std::vector<RowId>* kv_rows) {
  const ProblemShape& s = p.shape;
  const int group = s.heads / s.heads_kv;
  std::set<std::tuple<int, int, int>> keys;
  for (const RowId& r : *kv_rows) keys.emplace(r.b, r.h, r.s);
  int added = 0;
  for (const RowId& row : q_rows) {
    if (added >= max_added) break;
    const int kv_head = row.h / group;
    const float* q = &p.q[p.q_index(row.b, row.s, row.h, 0)];
    int best = -1;
    double best_score = -kInf;
    for (int j = 0; j < visible_keys(s, row.s); ++j) {
      const double score = dot(q, &p.k[p.kv_index(row.b, j, kv_head, 0)], s.head_dim);
      if (score > best_score) best_score = score, best = j;
    }
    if (best >= 0 && keys.emplace(row.b, kv_head, best).second) ++added;
  }
  kv_rows->clear();
  for (const auto& [b, h, j] : keys) kv_rows->push_back({b, h, j});
}

ForwardRef reference_forward(const HostProblem& p, const std::vector<RowId>& rows) {
  const ProblemShape& s = p.shape;
  const int d = s.head_dim;
  ForwardRef ref;
  ref.rows = rows;
  ref.o.assign(rows.size() * d, 0.0);
  ref.lse.assign(rows.size(), 0.0);
  parallel_for(rows.size(), 2.0 * s.seqlen_k * d, [&](size_t r) {
    thread_local std::vector<double> scores;
    scores.resize(s.seqlen_k);
    const RowId& row = rows[r];
    ref.lse[r] = forward_row(p, row.b, row.h, row.s, &ref.o[r * d], scores);
  });
  return ref;
}

BackwardRef reference_backward(const HostProblem& p, const std::vector<RowId>& q_rows,
                               const std::vector<RowId>& kv_rows, const GivenForward* given) {
  const ProblemShape& s = p.shape;
  const int d = s.head_dim;
  const int group = s.heads / s.heads_kv;
  const double scale = s.effective_scale();
  BackwardRef ref;
  ref.q_rows = q_rows;
  ref.kv_rows = kv_rows;
  ref.dq.assign(q_rows.size() * d, 0.0);
  ref.dk.assign(kv_rows.size() * d, 0.0);
  ref.dv.assign(kv_rows.size() * d, 0.0);
  ref.dq_mag.assign(q_rows.size() * d, 0.0);
  ref.dk_mag.assign(kv_rows.size() * d, 0.0);
  ref.dv_mag.assign(kv_rows.size() * d, 0.0);
  ref.dq_floor.assign(q_rows.size() * d, 0.0);
  ref.dk_floor.assign(kv_rows.size() * d, 0.0);
  ref.dv_floor.assign(kv_rows.size() * d, 0.0);
  // Rounding a probability or a dS below the dtype's normal range costs up to `unit` each.
  const double unit = underflow_unit(s.dtype), threshold = underflow_threshold(s.dtype);
  auto underflows = [threshold](double x) { return std::abs(x) < threshold ? 1.0 : 0.0; };

  // 1. L_i and D_i = dO_i . O_i for every query row of every (b, h) the requested rows touch:
  //    a dK/dV row needs all query rows of all query heads in its group.
  std::vector<char> needed(static_cast<size_t>(s.batch) * s.heads, 0);
  for (const RowId& r : q_rows) needed[static_cast<size_t>(r.b) * s.heads + r.h] = 1;
  for (const RowId& r : kv_rows)
    for (int g = 0; g < group; ++g)
      needed[static_cast<size_t>(r.b) * s.heads + r.h * group + g] = 1;
  std::vector<RowId> stats_rows;
  for (int b = 0; b < s.batch; ++b)
    for (int h = 0; h < s.heads; ++h)
      if (needed[static_cast<size_t>(b) * s.heads + h])
        for (int i = 0; i < s.seqlen_q; ++i) stats_rows.push_back({b, h, i});
  std::vector<double> lse(static_cast<size_t>(s.batch) * s.heads * s.seqlen_q, kInf);
  std::vector<double> delta(lse.size(), 0.0);
  // With the forward's outputs given: R_i = sum_c |dO_ic O_ic|, the size of the terms that D_i
  // and dP_ij are summed from (see GivenForward), and the factor kappa of the floor.
  std::vector<double> terms(lse.size(), 0.0);
  const double kappa = d * kGivenForwardKappaPerDim;
  parallel_for(stats_rows.size(), 2.0 * s.seqlen_k * d, [&](size_t r) {
    thread_local std::vector<double> scores, o;
    scores.resize(s.seqlen_k);
    o.resize(d);
    const RowId& row = stats_rows[r];
    const size_t at = p.lse_index(row.b, row.h, row.s);
    const float* d_o = &p.d_o[p.q_index(row.b, row.s, row.h, 0)];
    if (given != nullptr) {  // the L and O the backward was handed
      lse[at] = (*given->lse)[at];
      const float* o_given = &(*given->o)[p.q_index(row.b, row.s, row.h, 0)];
      double dd = 0, rr = 0;
      for (int c = 0; c < d; ++c) {
        dd += static_cast<double>(d_o[c]) * o_given[c];
        rr += std::abs(static_cast<double>(d_o[c]) * o_given[c]);
      }
      delta[at] = dd;
      terms[at] = rr;
    } else {
      lse[at] = forward_row(p, row.b, row.h, row.s, o.data(), scores);
      delta[at] = dot(o.data(), d_o, d);
    }
  });
  // The magnitude of dS_ij's terms for the cancellation floor (see BackwardRef::dq_mag).
  const auto d_score_magnitude = [&](double prob, double d_prob, size_t at) {
    return given != nullptr ? prob * (std::abs(d_prob - delta[at]) + kappa * terms[at])
                            : prob * (std::abs(d_prob) + std::abs(delta[at]));
  };

  // 2. dQ_i = scale * sum_j P_ij (dP_ij - D_i) K_j over the keys row i sees.
  parallel_for(q_rows.size(), 3.0 * s.seqlen_k * d, [&](size_t r) {
    const RowId& row = q_rows[r];
    const int kv_head = row.h / group;
    const size_t at = p.lse_index(row.b, row.h, row.s);
    const float* q = &p.q[p.q_index(row.b, row.s, row.h, 0)];
    const float* d_o = &p.d_o[p.q_index(row.b, row.s, row.h, 0)];
    double* dq = &ref.dq[r * d];
    double* dq_mag = &ref.dq_mag[r * d];
    double* dq_floor = &ref.dq_floor[r * d];
    for (int j = 0; j < visible_keys(s, row.s); ++j) {
      const float* k = &p.k[p.kv_index(row.b, j, kv_head, 0)];
      const double prob = std::exp(scale * dot(q, k, d) - lse[at]);
      const double d_prob = dot(d_o, &p.v[p.kv_index(row.b, j, kv_head, 0)], d);
      const double d_score = prob * (d_prob - delta[at]);
      const double d_score_mag = d_score_magnitude(prob, d_prob, at);
      const double d_score_floor =
          unit * (underflows(prob) * std::abs(d_prob - delta[at]) + underflows(d_score));
      for (int c = 0; c < d; ++c) {
        dq[c] += scale * d_score * k[c];
        dq_mag[c] += scale * d_score_mag * std::abs(k[c]);
        dq_floor[c] += scale * d_score_floor * std::abs(k[c]);
      }
    }
  });

  // 3. dV_j = sum_i P_ij dO_i and dK_j = scale * sum_i dS_ij Q_i, over the query rows that see
  //    key j in every query head of the group.
  parallel_for(kv_rows.size(), 3.0 * group * s.seqlen_q * d, [&](size_t r) {
    const RowId& row = kv_rows[r];
    const float* k = &p.k[p.kv_index(row.b, row.s, row.h, 0)];
    const float* v = &p.v[p.kv_index(row.b, row.s, row.h, 0)];
    double* dk = &ref.dk[r * d];
    double* dv = &ref.dv[r * d];
    double* dk_mag = &ref.dk_mag[r * d];
    double* dv_mag = &ref.dv_mag[r * d];
    double* dk_floor = &ref.dk_floor[r * d];
    double* dv_floor = &ref.dv_floor[r * d];
    for (int h = row.h * group; h < (row.h + 1) * group; ++h) {
      for (int i = first_query_seeing(s, row.s); i < s.seqlen_q; ++i) {
        const size_t at = p.lse_index(row.b, h, i);
        const float* q = &p.q[p.q_index(row.b, i, h, 0)];
        const float* d_o = &p.d_o[p.q_index(row.b, i, h, 0)];
        const double prob = std::exp(scale * dot(q, k, d) - lse[at]);
        const double d_prob = dot(d_o, v, d);
        const double d_score = prob * (d_prob - delta[at]);
        const double d_score_mag = d_score_magnitude(prob, d_prob, at);
        const double prob_floor = unit * underflows(prob);
        const double d_score_floor =
            prob_floor * std::abs(d_prob - delta[at]) + unit * underflows(d_score);
        for (int c = 0; c < d; ++c) {
          dv[c] += prob * d_o[c];
          dk[c] += scale * d_score * q[c];
          dv_mag[c] += prob * std::abs(d_o[c]);
          dk_mag[c] += scale * d_score_mag * std::abs(q[c]);
          dv_floor[c] += prob_floor * std::abs(d_o[c]);
          dk_floor[c] += scale * d_score_floor * std::abs(q[c]);
        }
      }
    }
  });
  return ref;
}

}  // namespace fa
