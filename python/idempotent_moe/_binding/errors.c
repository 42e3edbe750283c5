/*
 * errors.c: failures to Python exceptions.
 */
#include "binding.h"

#include <string.h>

PyObject *imoe_py_raise_status(imoe_status status, const imoe_error *err) {
  PyObject *type;
  switch (status) {
    case IMOE_ERR_DTYPE: type = PyExc_TypeError; break;
    case IMOE_ERR_NO_MEMORY: type = PyExc_MemoryError; break;
    case IMOE_ERR_DEVICE: type = PyExc_RuntimeError; break;
    default: type = PyExc_ValueError; break; /* UNSUPPORTED and every bad value */
  }
  char message[sizeof err->message];
  memcpy(message, err->message, sizeof message);
  message[sizeof message - 1] = '\0';
  if (message[0] == '\0') {
    const char *fallback = imoe_status_string(status);
    PyErr_SetString(type, fallback ? fallback : "idempotent_moe: unknown error");
  } else {
    PyErr_SetString(type, message);
  }
  return NULL;
}

PyObject *imoe_py_reraise_as(PyObject *type, const char *name, const char *what) {
#if PY_VERSION_HEX >= 0x030C0000
  PyObject *cause = PyErr_GetRaisedException();
#else
  PyObject *cause_type, *cause, *cause_traceback;
  PyErr_Fetch(&cause_type, &cause, &cause_traceback);
  PyErr_NormalizeException(&cause_type, &cause, &cause_traceback);
  if (cause != NULL && cause_traceback != NULL) PyException_SetTraceback(cause, cause_traceback);
  Py_XDECREF(cause_type);
  Py_XDECREF(cause_traceback);
#endif
  if (cause == NULL) {
    PyErr_Format(type, "%s %s", name, what);
    return NULL;
  }
  /* The cause's first line: a producer's message may carry a C++ stack trace. */
  PyObject *full = PyObject_Str(cause), *text = NULL;
  if (full != NULL) {
    Py_ssize_t end = PyUnicode_FindChar(full, '\n', 0, PyUnicode_GET_LENGTH(full), 1);
    text = end < 0 ? (Py_INCREF(full), full) : PyUnicode_Substring(full, 0, end);
    Py_DECREF(full);
  }
  if (text == NULL) {
    PyErr_Clear();
    PyErr_Format(type, "%s %s", name, what);
  } else {
    PyErr_Format(type, "%s %s: %U", name, what, text);
    Py_DECREF(text);
  }

#if PY_VERSION_HEX >= 0x030C0000
  PyObject *raised = PyErr_GetRaisedException();
  PyException_SetCause(raised, cause); /* steals cause */
  PyErr_SetRaisedException(raised);
#else
  PyObject *raised_type, *raised, *raised_traceback;
  PyErr_Fetch(&raised_type, &raised, &raised_traceback);
  PyErr_NormalizeException(&raised_type, &raised, &raised_traceback);
  PyException_SetCause(raised, cause); /* steals cause */
  PyErr_Restore(raised_type, raised, raised_traceback);
#endif
  return NULL;
}

/* A C API status as the binding's result: None, or the exception set
 * (IMOE_ERR_UNSUPPORTED: NotImplementedError). */
PyObject *imoe_py_done(imoe_status status, const imoe_error *err) {
  if (status == IMOE_ERR_UNSUPPORTED) {
    /* What this build or device does not do (e.g. grouping more than 1024
     * experts on CUDA). */
    PyErr_SetString(PyExc_NotImplementedError,
                    err->message[0] ? err->message : imoe_status_string(status));
    return NULL;
  }
  if (status != IMOE_OK) return imoe_py_raise_status(status, err);
  Py_RETURN_NONE;
}
