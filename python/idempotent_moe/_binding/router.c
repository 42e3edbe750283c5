/*
 * router.c: the router of the C API (imoe_topk_softmax). As in moe.c, the
 * arguments are converted and imported here and judged by the C core; the
 * outputs not given are made by `new` once the core has judged the logits
 * and k. Returns (weights, indices).
 */
#include "binding.h"

static imoe_py_signature router_sig = {
    "topk_softmax",
    10,
    {"logits", "k", "renormalize", "out_weights", "out_indices", "out_dtype", "index_dtype", "new",
     "num_threads", "stream"}};

IMOE_PY_FASTCALL(imoe_py_topk_softmax) {
  (void)self;
  enum { LOGITS, K, RENORM, WEIGHTS, INDICES, DTYPE, INDEX_DTYPE, NEW, THREADS, STREAM, COUNT };
  PyObject *a[COUNT] = {NULL, NULL, Py_True, Py_None, Py_None, Py_None, Py_None, Py_None, Py_None, Py_None};
  if (imoe_py_parse(&router_sig, args, nargs, kwnames, a) < 0) return NULL;
  int64_t k = 0;
  const char *dtype, *index_dtype;
  if (imoe_py_as_int64(a[K], "k", &k) < 0 ||
      imoe_py_as_dtype(a[DTYPE], IMOE_OPTION_FLOAT, "out_dtype", &dtype) < 0 ||
      imoe_py_as_dtype(a[INDEX_DTYPE], IMOE_OPTION_INDEX, "index_dtype", &index_dtype) < 0)
    return NULL;
  const int renormalize = PyObject_IsTrue(a[RENORM]);
  if (renormalize < 0) return NULL;
  if ((a[WEIGHTS] == Py_None && imoe_py_check_new_output(a[NEW], "topk_softmax", "out_weights") < 0) ||
      (a[INDICES] == Py_None && imoe_py_check_new_output(a[NEW], "topk_softmax", "out_indices") < 0))
    return NULL;
  imoe_py_call *c = imoe_py_call_new(a[STREAM], a[THREADS]);
  if (c == NULL) return NULL;
  PyObject *result = NULL, *weights = imoe_py_given(a[WEIGHTS]), *indices = imoe_py_given(a[INDICES]);
  imoe_view logits, wv, iv;
  if (imoe_py_call_import_typed(c, a[LOGITS], "logits", 0, FLOAT_DTYPES, FLOAT_NAMES, &logits) < 0)
    goto done;
  if (weights == NULL || indices == NULL) {
    int64_t shape[2];
    c->err.message[0] = '\0';
    if (imoe_py_judged(c, imoe_topk_softmax_shape(&logits, k, shape, &c->err)) < 0) goto done;
    if (weights == NULL &&
        (weights = imoe_py_call_new_array(c, a[NEW], a[LOGITS], shape, 2, dtype ? dtype : "float32")) == NULL)
      goto done;
    if (indices == NULL &&
        (indices = imoe_py_call_new_array(c, a[NEW], a[LOGITS], shape, 2,
                                          index_dtype ? index_dtype : "int64")) == NULL)
      goto done;
  }
  if (imoe_py_call_import_typed(c, weights, "out_weights", 1, FLOAT_DTYPES, FLOAT_NAMES, &wv) < 0 ||
      imoe_py_call_import_typed(c, indices, "out_indices", 1, INDEX_DTYPES, INDEX_NAMES, &iv) < 0 ||
      imoe_py_check_out_dtype(&wv, "out_weights", IMOE_OPTION_FLOAT, dtype, "out_dtype") < 0 ||
      imoe_py_check_out_dtype(&iv, "out_indices", IMOE_OPTION_INDEX, index_dtype, "index_dtype") < 0 ||
      imoe_py_call_finish(c) < 0)
    goto done;
  IMOE_PY_CALL_C(c, result, imoe_topk_softmax(&logits, k, renormalize, &wv, &iv, &c->exec, &c->err));
  if (result != NULL) {
    Py_DECREF(result);
    result = PyTuple_Pack(2, weights, indices);
  }
done:
  imoe_py_call_free(c);
  Py_XDECREF(weights);
  Py_XDECREF(indices);
  return result;
}
