/*
 * parse.c: the named seam. Every function of the module takes its arguments
 * by keyword (METH_FASTCALL | METH_KEYWORDS), named as in the Python API,
 * and converts each Python value to its C type here. Conversion only: what
 * a value may be (ranges, shapes, options) is the C core's to judge, so an
 * option name goes through imoe_option_from_name and an int is passed on
 * as it is.
 */
#include "binding.h"

#include <string.h>

/* The names as interned strings, made once per signature: keywords that a
 * Python call site spells literally are interned too, so matching is a
 * pointer comparison. */
static int intern_names(imoe_py_signature *sig) {
  if (sig->interned[0] != NULL) return 0;
  for (int i = 0; i < sig->count; ++i) {
    PyObject *name = PyUnicode_InternFromString(sig->names[i]);
    if (name == NULL) return -1;
    sig->interned[i] = name; /* kept for the life of the process */
  }
  return 0;
}

static int find_name(const imoe_py_signature *sig, PyObject *key) {
  for (int i = 0; i < sig->count; ++i)
    if (sig->interned[i] == key) return i;
  for (int i = 0; i < sig->count; ++i) {
    int eq = PyUnicode_Compare(sig->interned[i], key);
    if (eq == 0) return i;
    if (eq == -1 && PyErr_Occurred()) PyErr_Clear();
  }
  return -1;
}

int imoe_py_parse(imoe_py_signature *sig, PyObject *const *args, Py_ssize_t nargs,
                  PyObject *kwnames, PyObject **out) {
  if (intern_names(sig) < 0) return -1;
  if (nargs > sig->count) {
    PyErr_Format(PyExc_TypeError, "%s() takes at most %d arguments (%zd given)", sig->fname,
                 sig->count, nargs);
    return -1;
  }
  for (Py_ssize_t i = 0; i < nargs; ++i) out[i] = args[i];
  Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
  for (Py_ssize_t k = 0; k < nkw; ++k) {
    PyObject *key = PyTuple_GET_ITEM(kwnames, k);
    int i = find_name(sig, key);
    if (i < 0) {
      PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument '%U'", sig->fname,
                   key);
      return -1;
    }
    if (i < nargs) {
      PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument '%s'", sig->fname,
                   sig->names[i]);
      return -1;
    }
    out[i] = args[nargs + k];
  }
  for (int i = 0; i < sig->count; ++i) {
    if (out[i] == NULL) {
      PyErr_Format(PyExc_TypeError, "%s() missing required argument '%s'", sig->fname,
                   sig->names[i]);
      return -1;
    }
  }
  return 0;
}

int imoe_py_as_int64(PyObject *obj, const char *name, int64_t *out) {
  /* An int, or what __index__ makes one (NumPy integers); never a float,
   * which would be truncated silently. */
  if (PyBool_Check(obj) || !PyIndex_Check(obj)) {
    PyErr_Format(PyExc_TypeError, "%s must be an int, got %.200s", name, Py_TYPE(obj)->tp_name);
    return -1;
  }
  PyObject *index = PyNumber_Index(obj);
  if (index == NULL) return -1;
  int overflow = 0;
  long long value = PyLong_AsLongLongAndOverflow(index, &overflow);
  Py_DECREF(index);
  if (value == -1 && PyErr_Occurred()) return -1;
  if (overflow != 0) {
    PyErr_Format(PyExc_ValueError, "%s = %S does not fit in 64 bits", name, obj);
    return -1;
  }
  *out = (int64_t)value;
  return 0;
}

int imoe_py_as_option(PyObject *obj, imoe_option option, const char *name, int *out) {
  if (!PyUnicode_Check(obj)) {
    PyErr_Format(PyExc_TypeError, "%s must be a str, got %.200s", name, Py_TYPE(obj)->tp_name);
    return -1;
  }
  const char *text = PyUnicode_AsUTF8(obj);
  if (text == NULL) return -1;
  imoe_error err = {{0}};
  imoe_status status = imoe_option_from_name(option, text, out, &err);
  if (status == IMOE_OK) return 0;
  imoe_py_raise_status(status, &err);
  return -1;
}

int imoe_py_as_dtype(PyObject *obj, imoe_option option, const char *name, const char **out) {
  *out = NULL;
  if (obj == Py_None) return 0;
  if (!PyUnicode_Check(obj)) {
    PyErr_Format(PyExc_TypeError, "%s must be a dtype or a dtype's name, got %.200s", name,
                 Py_TYPE(obj)->tp_name);
    return -1;
  }
  int value;
  if (imoe_py_as_option(obj, option, name, &value) < 0) return -1;
  *out = imoe_option_name(option, value);
  return 0;
}

PyObject *imoe_py_option_names(imoe_option option) {
  int count = 0;
  while (imoe_option_name(option, count) != NULL) ++count;
  PyObject *names = PyTuple_New(count);
  for (int i = 0; names != NULL && i < count; ++i) {
    PyObject *name = PyUnicode_FromString(imoe_option_name(option, i));
    if (name == NULL) {
      Py_DECREF(names);
      return NULL;
    }
    PyTuple_SET_ITEM(names, i, name);
  }
  return names;
}
