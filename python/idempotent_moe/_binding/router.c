/*
 * router.c: the router of the C API (imoe_topk_softmax). As in moe.c, the
 * arguments are converted and imported here and judged by the C core.
 */
#include "binding.h"

static imoe_py_signature router_sig = {
    "topk_softmax",
    7,
    {"logits", "k", "renormalize", "out_weights", "out_indices", "num_threads", "stream"}};

IMOE_PY_FASTCALL(imoe_py_topk_softmax) {
  (void)self;
  enum { LOGITS, K, RENORM, WEIGHTS, INDICES, THREADS, STREAM, COUNT };
  PyObject *a[COUNT] = {NULL, NULL, Py_True, NULL, NULL, Py_None, Py_None};
  if (imoe_py_parse(&router_sig, args, nargs, kwnames, a) < 0) return NULL;
  int64_t k = 0;
  if (imoe_py_as_int64(a[K], "k", &k) < 0) return NULL;
  const int renormalize = PyObject_IsTrue(a[RENORM]);
  if (renormalize < 0) return NULL;
  imoe_py_call *c = imoe_py_call_new(a[STREAM], a[THREADS]);
  if (c == NULL) return NULL;
  PyObject *result = NULL;
  imoe_view logits, weights, indices;
  if (imoe_py_call_import_typed(c, a[LOGITS], "logits", 0, FLOAT_DTYPES, FLOAT_NAMES, &logits) < 0 ||
      imoe_py_call_import_typed(c, a[WEIGHTS], "out_weights", 1, FLOAT_DTYPES, FLOAT_NAMES,
                                &weights) < 0 ||
      imoe_py_call_import_typed(c, a[INDICES], "out_indices", 1, INDEX_DTYPES, INDEX_NAMES,
                                &indices) < 0 ||
      imoe_py_call_finish(c) < 0)
    goto done;
  IMOE_PY_CALL_C(c, result,
                 imoe_topk_softmax(&logits, k, renormalize, &weights, &indices, &c->exec, &c->err));
done:
  imoe_py_call_free(c);
  return result;
}
