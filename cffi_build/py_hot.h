/* What the hot-path builtins over prepared Python state share (py_local_get.c, py_in_place.c). Needs
 * <Python.h> first. Not part of the cffi surface. */
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

#endif
