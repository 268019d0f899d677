/* Part of moe.c's one translation unit (included once, by moe.c only): the kernels' own
 * thread pool, in place of the OpenMP runtime torch loaded.
 *
 * Why not OpenMP: libgomp's idle threads spin before they sleep, for a time fixed when torch
 * loads it (OMP_WAIT_POLICY and GOMP_SPINCOUNT are read then), so between two layers the
 * kernel's threads burn the cores vLLM's engine thread needs; and its threads are not
 * pinned unless the whole process's OpenMP is. This pool:
 *
 * - is made on the first job of more than one thread and kept: a worker per thread past
 *   the first, added when a job asks for more (never fewer kept), and made again in a
 *   forked child (pthread_atfork, and the pid checked: a child has none of its parent's
 *   threads);
 * - runs a job on the calling thread and workers 1 .. threads-1, each worker pinned to one
 *   core of the list given (so_pool_set_cpus: worker w on cpus[w % n]; the caller is not
 *   pinned, it is not the pool's thread), by default the cores of torch's OpenMP places
 *   (OMP_PLACES / GOMP_CPU_AFFINITY, as vLLM's CPU worker binds them), else unpinned;
 * - hands a job over by a generation counter: a waiting thread spins for at most
 *   so_pool_spin_ns (a few microseconds, a knob) and then sleeps on a futex, at the
 *   job's start, at its barriers and between jobs;
 * - when a worker cannot be made, refuses the job (so_pool_run returns nonzero, and the
 *   job is failed and counted as every failed job is), never waits for it.
 *
 * Built with -DSO_OPENMP, the same jobs run on the OpenMP runtime instead (the benchmark
 * times one beside the other). */
#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* A job's work: called once on each of its nt threads, tid 0 (the caller) .. nt-1. */
typedef void (*so_task)(void *arg, int tid, int nt);

#define SO_POOL_MAX 1024
/* A worker's stack: the jobs keep a few KB on it (their buffers are the workspace). */
#define SO_POOL_STACK (256 << 10)

static struct {
    pthread_mutex_t lock;   /* one job at a time (jobs of one thread do not take it) */
    pid_t pid;              /* the process the workers belong to */
    int workers;            /* workers made: tids 1 .. workers */
    pthread_t th[SO_POOL_MAX];
    uint32_t seen0[SO_POOL_MAX];
    int32_t tid[SO_POOL_MAX];  /* each worker's kernel thread id, once it runs */
    int cpus[SO_POOL_MAX], ncpus, cpus_set;
    uint32_t gen;           /* futex word: the job's generation */
    uint32_t acked;         /* futex word: workers done with this generation */
    uint32_t sleepers;      /* threads asleep on any of the words (a wake is a syscall) */
    uint32_t bar_count, bar_phase;
    so_task fn;
    void *arg;
    int nt;
    int64_t spin_ns;
} so_pool = {.lock = PTHREAD_MUTEX_INITIALIZER, .spin_ns = 5000};

/* How long a waiting thread spins before it sleeps, in ns (0: it sleeps at once). */
void so_pool_set_spin_ns(int64_t ns) { __atomic_store_n(&so_pool.spin_ns, ns < 0 ? 0 : ns, __ATOMIC_RELAXED); }
int64_t so_pool_spin_ns(void) { return __atomic_load_n(&so_pool.spin_ns, __ATOMIC_RELAXED); }

static inline int64_t so_now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static inline void so_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Wait until *word is no longer old: spin for the pool's window, then sleep on the futex. */
static void so_wait_change(uint32_t *word, uint32_t old) {
    int64_t window = so_pool_spin_ns(), start = window ? so_now_ns() : 0;
    while (window) {
        for (int i = 0; i < 64; i++) {
            if (__atomic_load_n(word, __ATOMIC_ACQUIRE) != old) return;
            so_relax();
        }
        if (so_now_ns() - start > window) break;
    }
    while (__atomic_load_n(word, __ATOMIC_ACQUIRE) == old) {
        __atomic_add_fetch(&so_pool.sleepers, 1, __ATOMIC_SEQ_CST);
        syscall(SYS_futex, word, FUTEX_WAIT_PRIVATE, old, NULL, NULL, 0);
        __atomic_sub_fetch(&so_pool.sleepers, 1, __ATOMIC_SEQ_CST);
    }
}

/* Wake whoever sleeps on *word (after it was changed). */
static inline void so_wake(uint32_t *word) {
    if (__atomic_load_n(&so_pool.sleepers, __ATOMIC_SEQ_CST))
        syscall(SYS_futex, word, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

/* Worker w's core: cpus[w % n] of the list given, or left as it is when there is none. */
static void so_pin(int w) {
    if (!so_pool.ncpus) return;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(so_pool.cpus[w % so_pool.ncpus], &set);
    pthread_setaffinity_np(so_pool.th[w - 1], sizeof(set), &set);
}

static void *so_worker(void *p) {
    int w = (int)(intptr_t)p;
    uint32_t seen = so_pool.seen0[w - 1];
    __atomic_store_n(&so_pool.tid[w - 1], (int32_t)syscall(SYS_gettid), __ATOMIC_RELEASE);
    for (;;) {
        so_wait_change(&so_pool.gen, seen);
        seen = __atomic_load_n(&so_pool.gen, __ATOMIC_ACQUIRE);
        /* Every worker acknowledges every job (those past its threads at once), so the
         * job's fields are not rewritten while a worker may still read them. */
        if (w < so_pool.nt) so_pool.fn(so_pool.arg, w, so_pool.nt);
        if (__atomic_add_fetch(&so_pool.acked, 1, __ATOMIC_ACQ_REL) == (uint32_t)so_pool.workers)
            so_wake(&so_pool.acked);
    }
    return NULL;
}

/* The barrier of a job's nt threads (its phases: every output element has one writer). */
static __attribute__((unused)) void so_barrier(int nt) {
    if (nt <= 1) return;
    uint32_t phase = __atomic_load_n(&so_pool.bar_phase, __ATOMIC_ACQUIRE);
    if (__atomic_add_fetch(&so_pool.bar_count, 1, __ATOMIC_ACQ_REL) == (uint32_t)nt) {
        __atomic_store_n(&so_pool.bar_count, 0, __ATOMIC_RELAXED);
        __atomic_add_fetch(&so_pool.bar_phase, 1, __ATOMIC_RELEASE);
        so_wake(&so_pool.bar_phase);
    } else {
        so_wait_change(&so_pool.bar_phase, phase);
    }
}

/* A forked child has none of the parent's workers: it starts with none (and a lock no
 * thread of the parent holds: the parent took it to fork). */
static void so_pool_prefork(void) { pthread_mutex_lock(&so_pool.lock); }
static void so_pool_postfork_parent(void) { pthread_mutex_unlock(&so_pool.lock); }
static void so_pool_postfork_child(void) {
    so_pool.workers = 0;
    so_pool.pid = getpid();
    so_pool.sleepers = 0;
    so_pool.bar_count = 0;
    pthread_mutex_init(&so_pool.lock, NULL);
}
__attribute__((constructor)) static void so_pool_atfork(void) {
    pthread_atfork(so_pool_prefork, so_pool_postfork_parent, so_pool_postfork_child);
}

/* Default pinning: the cores of the OpenMP places torch's runtime was given (vLLM's CPU
 * worker binds its threads there), else none. */
int64_t so_omp_places(int32_t *out, int64_t cap);

static void so_pool_default_cpus(void) {
    if (so_pool.cpus_set) return;
    so_pool.cpus_set = 1;
    int32_t found[SO_POOL_MAX];
    int64_t n = so_omp_places(found, SO_POOL_MAX);
    for (int64_t i = 0; i < n; i++) so_pool.cpus[i] = found[i];
    so_pool.ncpus = (int)n;
}

/* Pin the pool's workers to these cores from now on (n = 0: leave them unpinned as made:
 * the new workers inherit the creating thread's binding, those made keep theirs).
 * Returns the workers re-pinned. */
int64_t so_pool_set_cpus(const int32_t *cpus, int64_t n) {
    pthread_mutex_lock(&so_pool.lock);
    if (n < 0) n = 0;
    if (n > SO_POOL_MAX) n = SO_POOL_MAX;
    for (int64_t i = 0; i < n; i++) so_pool.cpus[i] = cpus[i];
    so_pool.ncpus = (int)n;
    so_pool.cpus_set = 1;
    int moved = 0;
    if (so_pool.pid == getpid())
        for (int w = 1; w <= so_pool.workers; w++, moved++) so_pin(w);
    pthread_mutex_unlock(&so_pool.lock);
    return moved;
}

/* The cores the workers are pinned to (up to cap), and how many there are. */
int64_t so_pool_cpus(int32_t *out, int64_t cap) {
    pthread_mutex_lock(&so_pool.lock);
    so_pool_default_cpus();
    int64_t n = so_pool.ncpus;
    for (int64_t i = 0; i < n && i < cap; i++) out[i] = so_pool.cpus[i];
    pthread_mutex_unlock(&so_pool.lock);
    return n;
}

/* Workers alive in this process. */
int64_t so_pool_workers(void) {
    pthread_mutex_lock(&so_pool.lock);
    int64_t n = so_pool.pid == getpid() ? so_pool.workers : 0;
    pthread_mutex_unlock(&so_pool.lock);
    return n;
}

/* The workers' kernel thread ids (up to cap; /proc/self/task/TID), and how many there are. */
int64_t so_pool_tids(int32_t *out, int64_t cap) {
    pthread_mutex_lock(&so_pool.lock);
    int64_t n = so_pool.pid == getpid() ? so_pool.workers : 0;
    for (int64_t i = 0; i < n && i < cap; i++) {
        int32_t t;
        while (!(t = __atomic_load_n(&so_pool.tid[i], __ATOMIC_ACQUIRE))) sched_yield();  /* just made */
        out[i] = t;
    }
    pthread_mutex_unlock(&so_pool.lock);
    return n;
}

/* Make workers up to `want` (caller holds the lock); 0, or the pthread error. */
static int so_pool_grow(int want) {
    if (so_pool.pid != getpid()) {
        so_pool.workers = 0;
        so_pool.pid = getpid();
    }
    so_pool_default_cpus();
    while (so_pool.workers < want) {
        int w = so_pool.workers + 1;
        so_pool.seen0[w - 1] = __atomic_load_n(&so_pool.gen, __ATOMIC_ACQUIRE);
        so_pool.tid[w - 1] = 0;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setstacksize(&attr, SO_POOL_STACK);
        int err = pthread_create(&so_pool.th[w - 1], &attr, so_worker, (void *)(intptr_t)w);
        pthread_attr_destroy(&attr);
        if (err) return err;
        so_pool.workers = w;
        char name[16];
        snprintf(name, sizeof(name), "so-pool-%d", w % 10000);
        pthread_setname_np(so_pool.th[w - 1], name);
        so_pin(w);
    }
    return 0;
}

/* Run fn on nt threads: this one as tid 0, workers as the others. 0, or nonzero when the
 * workers could not be made (fn then has not run at all). */
static __attribute__((unused)) int so_pool_run(int nt, so_task fn, void *arg) {
    if (nt <= 1) {
        fn(arg, 0, 1);
        return 0;
    }
    if (nt > SO_POOL_MAX) return EINVAL;
    pthread_mutex_lock(&so_pool.lock);
    int err = so_pool_grow(nt - 1);
    if (err) {
        pthread_mutex_unlock(&so_pool.lock);
        return err;
    }
    so_pool.fn = fn;
    so_pool.arg = arg;
    so_pool.nt = nt;
    so_pool.bar_count = 0;
    __atomic_store_n(&so_pool.acked, 0, __ATOMIC_RELAXED);
    __atomic_add_fetch(&so_pool.gen, 1, __ATOMIC_SEQ_CST);
    so_wake(&so_pool.gen);
    fn(arg, 0, nt);
    uint32_t acked;
    while ((acked = __atomic_load_n(&so_pool.acked, __ATOMIC_ACQUIRE)) != (uint32_t)so_pool.workers)
        so_wait_change(&so_pool.acked, acked);
    pthread_mutex_unlock(&so_pool.lock);
    return 0;
}

#if defined(SO_OPENMP)
/* The same jobs on the OpenMP runtime (a benchmark's comparison). */
static int so_par(int nt, so_task fn, void *arg) {
#pragma omp parallel num_threads(nt)
    fn(arg, omp_get_thread_num(), omp_get_num_threads());
    return 0;
}
#define SO_BARRIER(nt) _Pragma("omp barrier")
#else
#define so_par so_pool_run
#define SO_BARRIER(nt) so_barrier(nt)
#endif

/* Work item i of a dynamic loop: the next index of *next (every thread draws until the
 * items run out; a descheduled thread's share is taken by the others). */
static inline int64_t so_next(int64_t *next) { return __atomic_fetch_add(next, 1, __ATOMIC_RELAXED); }

/* Thread tid's share [*lo, *hi) of n items split evenly (a static loop). */
static inline void so_share(int64_t n, int tid, int nt, int64_t *lo, int64_t *hi) {
    *lo = n * tid / nt;
    *hi = n * (tid + 1) / nt;
}

int64_t so_omp_places(int32_t *out, int64_t cap) {
    int64_t n = 0;
    int places = omp_get_num_places();
    for (int p = 0; p < places; p++) {
        int k = omp_get_place_num_procs(p);
        if (k <= 0) continue;
        int ids[k];
        omp_get_place_proc_ids(p, ids);
        for (int i = 0; i < k; i++) {
            int dup = 0;
            for (int64_t j = 0; j < n; j++) dup |= out[j] == ids[i];
            if (!dup && n < cap) out[n++] = ids[i];
        }
    }
    return n;
}
