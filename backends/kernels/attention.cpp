// Attention of a few new queries over a static KV cache (fp32, CPU), reading only the slots a
// query may see.
//
// A decoding step's queries (1 for AR, a tree's few for a verify) attend over a cache allocated
// for the whole image. PyTorch's kernels read every slot, masked or not, and a grouped-query
// model's keys are first copied once per query head (repeat_interleave). Here each (row, query
// head) reads its KV head's keys and values in place, skips every slot that the additive mask
// closes for all of its queries (-inf: slots not yet written, the block's later levels), and
// keeps the scores in a buffer of its own; the softmax is computed in fp32 as
// softmax(q k^T * scale + mask) v, each slot's terms summed in slot order, in fp32 for fp32 and
// bf16 inputs alike.
//
// Built at first use with the row kernel's flags (backends/cpu_kernels.py).

#include <math.h>
#include <stdint.h>
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

static inline float load_f(float x) { return x; }
static inline float load_f(uint16_t h) {  // bf16 bits
    uint32_t bits = (uint32_t)h << 16;
    float f;
    __builtin_memcpy(&f, &bits, 4);
    return f;
}
static inline void store_f(float *o, float x) { *o = x; }
static inline void store_f(uint16_t *o, float x) {  // round to nearest even; NaN stays NaN
    uint32_t bits;
    __builtin_memcpy(&bits, &x, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) {
        *o = (uint16_t)((bits >> 16) | 0x40);
        return;
    }
    bits += 0x7fffu + ((bits >> 16) & 1u);
    *o = (uint16_t)(bits >> 16);
}

// q (B, H, T, D) with strides (qb, qh, qt, 1); k, v (B, KV, S, D) contiguous; mask (B, T, S)
// contiguous additive (0 or -inf, or any finite bias); out (B, H, T, D) contiguous. E: float, or
// uint16_t holding bf16 (read into fp32, the output rounded once).
template <typename E>
static void attend(const E *q, long qb, long qh, long qt, const E *k, const E *v, const E *mask, E *out, long batch,
                   long heads, long kv_heads, long t_len, long slots, long d, float scale, int threads) {
    long group = heads / kv_heads;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long bh = 0; bh < batch * heads; bh++) {
        long b = bh / heads, h = bh % heads, g = h / group;
        const E *kk = k + (b * kv_heads + g) * slots * d;
        const E *vv = v + (b * kv_heads + g) * slots * d;
        const E *mm = mask + b * t_len * slots;
        std::vector<float> qf(t_len * d), row(d), o(t_len * d, 0.0f);
        for (long t = 0; t < t_len; t++)
            for (long i = 0; i < d; i++) qf[t * d + i] = load_f(q[b * qb + h * qh + t * qt + i]);
        std::vector<float> score(t_len * slots);
        std::vector<float> top(t_len, -INFINITY), total(t_len, 0.0f);
        std::vector<char> open(slots, 0);
        for (long j = 0; j < slots; j++) {
            for (long t = 0; t < t_len; t++) open[j] |= load_f(mm[t * slots + j]) != -INFINITY;
            if (!open[j]) continue;
            for (long i = 0; i < d; i++) row[i] = load_f(kk[j * d + i]);
            for (long t = 0; t < t_len; t++) {
                float bias = load_f(mm[t * slots + j]);
                float s = bias == -INFINITY ? -INFINITY : dot(qf.data() + t * d, row.data(), d) * scale + bias;
                score[t * slots + j] = s;
                if (s > top[t]) top[t] = s;
            }
        }
        for (long t = 0; t < t_len; t++)
            for (long j = 0; j < slots; j++) {
                if (!open[j]) continue;
                float *s = &score[t * slots + j];
                *s = *s == -INFINITY ? 0.0f : expf(*s - top[t]);
                total[t] += *s;
            }
        for (long j = 0; j < slots; j++) {  // each open slot's values read once, for every query
            if (!open[j]) continue;
            for (long i = 0; i < d; i++) row[i] = load_f(vv[j * d + i]);
            for (long t = 0; t < t_len; t++) {
                float p = score[t * slots + j];
                if (p == 0.0f) continue;
                float *ot = o.data() + t * d;
                for (long i = 0; i < d; i++) ot[i] += p * row[i];
            }
        }
        E *dst = out + (b * heads + h) * t_len * d;
        for (long t = 0; t < t_len; t++) {  // a query that sees nothing gets zeros, as PyTorch's SDPA gives
            float inv = top[t] == -INFINITY ? 0.0f : 1.0f / total[t];
            for (long i = 0; i < d; i++) store_f(dst + t * d + i, o[t * d + i] * inv);
        }
    }
}

extern "C" {

void cached_attention(const float *q, long qb, long qh, long qt, const float *k, const float *v, const float *mask,
                      float *out, long batch, long heads, long kv_heads, long t_len, long slots, long d, float scale,
                      int threads) {
    attend(q, qb, qh, qt, k, v, mask, out, batch, heads, kv_heads, t_len, slots, d, scale, threads);
}

void cached_attention_bf16(const uint16_t *q, long qb, long qh, long qt, const uint16_t *k, const uint16_t *v,
                           const uint16_t *mask, uint16_t *out, long batch, long heads, long kv_heads, long t_len,
                           long slots, long d, float scale, int threads) {
    attend(q, qb, qh, qt, k, v, mask, out, batch, heads, kv_heads, t_len, slots, d, scale, threads);
}

}  // extern "C"
