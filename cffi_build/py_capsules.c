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
 * region bases in this process and the device. The sync event is the owner's slot when set. */
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
                                  view->device_id, *slot != 0 ? (void *)slot : NULL, schema, array, &err);
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
static aib_owner *owner_from(PyObject *address) {
  void *p = PyLong_AsVoidPtr(address);
  if (p == NULL && !PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "owner address is 0");
  return p;
}

static PyObject *device_array_capsules(PyObject *self, PyObject *address) {
  aib_owner *owner = owner_from(address);
  return owner == NULL ? NULL : capsule_pair(owner, 1);
}

static PyObject *array_capsules(PyObject *self, PyObject *address) {
  aib_owner *owner = owner_from(address);
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
    {"device_array_capsules", device_array_capsules, METH_O,
     "device_array_capsules(owner_address) -> (schema, device array) capsules of batch 0, or None"},
    {"array_capsules", array_capsules, METH_O,
     "array_capsules(owner_address) -> (schema, array) capsules of batch 0, or None"},
    {"capsule_address", capsule_address, METH_O,
     "capsule_address(capsule) -> address of the struct it holds, or 0 when it is not of this kind"},
};

/* Called once per function through ctypes (PYFUNCTYPE: the GIL is held): a new builtin function
 * object for functions[which], bound to the integer bound_to (its `self`). */
static PyObject *make_function(int which, long bound_to) {
  if (which < 0 || which >= (int)(sizeof(functions) / sizeof(functions[0]))) {
    PyErr_SetString(PyExc_ValueError, "no such function");
    return NULL;
  }
  PyObject *self = PyLong_FromLong(bound_to);
  if (self == NULL) return NULL;
  PyObject *function = PyCFunction_NewEx(&functions[which], self, NULL);
  Py_DECREF(self);
  return function;
}

uintptr_t aib_py_function_maker(void) { return (uintptr_t)&make_function; }
