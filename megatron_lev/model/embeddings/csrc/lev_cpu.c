/*
 * Fused CPU kernel for LEV's separable product (spec: LEV.md, step 5).
 *
 *   (idx, w)[n,l,j,:3] = the 3 active quadratic B-spline basis functions at u[n,l,j]  (spline.py)
 *   phi[n,l,j,rho]     = sum_{a<3} w[n,l,j,a] * shifted[l,j,idx[n,l,j,a],rho]     (shifted = 1 + delta)
 *   M[n,l,rho]         = prod_j phi[n,l,j,rho]   in sign-and-log form
 *
 * Same arithmetic as the PyTorch path in lev.py (`_group_product`, `SeparableProduct`):
 * factors are multiplied directly in groups of GROUP coordinates; a group whose smallest
 * |phi| is below SAFE_FACTOR, or whose product is outside [SAFE_LO, SAFE_HI] or not finite,
 * takes the per-factor form sum_j log(|phi_j| + LOG_EPS). Backward uses M / phi_j in plain
 * groups and sign * exp(L - log(|phi_j| + eps)) in the others.
 *
 * What the kernel saves over the PyTorch path is memory traffic: the basis is computed
 * in registers from u, and phi lives in a GROUP x r buffer (a few KB, in L1) instead of
 * being written and re-read as (h, d, N, r) tensors by a chain of element-wise passes.
 *
 * Threading is the caller's: every entry point takes a task range [t0, t1), and
 * tasks write disjoint outputs (forward: one (n, l) pair per task; backward: one
 * (l, group) pair per task, which owns its slice of grad_delta), so no locks or atomics.
 * The caller releases the GIL (ctypes does) and runs ranges on a thread pool.
 *
 * Layouts (row-major, contiguous):
 *   u, grad_u        (N, H, D)         spline inputs in [0, 1]
 *   shifted, grad_d  (H, D, K, R)
 *   log_abs, sign, out, grad_m, signed_grad   (N, H, R)
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define GROUP 16
#define SAFE_FACTOR 1e-3
#define SAFE_LO 1e-30
#define SAFE_HI 1e30
#define LOG_EPS 1e-9
#define FLUSH_LO 1e-200 /* the double accumulator of group products takes a log outside this range */
#define FLUSH_HI 1e200

#define DEFINE_LEV_KERNELS(T, SUFFIX, FABS, LOG, EXP, FLOOR)                                                   \
    /* The 3 active basis functions at u (spline.py's active_basis): knot indices, normalised */              \
    /* weights and, if dw is given, d(weight)/du. Knots outside [0, K) get weight 0, index clamped. */        \
    static inline void basis_##SUFFIX(T u, int64_t K, int64_t *idx, T *w, T *dw) {                             \
        const T x = u * (T)(K - 1);                                                                             \
        T c = FLOOR(x + (T)0.5);                                                                                \
        c = c < 0 ? 0 : (c > (T)(K - 1) ? (T)(K - 1) : c);                                                      \
        const T f = x - c;                                                                                      \
        const int64_t ci = (int64_t)c;                                                                          \
        const int v0 = ci - 1 >= 0, v2 = ci + 1 < K;                                                            \
        const T r0 = v0 ? (T)0.5 * ((T)0.5 - f) * ((T)0.5 - f) : 0;                                             \
        const T r1 = (T)0.75 - f * f;                                                                           \
        const T r2 = v2 ? (T)0.5 * ((T)0.5 + f) * ((T)0.5 + f) : 0;                                             \
        const T sum = r0 + r1 + r2;                                                                             \
        idx[0] = v0 ? ci - 1 : 0;                                                                               \
        idx[1] = ci;                                                                                            \
        idx[2] = v2 ? ci + 1 : K - 1;                                                                           \
        w[0] = r0 / sum;                                                                                        \
        w[1] = r1 / sum;                                                                                        \
        w[2] = r2 / sum;                                                                                        \
        if (dw) { /* d/df of r_a / sum, times df/du = K - 1 (the centre is piecewise constant) */             \
            const T d0 = v0 ? -((T)0.5 - f) : 0, d1 = -2 * f, d2 = v2 ? (T)0.5 + f : 0;                         \
            const T ds = d0 + d1 + d2, scale = (T)(K - 1) / sum;                                                \
            dw[0] = (d0 - w[0] * ds) * scale;                                                                   \
            dw[1] = (d1 - w[1] * ds) * scale;                                                                   \
            dw[2] = (d2 - w[2] * ds) * scale;                                                                   \
        }                                                                                                       \
    }                                                                                                           \
                                                                                                                \
    /* phi rows of one group into buf (len x R); prod and min|phi| per rho; the basis into bidx/bw. */        \
    /* Not inlined, so forward and backward run the same instructions and take the same */                    \
    /* plain/per-factor decision. */                                                                           \
    __attribute__((noinline)) static void group_phi_##SUFFIX(                                                   \
        const T *restrict u, const T *restrict shifted_l, int64_t j0, int64_t len, int64_t K, int64_t R,        \
        T *restrict buf, T *restrict prod, T *restrict smallest, int64_t *restrict bidx, T *restrict bw,        \
        T *restrict bdw) {                                                                                      \
        for (int64_t rho = 0; rho < R; ++rho) {                                                                 \
            prod[rho] = (T)1;                                                                                   \
            smallest[rho] = (T)INFINITY;                                                                        \
        }                                                                                                       \
        for (int64_t jj = 0; jj < len; ++jj) {                                                                  \
            const int64_t j = j0 + jj;                                                                          \
            int64_t *ix = bidx + 3 * jj;                                                                        \
            T *wj = bw + 3 * jj;                                                                                \
            basis_##SUFFIX(u[j], K, ix, wj, bdw ? bdw + 3 * jj : NULL);                                         \
            const T w0 = wj[0], w1 = wj[1], w2 = wj[2];                                                         \
            const T *restrict r0 = shifted_l + (j * K + ix[0]) * R;                                             \
            const T *restrict r1 = shifted_l + (j * K + ix[1]) * R;                                             \
            const T *restrict r2 = shifted_l + (j * K + ix[2]) * R;                                             \
            T *restrict phi = buf + jj * R;                                                                     \
            for (int64_t rho = 0; rho < R; ++rho) {                                                             \
                const T v = w0 * r0[rho] + w1 * r1[rho] + w2 * r2[rho];                                         \
                const T a = FABS(v);                                                                            \
                phi[rho] = v;                                                                                   \
                prod[rho] *= v;                                                                                 \
                smallest[rho] = a < smallest[rho] ? a : smallest[rho];                                          \
            }                                                                                                   \
        }                                                                                                       \
    }                                                                                                           \
                                                                                                                \
    static inline int group_is_bad_##SUFFIX(T p, T smallest) {                                                  \
        const T size = FABS(p);                                                                                 \
        return (smallest < (T)SAFE_FACTOR) || !(size >= (T)SAFE_LO && size <= (T)SAFE_HI);                      \
    }                                                                                                           \
                                                                                                                \
    /* Tasks are (l, n) pairs, head-major (t = l * N + n), so consecutive tasks read one head's delta. */      \
    /* Writes log_abs, sign and out = sign * exp(log_abs). */                                                  \
    int lev_forward_##SUFFIX(const T *u, const T *shifted, int64_t N, int64_t H, int64_t D, int64_t K,          \
                             int64_t R, int64_t t0, int64_t t1, T *log_abs, T *sign, T *out) {                  \
        T *buf = (T *)malloc(sizeof(T) * ((GROUP + 2) * R + 3 * GROUP));                                       \
        int64_t *bidx = (int64_t *)malloc(sizeof(int64_t) * 3 * GROUP);                                         \
        double *acc = (double *)malloc(sizeof(double) * 2 * R);                                                 \
        if (!buf || !acc || !bidx) {                                                                            \
            free(buf);                                                                                          \
            free(acc);                                                                                          \
            free(bidx);                                                                                         \
            return 1;                                                                                           \
        }                                                                                                       \
        T *prod = buf + GROUP * R, *smallest = prod + R, *bw = smallest + R;                                    \
        double *product = acc, *logsum = acc + R;                                                               \
        for (int64_t t = t0; t < t1; ++t) {                                                                     \
            const int64_t l = t / N, nl = (t % N) * H + l;                                                      \
            const T *ut = u + nl * D;                                                                           \
            const T *shifted_l = shifted + l * D * K * R;                                                       \
            T *sg = sign + nl * R;                                                                              \
            for (int64_t rho = 0; rho < R; ++rho) {                                                             \
                product[rho] = 1.0;                                                                             \
                logsum[rho] = 0.0;                                                                              \
                sg[rho] = (T)1;                                                                                 \
            }                                                                                                   \
            for (int64_t j0 = 0; j0 < D; j0 += GROUP) {                                                         \
                const int64_t len = D - j0 < GROUP ? D - j0 : GROUP;                                            \
                group_phi_##SUFFIX(ut, shifted_l, j0, len, K, R, buf, prod, smallest, bidx, bw, NULL);          \
                for (int64_t rho = 0; rho < R; ++rho) {                                                         \
                    if (!group_is_bad_##SUFFIX(prod[rho], smallest[rho])) {                                     \
                        product[rho] *= (double)FABS(prod[rho]);                                                \
                        if (prod[rho] < 0) sg[rho] = -sg[rho];                                                  \
                    } else { /* the spec's per-factor form */                                                  \
                        for (int64_t jj = 0; jj < len; ++jj) {                                                  \
                            const T v = buf[jj * R + rho];                                                      \
                            logsum[rho] += (double)LOG(FABS(v) + (T)LOG_EPS);                                   \
                            if (v < 0) sg[rho] = -sg[rho];                                                      \
                        }                                                                                       \
                    }                                                                                           \
                    if (product[rho] < FLUSH_LO || product[rho] > FLUSH_HI) {                                   \
                        logsum[rho] += log(product[rho]);                                                       \
                        product[rho] = 1.0;                                                                     \
                    }                                                                                           \
                }                                                                                               \
            }                                                                                                   \
            T *la = log_abs + nl * R, *o = out + nl * R;                                                        \
            for (int64_t rho = 0; rho < R; ++rho) {                                                             \
                la[rho] = (T)(logsum[rho] + log(product[rho]));                                                 \
                o[rho] = sg[rho] * EXP(la[rho]);                                                                \
            }                                                                                                   \
        }                                                                                                       \
        free(buf);                                                                                              \
        free(acc);                                                                                              \
        free(bidx);                                                                                             \
        return 0;                                                                                               \
    }                                                                                                           \
                                                                                                                \
    /* Tasks are (l, group) pairs: t = l * G + g with G = ceil(D / GROUP); each owns grad_d[l, group] */       \
    /* and grad_u[:, l, group]. grad_m = grad_out * M and signed_grad = grad_out * sign, both (N, H, R). */    \
    int lev_backward_##SUFFIX(const T *u, const T *shifted, const T *log_abs, const T *grad_m,                  \
                              const T *signed_grad, int64_t N, int64_t H, int64_t D, int64_t K, int64_t R,      \
                              int64_t t0, int64_t t1, T *grad_u, T *grad_d) {                                   \
        const int64_t G = (D + GROUP - 1) / GROUP;                                                              \
        T *buf = (T *)malloc(sizeof(T) * ((GROUP + 3) * R + 6 * GROUP));                                       \
        int64_t *bidx = (int64_t *)malloc(sizeof(int64_t) * 3 * GROUP);                                         \
        if (!buf || !bidx) {                                                                                    \
            free(buf);                                                                                          \
            free(bidx);                                                                                         \
            return 1;                                                                                           \
        }                                                                                                       \
        T *prod = buf + GROUP * R, *smallest = prod + R, *gphi = smallest + R, *bw = gphi + R;                  \
        T *bdw = bw + 3 * GROUP;                                                                                \
        for (int64_t t = t0; t < t1; ++t) {                                                                     \
            const int64_t l = t / G, j0 = (t % G) * GROUP;                                                      \
            const int64_t len = D - j0 < GROUP ? D - j0 : GROUP;                                                \
            const T *shifted_l = shifted + l * D * K * R;                                                       \
            T *grad_dl = grad_d ? grad_d + l * D * K * R : NULL;                                                \
            for (int64_t n = 0; n < N; ++n) {                                                                   \
                const int64_t nl = n * H + l;                                                                   \
                const T *ut = u + nl * D;                                                                       \
                const T *gm = grad_m + nl * R, *sgd = signed_grad + nl * R, *la = log_abs + nl * R;             \
                group_phi_##SUFFIX(ut, shifted_l, j0, len, K, R, buf, prod, smallest, bidx, bw, bdw);           \
                int any_bad = 0;                                                                                \
                for (int64_t rho = 0; rho < R; ++rho) any_bad |= group_is_bad_##SUFFIX(prod[rho], smallest[rho]); \
                for (int64_t jj = 0; jj < len; ++jj) {                                                          \
                    const int64_t j = j0 + jj;                                                                  \
                    const T *restrict phi = buf + jj * R;                                                       \
                    for (int64_t rho = 0; rho < R; ++rho) gphi[rho] = gm[rho] / phi[rho];                       \
                    if (any_bad) {                                                                              \
                        for (int64_t rho = 0; rho < R; ++rho) {                                                 \
                            if (!group_is_bad_##SUFFIX(prod[rho], smallest[rho])) continue;                     \
                            const T v = phi[rho];                                                               \
                            const T others = sgd[rho] * EXP(la[rho] - LOG(FABS(v) + (T)LOG_EPS));               \
                            gphi[rho] = v < 0 ? -others : others;                                               \
                        }                                                                                       \
                    }                                                                                           \
                    T gu = 0;                                                                                   \
                    for (int a = 0; a < 3; ++a) {                                                               \
                        const int64_t row = (j * K + bidx[3 * jj + a]) * R;                                     \
                        const T *restrict src = shifted_l + row;                                                \
                        if (grad_u) {                                                                           \
                            T s = 0;                                                                            \
                            for (int64_t rho = 0; rho < R; ++rho) s += gphi[rho] * src[rho];                    \
                            gu += s * bdw[3 * jj + a];                                                          \
                        }                                                                                       \
                        if (grad_dl) {                                                                          \
                            const T wa = bw[3 * jj + a];                                                        \
                            T *restrict dst = grad_dl + row;                                                    \
                            for (int64_t rho = 0; rho < R; ++rho) dst[rho] += wa * gphi[rho];                   \
                        }                                                                                       \
                    }                                                                                           \
                    if (grad_u) grad_u[nl * D + j] = gu;                                                        \
                }                                                                                               \
            }                                                                                                   \
        }                                                                                                       \
        free(buf);                                                                                              \
        free(bidx);                                                                                             \
        return 0;                                                                                               \
    }

DEFINE_LEV_KERNELS(float, f32, fabsf, logf, expf, floorf)
DEFINE_LEV_KERNELS(double, f64, fabs, log, exp, floor)

/* The GROUP the kernel was built with: the loader checks it against lev.py's. */
int lev_group_size(void) { return GROUP; }
