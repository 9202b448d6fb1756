"""Decode rows' attention over the slot cache in float32, compiled on this machine once.

Each decoding row of a pass attends with one query token per head over its own slot's keys.
Written as batched products (``slot_attention.decode_attention``), that is three ops over
``rows * kv_heads`` matrices of a few query rows by one or two key blocks, and a CPU's batched
products are slow at that size: on a 2-core AVX2 EPYC, a 32-row decode pass of SmolLM2-135M
spent about 14 ms of its 125 in them (``torch.bmm``/``baddbmm`` at about 230 us a call, 60
calls), and another 2 ms writing the new keys and values into the cache by indexing.

``attend`` does the same work in one call per layer: for each row and key-value head, it
writes the row's new key and value at its position in its slot, then, for each query head
of that group, takes the scaled dot products with the row's keys (its own length only: no
masked blocks), their softmax, and the values weighted by it; (row, key-value head) pairs
are shared out among torch's OpenMP threads. A row's arithmetic is the same whatever rows
share its call and whichever thread takes it (each dot product and each weighted sum one chain
over positions in order), so a seeded reply repeats alone or in a crowd.

Float32 caches only, head dimensions a multiple of 8, on x86-64 CPUs with AVX2 and FMA where
the C compiler builds it (``panel_kernel.built``, the same cache and fallback);
``PALAESTRA_ATTENTION_KERNEL=0`` turns it off (the batched products then run, as on other
CPUs and dtypes).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

import torch

from palaestra.engine import panel_kernel

logger = logging.getLogger(__name__)

SETTING = "PALAESTRA_ATTENTION_KERNEL"

SOURCE = r"""
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

/* exp(x) for each lane, x <= 0 (a softmax's shifted scores): 2^n e^r with r = x - n ln 2,
   e^r by Cephes' polynomial; below -87 (or -inf) it gives about 1e-38, nothing beside the
   largest score's 1. */
static inline __m256 exp_le0(__m256 x)
{
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    e = _mm256_slli_epi32(e, 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline float hsum(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* One query head of one row over keys[0..n) and values[0..n) ([n][dim] each): out = softmax(
   scaling q.k) v. s: room for n rounded up to 8 scores. dim is a multiple of 8, at most 256. */
static inline __attribute__((always_inline)) void head(
    const float *q, const float *k, const float *v, int64_t n, int64_t dim, float scaling,
    float *s, float *out)
{
    __m256 qv[32];
    for (int64_t d = 0; d < dim / 8; d++) qv[d] = _mm256_loadu_ps(q + 8 * d);
    float top = -INFINITY;
    for (int64_t j = 0; j < n; j++) {
        const float *kj = k + j * dim;
        __m256 acc = _mm256_mul_ps(qv[0], _mm256_loadu_ps(kj));
        for (int64_t d = 1; d < dim / 8; d++)
            acc = _mm256_fmadd_ps(qv[d], _mm256_loadu_ps(kj + 8 * d), acc);
        s[j] = hsum(acc) * scaling;
        top = s[j] > top ? s[j] : top;
    }
    int64_t padded = (n + 7) & ~(int64_t)7;
    for (int64_t j = n; j < padded; j++) s[j] = -INFINITY;
    __m256 shift = _mm256_set1_ps(top), total = _mm256_setzero_ps();
    for (int64_t j = 0; j < padded; j += 8) {
        __m256 e = exp_le0(_mm256_sub_ps(_mm256_loadu_ps(s + j), shift));
        _mm256_storeu_ps(s + j, e);
        total = _mm256_add_ps(total, e);
    }
    __m256 acc[32];
    for (int64_t d = 0; d < dim / 8; d++) acc[d] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
        __m256 w = _mm256_broadcast_ss(s + j);
        const float *vj = v + j * dim;
        for (int64_t d = 0; d < dim / 8; d++)
            acc[d] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vj + 8 * d), acc[d]);
    }
    __m256 inverse = _mm256_set1_ps(1.0f / hsum(total));
    for (int64_t d = 0; d < dim / 8; d++)
        _mm256_storeu_ps(out + 8 * d, _mm256_mul_ps(acc[d], inverse));
}

/* Row r (of rows) decodes at position lengths[r] - 1 of slot slots[r]. Its query for head h
   is at q + r * qs[0] + h * qs[1], its new key and value for key-value head g at
   k_new + r * ks[0] + g * ks[1] and v_new + r * vs[0] + g * vs[1], its output for head h goes
   to out + r * os[0] + h * os[1] (strides in floats; each vector of dim floats side by side).
   The cache holds [slots][kv_heads][capacity][dim] per layer, keys and values alike.
   scratch: room for threads * (capacity rounded up to 8) floats. */
void slot_decode(const float *q, const int64_t *qs, const float *k_new, const int64_t *ks,
                 const float *v_new, const int64_t *vs, float *keys, float *values,
                 int64_t capacity, const int64_t *slots, const int64_t *lengths, int64_t rows,
                 int64_t heads, int64_t kv_heads, int64_t dim, float scaling, float *out,
                 const int64_t *os, float *scratch, int threads)
{
    int64_t group = heads / kv_heads, room = (capacity + 7) & ~(int64_t)7;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t pair = 0; pair < rows * kv_heads; pair++) {
        int64_t r = pair / kv_heads, g = pair % kv_heads, n = lengths[r];
        int64_t base = (slots[r] * kv_heads + g) * capacity * dim;
        float *k = keys + base, *v = values + base;
        memcpy(k + (n - 1) * dim, k_new + r * ks[0] + g * ks[1], dim * sizeof(float));
        memcpy(v + (n - 1) * dim, v_new + r * vs[0] + g * vs[1], dim * sizeof(float));
        float *s = scratch + omp_get_thread_num() * room;
        for (int64_t h = g * group; h < (g + 1) * group; h++) {
            const float *qh = q + r * qs[0] + h * qs[1];
            float *oh = out + r * os[0] + h * os[1];
            if (dim == 64)
                head(qh, k, v, n, 64, scaling, s, oh);
            else
                head(qh, k, v, n, dim, scaling, s, oh);
        }
    }
}
"""


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernel (built on first use into ``panel_kernel.kernel_cache()``), or None,
    with one log line saying why, where it cannot be built or loaded here."""
    if not panel_kernel.cpu_runs_avx2():
        return None
    try:
        lib = ctypes.CDLL(str(panel_kernel.built("attention", SOURCE)))
    except (panel_kernel.NotBuilt, OSError) as error:
        logger.warning("attention kernel: %s; decode rows attend by batched products", error)
        return None
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    lib.slot_decode.argtypes = [
        pointer, pointer, pointer, pointer, pointer, pointer, pointer, pointer, size, pointer,
        pointer, size, size, size, size, ctypes.c_float, pointer, pointer, pointer, ctypes.c_int,
    ]  # fmt: skip
    lib.slot_decode.restype = None
    return lib


def usable(dtype: torch.dtype, device: torch.device, head_dim: int) -> bool:
    """Whether decode rows of a cache of this dtype, device and head size attend here:
    float32 on the CPU, a head dimension that is a multiple of 8 up to 256, unless
    ``PALAESTRA_ATTENTION_KERNEL=0``; and the kernel builds."""
    if dtype != torch.float32 or device.type != "cpu" or os.environ.get(SETTING) == "0":
        return False
    return head_dim % 8 == 0 and head_dim <= 256 and library() is not None


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    scaling: float,
    out: torch.Tensor,
    scratch: torch.Tensor,
) -> None:
    """Each row ``r`` of ``query`` (``[rows, heads, dim]``), whose new ``key`` and ``value``
    (``[rows, kv_heads, dim]``) go to position ``lengths[r] - 1`` of slot ``slots[r]`` of the
    layer's ``keys`` and ``values`` (``[slots, kv_heads, capacity, dim]``), attending over
    that slot's first ``lengths[r]`` positions, into ``out`` (``[rows, heads, dim]``).
    ``scratch`` holds at least ``threads * capacity`` (rounded up to 8) floats. Rows must be
    in distinct slots, lengths within the capacity (the plan sees to both)."""
    rows, heads, dim = query.shape
    kv_heads, capacity = keys.shape[1], keys.shape[2]
    threads = torch.get_num_threads()
    for name, tensor in (("query", query), ("key", key), ("value", value), ("out", out)):
        if tensor.dtype != torch.float32 or tensor.dim() != 3 or tensor.stride(-1) != 1:
            raise ValueError(f"attention kernel: {name} must be float32 [rows, heads, dim] "
                             f"with each head's dim side by side; got {tuple(tensor.shape)} "
                             f"{tensor.dtype} strides {tensor.stride()}")  # fmt: skip
    if not (keys.is_contiguous() and values.is_contiguous()) or keys.shape != values.shape:
        raise ValueError("attention kernel: keys and values must be contiguous, of one shape")
    for name, index in (("slots", slots), ("lengths", lengths)):
        if index.dtype != torch.int64 or index.shape != (rows,) or not index.is_contiguous():
            raise ValueError(f"attention kernel: {name} must be {rows} contiguous int64s")
    if scratch.numel() < threads * ((capacity + 7) // 8 * 8):
        raise ValueError(f"attention kernel: scratch of {scratch.numel()} floats is too small")
    strides = torch.tensor(
        [t.stride()[:2] for t in (query, key, value, out)], dtype=torch.int64
    )  # one small tensor: four (row, head) pairs
    step = strides.stride(0) * 8
    first = strides.data_ptr()
    library().slot_decode(
        query.data_ptr(), first, key.data_ptr(), first + step, value.data_ptr(),
        first + 2 * step, keys.data_ptr(), values.data_ptr(), capacity,
        slots.data_ptr(), lengths.data_ptr(), rows, heads, kv_heads,
        dim, scaling, out.data_ptr(), first + 3 * step, scratch.data_ptr(), threads,
    )  # fmt: skip
