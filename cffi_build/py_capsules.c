/* Capsules made in C for callers that hold the GIL: the consumer's hot path.
 *
 * cffi releases the GIL around every call and cannot return a PyObject*, so the capsule calls of
 * capsules.py went through ctypes one by one: a protocol call on imported data cost two struct
 * allocations, two ctypes PyCapsule_New calls and the rebuild, ~8 µs of which ~4 µs Python on the
 * GPU machine. The functions here do all of it in one call. Python reaches them through ctypes
 * with PYFUNCTYPE (the GIL stays held; capsules.py takes their addresses from
 * aib_py_capsules_function), and they touch Python objects only through the limited API.
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

static PyObject *device_array_capsules(aib_owner *owner) { return capsule_pair(owner, 1); }
static PyObject *array_capsules(aib_owner *owner) { return capsule_pair(owner, 0); }

/* The struct a capsule named for kind holds, or 0 when it is not such a capsule (the caller
 * explains what it got). Consumers renaming a capsule they emptied do so after this. */
static uintptr_t capsule_address(PyObject *capsule, int kind) {
  const char *name = aib_capsule_name(kind);
  if (name == NULL || !PyCapsule_IsValid(capsule, name)) return 0;
  return (uintptr_t)PyCapsule_GetPointer(capsule, name);
}

uintptr_t aib_py_capsules_function(int which) {
  switch (which) {
    case AIB_PY_DEVICE_ARRAY_CAPSULES: return (uintptr_t)&device_array_capsules;
    case AIB_PY_ARRAY_CAPSULES: return (uintptr_t)&array_capsules;
    case AIB_PY_CAPSULE_ADDRESS: return (uintptr_t)&capsule_address;
    default: return 0;
  }
}
