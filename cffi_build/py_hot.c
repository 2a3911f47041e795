/* What the hot-path builtin over prepared Python state leans on (py_local_get.c, py_state.c): the
 * fork generation, the calls of a threading.Lock's bound methods, and making and installing their
 * types. Declared in py_hot.h. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <pthread.h>
#include <string.h>

#include "internal.h"
#include "py_hot.h"

/* Bumped in a forked child: a builtin's state made before the fork is its parent's (the locks may
 * have been held by parent threads, the leases are the parent's) and answers nothing there. */
static atomic_uint fork_generation;
static pthread_once_t fork_handler_once = PTHREAD_ONCE_INIT;
static void after_fork_in_child(void) { atomic_fetch_add(&fork_generation, 1); }
static void register_fork_handler(void) { pthread_atfork(NULL, NULL, after_fork_in_child); }

unsigned aib_py_fork_generation(void) {
  pthread_once(&fork_handler_once, register_fork_handler);
  return atomic_load(&fork_generation);
}

int aib_py_call_lock(PyObject *method) {
  PyObject *r = PyObject_CallNoArgs(method);
  if (r == NULL) return -1;
  Py_DECREF(r);
  return 0;
}

void aib_py_release_lock(PyObject *release) {
#if PY_VERSION_HEX >= 0x030C0000
  PyObject *pending = PyErr_GetRaisedException();
  if (aib_py_call_lock(release) < 0) PyErr_WriteUnraisable(release);
  PyErr_SetRaisedException(pending);
#else
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  if (aib_py_call_lock(release) < 0) PyErr_WriteUnraisable(release);
  PyErr_Restore(type, value, tb);
#endif
}

void aib_py_free_instance(PyObject *self) {
  PyTypeObject *type = Py_TYPE(self);
  freefunc free_self = (freefunc)PyType_GetSlot(type, Py_tp_free);
  free_self(self);
  Py_DECREF(type); /* instances of heap types hold a reference on their type */
}

int aib_py_install_type(const char *module_name, PyType_Spec *spec, PyObject *base, PyTypeObject **type_out) {
  PyGILState_STATE gil = PyGILState_Ensure();
  int rc = -1;
  PyObject *module = NULL, *type = NULL;
  module = PyImport_ImportModule(module_name);
  type = module != NULL ? PyType_FromSpecWithBases(spec, base) : NULL;
  if (type != NULL) {
    const char *dot = strrchr(spec->name, '.');
    rc = PyObject_SetAttrString(module, dot != NULL ? dot + 1 : spec->name, type);
  }
  if (rc == 0 && type_out != NULL) *type_out = (PyTypeObject *)Py_NewRef(type); /* held for good */
  if (rc < 0) PyErr_WriteUnraisable(NULL);
  Py_XDECREF(type);
  Py_XDECREF(module);
  PyGILState_Release(gil);
  return rc;
}
