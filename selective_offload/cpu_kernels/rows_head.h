/* Part of moe.c's one translation unit (included once, by moe.c only, after the experts'
 * job): one bf16 matrix's rows dotted with a few tokens, the split LM head's host part
 * (selective_offload/wrappers/host_rows.py), on the bf16 experts' row walk and threads. */

/* One rows call's parallel part (pool.h): blocks of HB rows drawn dynamically. */
typedef struct {
    const uint16_t *w;
    const void *X;
    float *out;
    int64_t R, C, T, blocks, next;
} so_rows_work;

static void so_rows_run(void *arg, int tid, int nt) {
    so_rows_work *wk = (so_rows_work *)arg;
    const uint16_t *w = wk->w;
    const int64_t R = wk->R, C = wk->C, T = wk->T;
#if defined(SO_BF16DOT)
    const uint16_t *X = (const uint16_t *)wk->X;
#else
    const float *X = (const float *)wk->X;
#endif
    (void)tid;
    (void)nt;
    for (int64_t b; (b = so_next(&wk->next)) < wk->blocks;) {
        float acc[NT];
        int64_t r1 = (b + 1) * HB < R ? (b + 1) * HB : R;
        for (int64_t r = b * HB; r < r1; r++)
            for (int64_t t = 0; t < T; t += NT) {
                int n = T - t < NT ? (int)(T - t) : NT;
#if defined(SO_BF16DOT)
                dot16_bf16(w + r * C, NULL, 0, C, X + t * C, C, n, acc);
#else
                dot_bf16(w + r * C, NULL, 0, C, X + t * C, C, n, acc);
#endif
                for (int q = 0; q < n; q++) wk->out[(t + q) * R + r] = acc[q];
            }
    }
}

/* Rows of one bf16 matrix w [R, C] dotted with T tokens x [T, C] (bf16 or f32): out [T, R]
 * f32, with the experts' row walk and thread pool (an LM head's host rows; torch's own CPU
 * linear would run on the one thread vLLM leaves torch while serving). The tokens are
 * reordered into ``ws`` when it holds ``ws_bytes`` >= T * C * 4 + 64 (the worker's one
 * workspace, selective_offload/worker_buffers.py), else into a buffer of their own.
 * Returns 0, 2 when that buffer cannot be allocated, or 4 when the threads cannot be started. */
int64_t so_rows_bf16(const uint16_t *w, int64_t R, int64_t C, const void *x, int64_t x_dtype, int64_t T, float *out,
                     int64_t threads, void *ws, int64_t ws_bytes) {
#if defined(SO_BF16DOT)
    typedef uint16_t xval;
#else
    typedef float xval;
#endif
    xval *X = (xval *)ws, *own = NULL;
    if (!X || ws_bytes < T * C * 4 + 64) {
        own = X = (xval *)malloc((size_t)(T * C) * sizeof(xval) + 64);
        if (!X) return 2;
    }
    for (int64_t t = 0; t < T; t++)
        for (int64_t k = 0; k < C; k++) {
            int64_t i = t * C + k;
            float v = x_dtype == SO_DT_F32 ? ((const float *)x)[i] : bf16_to_f32(((const uint16_t *)x)[i]);
#if defined(SO_BF16DOT)
            X[t * C + slot_of(SO_BF16, k, C)] = x_dtype == SO_DT_F32 ? f32_to_bf16(v) : ((const uint16_t *)x)[i];
#else
            X[t * C + slot_of(SO_BF16, k, C)] = v;
#endif
        }
    so_rows_work work = {w, X, out, R, C, T, (R + HB - 1) / HB, 0};
    int failed = so_par((int)(threads > 0 ? threads : 1), so_rows_run, &work);
    free(own);
    return failed ? 4 : 0;
}

/* so_rows_bf16's call as one argument, for a CUDA host function (cudaLaunchHostFunc) that
 * runs it stream-ordered with no Python: every pointer and size, and its status after. */
typedef struct {
    const void *w, *x;
    float *out;
    int64_t R, C, x_dtype, T, threads, status;
    void *workspace;                /* NULL: allocated per call */
    int64_t workspace_bytes;
    int64_t runs, tokens;           /* counted by the job as it runs (as the experts' job is) */
} so_rows_job;

int64_t so_rows_job_size(void) { return (int64_t)sizeof(so_rows_job); }

void so_rows_job_run(void *arg) {
    so_rows_job *j = (so_rows_job *)arg;
    j->status = 0;
    j->runs++;
    j->tokens += j->T;
    if (j->x_dtype != SO_DT_BF16 && j->x_dtype != SO_DT_F32) { so_fail(j, &j->status, 3, j->out, j->T * j->R); return; }
    int64_t status = so_rows_bf16((const uint16_t *)j->w, j->R, j->C, j->x, j->x_dtype, j->T, j->out, j->threads,
                                  j->workspace, j->workspace_bytes);
    if (status) so_fail(j, &j->status, status, j->out, j->T * j->R);
}
