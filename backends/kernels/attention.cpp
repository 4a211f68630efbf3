// Attention of a few new queries over a static KV cache (fp32, CPU), reading only the slots a
// query may see.
//
// A decoding step's queries (1 for AR, a tree's few for a verify) attend over a cache allocated
// for the whole image. PyTorch's kernels read every slot, masked or not, and a grouped-query
// model's keys are first copied once per query head (repeat_interleave). Here each (row, query
// head) reads its KV head's keys and values in place, skips every slot that the additive mask
// closes for all of its queries (-inf: slots not yet written, the block's later levels), and
// keeps the scores in a buffer of its own; the softmax is computed in fp32 as
// softmax(q k^T * scale + mask) v, each slot's terms summed in slot order.
//
// Built at first use with the row kernel's flags (backends/cpu_kernels.py).

#include <math.h>
#include <vector>

typedef float v16 __attribute__((vector_size(64), aligned(4)));

static inline float dot(const float *a, const float *b, long d) {
    long i = 0;
    v16 acc = v16{};
    for (; i + 16 <= d; i += 16) acc += *(const v16 *)(a + i) * *(const v16 *)(b + i);
    float s = 0.0f;
    for (int l = 0; l < 16; l++) s += acc[l];
    for (; i < d; i++) s += a[i] * b[i];
    return s;
}

extern "C" {

// q (B, H, T, D) with strides (qb, qh, qt, 1); k, v (B, KV, S, D) contiguous; mask (B, T, S)
// contiguous additive (0 or -inf, or any finite bias); out (B, H, T, D) contiguous.
void cached_attention(const float *q, long qb, long qh, long qt, const float *k, const float *v, const float *mask,
                      float *out, long batch, long heads, long kv_heads, long t_len, long slots, long d, float scale,
                      int threads) {
    long group = heads / kv_heads;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long bh = 0; bh < batch * heads; bh++) {
        long b = bh / heads, h = bh % heads, g = h / group;
        const float *kk = k + (b * kv_heads + g) * slots * d;
        const float *vv = v + (b * kv_heads + g) * slots * d;
        const float *mm = mask + b * t_len * slots;
        std::vector<float> score(t_len * slots);
        std::vector<float> top(t_len, -INFINITY);
        std::vector<char> open(slots, 0);
        for (long j = 0; j < slots; j++) {
            for (long t = 0; t < t_len; t++) open[j] |= mm[t * slots + j] != -INFINITY;
            if (!open[j]) continue;
            for (long t = 0; t < t_len; t++) {
                float bias = mm[t * slots + j];
                float s = bias == -INFINITY ? -INFINITY : dot(q + b * qb + h * qh + t * qt, kk + j * d, d) * scale + bias;
                score[t * slots + j] = s;
                if (s > top[t]) top[t] = s;
            }
        }
        std::vector<float> total(t_len, 0.0f);
        for (long t = 0; t < t_len; t++)
            for (long j = 0; j < slots; j++) {
                if (!open[j]) continue;
                float *s = &score[t * slots + j];
                *s = *s == -INFINITY ? 0.0f : expf(*s - top[t]);
                total[t] += *s;
            }
        float *o = out + (b * heads + h) * t_len * d;
        for (long i = 0; i < t_len * d; i++) o[i] = 0.0f;
        for (long j = 0; j < slots; j++) {  // each open slot's values read once, for every query
            if (!open[j]) continue;
            const float *row = vv + j * d;
            for (long t = 0; t < t_len; t++) {
                float p = score[t * slots + j];
                if (p == 0.0f) continue;
                float *ot = o + t * d;
                for (long i = 0; i < d; i++) ot[i] += p * row[i];
            }
        }
        for (long t = 0; t < t_len; t++) {  // a query that sees nothing: NaN, as a softmax over only -inf
            float inv = top[t] == -INFINITY ? NAN : 1.0f / total[t];
            for (long i = 0; i < d; i++) o[t * d + i] *= inv;
        }
    }
}

}  // extern "C"
