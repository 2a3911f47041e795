/* What the hot-path builtin over prepared Python state leans on (py_local_get.c,
 * py_state.c), defined in py_hot.c. Needs <Python.h> first. Not part of the cffi surface. */
#ifndef AIB_PY_HOT_H
#define AIB_PY_HOT_H

/* A number that changes in a forked child: state a builtin made before the fork belongs to the
 * parent (its locks may have been held by parent threads) and must answer nothing there. */
unsigned aib_py_fork_generation(void);

/* Calls a threading.Lock's bound acquire or release; 0, or -1 with a Python exception set. A
 * contended acquire releases the GIL while it waits, as in Python. */
int aib_py_call_lock(PyObject *method);

/* Calls a lock's bound release keeping any pending exception (releasing a lock we hold cannot fail;
 * if it did, it is reported as unraisable). */
void aib_py_release_lock(PyObject *release);

/* The end of a dealloc of a heap type's instance: tp_free, then the instance's reference on its type. */
void aib_py_free_instance(PyObject *self);

/* Makes the type of spec (base: its base type, or NULL for object) and sets it on the module
 * module_name under the last part of spec's name; with type_out, a reference to it is kept there for
 * good. 0, or -1 after reporting the error as unraisable. Takes the GIL (called from Python through
 * cffi, which released it). */
int aib_py_install_type(const char *module_name, PyType_Spec *spec, PyObject *base, PyTypeObject **type_out);

#endif
