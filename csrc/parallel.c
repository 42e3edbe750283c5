/* parallel.c: runs the data checks and the writes of one call as stages of
 * a single OpenMP region. */
#include <stdlib.h>

#include "imoe_internal.h"

#ifdef _OPENMP
#include <omp.h>
#endif

/* Below this much memory traffic a parallel region costs more than it
 * saves (fork/join is a few microseconds). */
#define IMOE_PARALLEL_MIN_BYTES ((int64_t)256 * 1024)

int imoe_thread_count(const imoe_exec *exec, int64_t work_bytes, int64_t max_items) {
  int64_t threads = 1;
#ifdef _OPENMP
  if (exec != NULL && exec->num_threads > 0) {
    threads = exec->num_threads;
  } else if (work_bytes >= IMOE_PARALLEL_MIN_BYTES) {
    threads = omp_get_max_threads();
  }
#else
  (void)exec;
  (void)work_bytes;
#endif
  if (threads > max_items) threads = max_items;
  return threads < 1 ? 1 : (int)threads;
}

typedef struct first_failure {
  int64_t item; /* lowest failing item of the current stage, or INT64_MAX */
  imoe_status status;
  imoe_error error;
} first_failure;

static void record_failure(first_failure *f, int64_t item, imoe_status status,
                           const imoe_error *error) {
  IMOE_OMP(critical(imoe_first_failure)) {
    if (item < f->item) {
      f->item = item;
      f->status = status;
      f->error = *error;
    }
  }
}

static void run_stage(const imoe_stage *stage, unsigned char *workspace, first_failure *f) {
  /* guided: large chunks first keeps scheduling cheap for many short rows,
   * small chunks last balance rows of uneven work. */
  IMOE_OMP(for schedule(guided))
  for (int64_t item = 0; item < stage->items; item++) {
    imoe_error error;
    const imoe_status st = stage->fn(stage->ctx, item, workspace, &error);
    if (st != IMOE_OK) record_failure(f, item, st, &error);
  }
}

imoe_status imoe_run_stages(const imoe_stage *stages, int num_stages, size_t workspace_bytes,
                            int num_threads, imoe_error *err) {
  first_failure failure = {INT64_MAX, IMOE_OK, {{0}}};
  int alloc_failed = 0, any_items = 0;
  (void)num_threads;
  /* Empty work (R = 0) allocates nothing, however large N is. */
  for (int s = 0; s < num_stages; s++) any_items |= stages[s].items > 0;
  if (!any_items) return IMOE_OK;

  IMOE_OMP(parallel num_threads(num_threads) if (num_threads > 1)) {
    /* Every thread allocates before any stage starts, so running out of
     * memory is reported before a single byte is written. Zeroed, because
     * check stages use it as a seen-bitmap (and leave it zeroed). */
    unsigned char *workspace = NULL;
    if (workspace_bytes > 0) {
      workspace = calloc(1, workspace_bytes);
      if (workspace == NULL) {
        IMOE_OMP(atomic write)
        alloc_failed = 1;
      }
    }
    IMOE_OMP(barrier)
    int stop;
    IMOE_OMP(atomic read)
    stop = alloc_failed;
    for (int s = 0; s < num_stages && !stop; s++) {
      run_stage(&stages[s], workspace, &failure);
      /* The loop's implicit barrier has passed: every failure is recorded.
       * The explicit one keeps a fast thread from recording a failure of
       * the next stage before a slow one has read this stage's outcome. */
      IMOE_OMP(critical(imoe_first_failure))
      stop = failure.item != INT64_MAX;
      IMOE_OMP(barrier)
    }
    free(workspace);
  }

  if (alloc_failed) {
    return imoe_fail(err, IMOE_ERR_NO_MEMORY, "could not allocate %zu bytes of workspace",
                     workspace_bytes);
  }
  if (failure.item != INT64_MAX) {
    if (err != NULL) *err = failure.error;
    return failure.status;
  }
  return IMOE_OK;
}
