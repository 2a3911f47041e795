/* Capsules made in C for callers that hold the GIL: the consumer's hot path.
 *
 * cffi releases the GIL around every call and cannot return a PyObject*, so the capsule calls of
 * capsules.py went through ctypes one by one: a protocol call on imported data cost two struct
 * allocations, two ctypes PyCapsule_New calls and the rebuild, ~8 µs of which ~4 µs Python on the
 * GPU machine. The functions here do all of it in one call. cffi cannot hand Python a PyObject,
 * so capsules.py calls make_function once per function through ctypes (PYFUNCTYPE: the GIL stays
 * held) and gets builtin function objects back, which it then calls like any builtin. Everything
 * here runs with the GIL held and touches Python objects only through the limited API.
 *
 * What a rebuild needs besides the decode comes from the owner's view (aib_owner_set_view): the
 * region bases in this process and the device. The sync event is the owner's slot when set and the
 * producer's work behind it is still pending (sync_event.c). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <Python.h>

#include <stdlib.h>

#include "internal.h"

static PyObject *new_capsule(int kind, void *p) {
  return PyCapsule_New(p, aib_capsule_name(kind), (PyCapsule_Destructor)aib_capsule_destructor(kind));
}

/* (schema capsule, array or device array capsule) for batch 0 of the owner's decoded message.
 * None when the owner has no view or no decode, or the rebuild fails: the caller's Python path
 * then does the same work and reports why. NULL with an exception set when allocation fails. */
static PyObject *capsule_pair(aib_owner *owner, int device) {
  const aib_view *view = aib_owner_view(owner);
  const aib_decoded *decoded = aib_owner_decoded(owner);
  if (view == NULL || decoded == NULL) Py_RETURN_NONE;
  struct ArrowSchema *schema = aib_schema_alloc();
  void *array = device ? (void *)aib_device_array_alloc() : (void *)aib_array_alloc();
  if (schema == NULL || array == NULL) {
    free(schema);
    free(array);
    return PyErr_NoMemory();
  }
  /* The capsules first: from here on their destructors free the structs (and release whatever
   * was filled in), so no exit below can leak. */
  PyObject *schema_capsule = new_capsule(AIB_CAPSULE_SCHEMA, schema);
  if (schema_capsule == NULL) {
    free(schema);
    free(array);
    return NULL;
  }
  PyObject *array_capsule = new_capsule(device ? AIB_CAPSULE_DEVICE_ARRAY : AIB_CAPSULE_ARRAY, array);
  if (array_capsule == NULL) {
    Py_DECREF(schema_capsule);
    free(array);
    return NULL;
  }
  aib_error err;
  int rc;
  if (device) {
    uint64_t *slot = aib_owner_slot(owner);
    rc = aib_rebuild_device_array(decoded, 0, view->bases, view->n_bases, owner, view->device_type,
                                  view->device_id, aib_sync_event_if_pending(view->device_type, *slot != 0 ? (void *)slot : NULL),
                                  schema, array, &err);
  } else {
    rc = aib_rebuild_schema(decoded, schema, &err);
    if (rc == AIB_OK) rc = aib_rebuild_array(decoded, 0, view->bases, view->n_bases, owner, array, &err);
  }
  PyObject *pair = Py_None;
  if (rc == AIB_OK) {
    pair = PyTuple_Pack(2, schema_capsule, array_capsule);
  } else {
    Py_INCREF(pair);
  }
  Py_DECREF(schema_capsule);
  Py_DECREF(array_capsule);
  return pair;
}

/* The functions Python calls: builtin function objects made here (make_function), so a call costs
 * what calling len() costs, where a ctypes call costs ~1 µs. */
/* args: (message, owner address), where message is the arrow_ipc_bridge.metadata.Decoded whose
 * owner that is. Its `_closed` attribute is read here, in the same GIL-holding call that uses the
 * owner: Decoded.close() sets it before it drops the owner, so a message found open cannot lose
 * its owner before this call returns (no Python code runs in between). A Python-side check before
 * the call would leave a gap in which another thread could release it. self: the exception class
 * raised for a closed message (ReleasedError). */
static aib_owner *open_owner(PyObject *released_error, PyObject *args) {
  PyObject *message, *address;
  if (!PyArg_ParseTuple(args, "OO", &message, &address)) return NULL;
  PyObject *closed = PyObject_GetAttrString(message, "_closed");
  if (closed == NULL) return NULL;
  int is_closed = PyObject_IsTrue(closed);
  Py_DECREF(closed);
  if (is_closed < 0) return NULL;
  if (is_closed) {
    PyErr_SetString(released_error, "this imported data was released; get it again from the session to use it");
    return NULL;
  }
  void *p = PyLong_AsVoidPtr(address);
  if (p == NULL && !PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "owner address is 0");
  return p;
}

static PyObject *device_array_capsules(PyObject *self, PyObject *args) {
  aib_owner *owner = open_owner(self, args);
  return owner == NULL ? NULL : capsule_pair(owner, 1);
}

static PyObject *array_capsules(PyObject *self, PyObject *args) {
  aib_owner *owner = open_owner(self, args);
  return owner == NULL ? NULL : capsule_pair(owner, 0);
}

/* self is the capsule kind (AIB_CAPSULE_*): the address of the struct the capsule holds when it is a
 * capsule of that kind, else 0 (the caller explains what it got). */
static PyObject *capsule_address(PyObject *self, PyObject *capsule) {
  long kind = PyLong_AsLong(self);
  if (kind == -1 && PyErr_Occurred()) return NULL;
  const char *name = aib_capsule_name((int)kind);
  if (name == NULL || !PyCapsule_IsValid(capsule, name)) return PyLong_FromLong(0);
  return PyLong_FromVoidPtr(PyCapsule_GetPointer(capsule, name));
}

static PyMethodDef functions[] = {
    {"device_array_capsules", device_array_capsules, METH_VARARGS,
     "device_array_capsules(message, owner_address) -> (schema, device array) capsules of batch 0, or None"},
    {"array_capsules", array_capsules, METH_VARARGS,
     "array_capsules(message, owner_address) -> (schema, array) capsules of batch 0, or None"},
    {"capsule_address", capsule_address, METH_O,
     "capsule_address(capsule) -> address of the struct it holds, or 0 when it is not of this kind"},
};

/* Called once per function through ctypes (PYFUNCTYPE: the GIL is held): a new builtin function
 * object for functions[which], bound to bound_to (its `self`). */
static PyObject *make_function(int which, PyObject *bound_to) {
  if (which < 0 || which >= (int)(sizeof(functions) / sizeof(functions[0]))) {
    PyErr_SetString(PyExc_ValueError, "no such function");
    return NULL;
  }
  return PyCFunction_NewEx(&functions[which], bound_to, NULL);
}

uintptr_t aib_py_function_maker(void) { return (uintptr_t)&make_function; }
