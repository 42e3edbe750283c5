/* parallel.c: runs the data checks and the writes of one call as stages of
 * a single OpenMP region, in a way a busy core cannot stall
 * (docs/architecture.md, "Threads").
 *
 * A machine shared with other processes deschedules threads for a time
 * slice (milliseconds) at a time. Three rules keep such a thread from
 * holding up the call:
 *   - items are claimed in small chunks from an atomic counter, so a
 *     descheduled thread holds at most one chunk and the others take the
 *     rest; a thread that starts late finds nothing left and leaves;
 *   - a stage ends when its items are done, not when every thread has
 *     arrived;
 *   - a thread that waits spins briefly, then sleeps (a futex on Linux),
 *     so the core it leaves free can run the thread it waits for. OpenMP's
 *     own barriers spin for milliseconds before they sleep, so the region
 *     reaches its closing barrier only once every thread is done. */
#if defined(__linux__) && !defined(_GNU_SOURCE)
#define _GNU_SOURCE /* sched_getaffinity, syscall */
#endif

#include <limits.h>
#include <stdlib.h>

#include "imoe_internal.h"

#ifdef _OPENMP
#include <omp.h>
#include <stdatomic.h>
#include <time.h>
#if defined(__linux__)
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#include <sched.h>
#endif
#endif

/* Below this much memory traffic a parallel region costs more than it
 * saves (fork/join is a few microseconds). */
#define IMOE_PARALLEL_MIN_BYTES ((int64_t)256 * 1024)

/* Every call runs at most this many stages. */
#define IMOE_MAX_STAGES 4

/* Chunks per thread and stage: a descheduled thread holds at most about
 * 1 / (IMOE_CHUNKS_PER_THREAD x threads) of a stage. */
#define IMOE_CHUNKS_PER_THREAD 8

/* A waiting thread spins this long before it sleeps: long enough that an
 * unloaded machine never sleeps between stages, short beside a time slice. */
#define IMOE_SPIN_NS 30000

#if defined(_OPENMP) && defined(__linux__)
/* CPUs this process may run on now (taskset, cgroups' cpusets); 0 when
 * unknown. OpenMP reads the affinity once, when it loads. */
static int affinity_cpus(void) {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) != 0) return 0;
  return CPU_COUNT(&set);
}
#elif defined(_OPENMP)
static int affinity_cpus(void) { return 0; }
#endif

int imoe_thread_count(const imoe_exec *exec, int64_t work_bytes, int64_t max_items) {
  int64_t threads = 1;
#ifdef _OPENMP
  if (exec != NULL && exec->num_threads > 0) {
    threads = exec->num_threads;
  } else if (work_bytes >= IMOE_PARALLEL_MIN_BYTES) {
    threads = omp_get_max_threads();
    const int cpus = affinity_cpus();
    if (cpus > 0 && threads > cpus) threads = cpus;
  }
#else
  (void)exec;
  (void)work_bytes;
#endif
  if (threads > max_items) threads = max_items;
  return threads < 1 ? 1 : (int)threads;
}

typedef struct first_failure {
  int64_t item; /* lowest failing item of the failed stage, or INT64_MAX */
  imoe_status status;
  imoe_error error;
} first_failure;

#ifdef _OPENMP

/* What the threads of one run share. */
typedef struct team {
  const imoe_stage *stages;
  int num_stages;
  int64_t chunk[IMOE_MAX_STAGES];
  atomic_llong next[IMOE_MAX_STAGES]; /* first unclaimed item */
  atomic_llong done[IMOE_MAX_STAGES]; /* items finished */
  atomic_int failed;                  /* an item has failed: no later stage starts */
  atomic_llong finished;              /* threads that have left the stages */
  atomic_uint progress;               /* bumped on every event waiters wait for */
  atomic_int sleepers;
  first_failure failure;
} team;

static int64_t now_ns(void) {
  struct timespec ts;
  timespec_get(&ts, TIME_UTC);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

#if defined(__linux__)
/* The futex word is the atomic's own storage (same size and layout). */
static void sleep_while_equal(atomic_uint *word, unsigned seen) {
  syscall(SYS_futex, (unsigned *)word, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
}
static void wake_all(atomic_uint *word) {
  syscall(SYS_futex, (unsigned *)word, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}
#else
static void sleep_while_equal(atomic_uint *word, unsigned seen) {
  (void)word;
  (void)seen;
  sched_yield();
}
static void wake_all(atomic_uint *word) { (void)word; }
#endif

static void notify(team *t) {
  atomic_fetch_add(&t->progress, 1u);
  if (atomic_load(&t->sleepers) > 0) wake_all(&t->progress);
}

/* Returns once *counter >= target. A notifier raises the counter, then
 * bumps progress, then looks for sleepers; a sleeper registers, reads
 * progress, then looks at the counter: one of the two sees the other. */
static void wait_until(team *t, atomic_llong *counter, int64_t target) {
  const int64_t start = now_ns();
  for (int spins = 0; atomic_load(counter) < target; spins++) {
    if ((spins & 63) == 63 && now_ns() - start > IMOE_SPIN_NS) break;
    cpu_relax();
  }
  while (atomic_load(counter) < target) {
    atomic_fetch_add(&t->sleepers, 1);
    const unsigned seen = atomic_load(&t->progress);
    if (atomic_load(counter) < target) sleep_while_equal(&t->progress, seen);
    atomic_fetch_sub(&t->sleepers, 1);
  }
}

static void record_failure(team *t, int64_t item, imoe_status status, const imoe_error *error) {
  IMOE_OMP(critical(imoe_first_failure)) {
    if (item < t->failure.item) {
      t->failure.item = item;
      t->failure.status = status;
      t->failure.error = *error;
    }
  }
  atomic_store(&t->failed, 1);
}

/* One thread's part: claim chunks of each stage until none is left, wait
 * for the stage's last items (claimed by others), go on unless one failed.
 * A failure is recorded before its item counts as done, so every thread
 * that has seen a stage end sees its failures. */
static void run_thread(team *t, unsigned char *workspace) {
  for (int s = 0; s < t->num_stages && !atomic_load(&t->failed); s++) {
    const imoe_stage *stage = &t->stages[s];
    const int64_t items = stage->items, chunk = t->chunk[s];
    while (atomic_load(&t->next[s]) < items) {
      const int64_t lo = atomic_fetch_add(&t->next[s], chunk);
      if (lo >= items) break;
      const int64_t hi = items - lo < chunk ? items : lo + chunk;
      for (int64_t item = lo; item < hi; item++) {
        imoe_error error;
        const imoe_status st = stage->fn(stage->ctx, item, workspace, &error);
        if (st != IMOE_OK) record_failure(t, item, st, &error);
      }
      if (atomic_fetch_add(&t->done[s], hi - lo) + (hi - lo) == items) notify(t);
    }
    wait_until(t, &t->done[s], items);
  }
}

static void run_team(team *t, unsigned char *first_workspace, size_t workspace_bytes,
                     int num_threads) {
  IMOE_OMP(parallel num_threads(num_threads)) {
    const int me = omp_get_thread_num();
    /* A helper that cannot get its workspace leaves the work to the
     * others; the calling thread's was allocated before the region. */
    unsigned char *workspace = first_workspace;
    int can_work = 1;
    if (me != 0 && workspace_bytes > 0) {
      workspace = calloc(1, workspace_bytes);
      can_work = workspace != NULL;
    }
    if (can_work) run_thread(t, workspace);
    if (me != 0) free(workspace);
    atomic_fetch_add(&t->finished, 1);
    notify(t);
    /* The closing barrier spins; reach it only when everyone is there. */
    if (me == 0) wait_until(t, &t->finished, omp_get_num_threads());
  }
}

#endif /* _OPENMP */

/* The same stages on the calling thread alone. */
static void run_serial(const imoe_stage *stages, int num_stages, unsigned char *workspace,
                       first_failure *f) {
  for (int s = 0; s < num_stages; s++) {
    for (int64_t item = 0; item < stages[s].items; item++) {
      imoe_error error;
      const imoe_status st = stages[s].fn(stages[s].ctx, item, workspace, &error);
      if (st != IMOE_OK) { /* the first failure is the lowest */
        f->item = item;
        f->status = st;
        f->error = error;
        return;
      }
    }
  }
}

imoe_status imoe_run_stages(const imoe_stage *stages, int num_stages, size_t workspace_bytes,
                            int num_threads, imoe_error *err) {
  int any_items = 0;
  for (int s = 0; s < num_stages; s++) any_items |= stages[s].items > 0;
  /* Empty work (R = 0) allocates nothing, however large N is. */
  if (!any_items) return IMOE_OK;
  if (num_stages > IMOE_MAX_STAGES) {
    return imoe_fail(err, IMOE_ERR_ARGUMENT, "%d stages: at most %d", num_stages, IMOE_MAX_STAGES);
  }
  /* Zeroed, because check stages use it as a seen-bitmap (and leave it
   * zeroed). Allocated before any stage, so running out of memory is
   * reported before a single byte is written. */
  unsigned char *workspace = NULL;
  if (workspace_bytes > 0) {
    workspace = calloc(1, workspace_bytes);
    if (workspace == NULL) {
      return imoe_fail(err, IMOE_ERR_NO_MEMORY, "could not allocate %zu bytes of workspace",
                       workspace_bytes);
    }
  }

  first_failure failure = {INT64_MAX, IMOE_OK, {{0}}};
#ifdef _OPENMP
  if (num_threads > 1) {
    team t = {.stages = stages, .num_stages = num_stages, .failure = failure};
    for (int s = 0; s < num_stages; s++) {
      const int64_t per = stages[s].items / ((int64_t)num_threads * IMOE_CHUNKS_PER_THREAD);
      t.chunk[s] = per > 1 ? per : 1;
      atomic_init(&t.next[s], 0);
      atomic_init(&t.done[s], 0);
    }
    atomic_init(&t.failed, 0);
    atomic_init(&t.finished, 0);
    atomic_init(&t.progress, 0u);
    atomic_init(&t.sleepers, 0);
    run_team(&t, workspace, workspace_bytes, num_threads);
    failure = t.failure;
  } else {
    run_serial(stages, num_stages, workspace, &failure);
  }
#else
  (void)num_threads;
  run_serial(stages, num_stages, workspace, &failure);
#endif
  free(workspace);

  if (failure.item != INT64_MAX) {
    if (err != NULL) *err = failure.error;
    return failure.status;
  }
  return IMOE_OK;
}
