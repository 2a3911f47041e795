/* Every PyCapsule of the core: made, read and destroyed here, and nowhere else.
 *
 * cffi cannot pass a PyObject*, so what takes or returns Python objects is written here against the
 * limited API and handed to Python as builtin function objects: aib_py_install (the one call Python
 * makes, from arrow_ipc_bridge/_ffi.py at import) puts them on a module as attributes. After that a
 * call costs what calling len() costs (a ctypes call cost ~1 us, a capsule round trip through
 * ctypes.pythonapi ~8 us on the consumer's hot path). Everything here runs with the GIL held: the
 * builtin functions are called from Python, the destructors by CPython when a capsule dies, and
 * aib_py_install takes the GIL itself (cffi releases it around its calls).
 *
 * The capsule destructors free the struct and release it only if it still holds data: a consumer
 * that moved the struct out renamed the capsule "used_<name>" and set release to NULL.
 *
 * What a pair rebuild needs besides the decode comes from the owner's view (aib_owner_set_view): the
 * region bases in this process and the device. The sync event is the owner's slot when set and the
 * producer's work behind it is still pending (sync_event.c). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <Python.h>

#include <stdlib.h>

#include "internal.h"

/* ---------- destructors --------------------------------------------------------------------------
 * The capsule may have been renamed "used_<name>" by a consumer that moved the struct out; the
 * pointer is looked up under whatever name it carries now. */
static void *capsule_pointer(PyObject *capsule) {
  const char *name = PyCapsule_GetName(capsule);
  void *p = PyCapsule_GetPointer(capsule, name);
  if (p == NULL) PyErr_Clear();
  return p;
}
static void destroy_schema_capsule(PyObject *c) { aib_schema_free(capsule_pointer(c)); }
static void destroy_array_capsule(PyObject *c) { aib_array_free(capsule_pointer(c)); }
static void destroy_device_array_capsule(PyObject *c) { aib_device_array_free(capsule_pointer(c)); }
static void destroy_stream_capsule(PyObject *c) { aib_stream_free(capsule_pointer(c)); }
static void destroy_device_stream_capsule(PyObject *c) { aib_device_stream_free(capsule_pointer(c)); }

static void destroy_dlpack_capsule(PyObject *capsule) {
  /* A consumer that took the tensor renamed the capsule "used_dltensor" and owns it now. */
  if (!PyCapsule_IsValid(capsule, "dltensor")) return;
  DLManagedTensor *t = PyCapsule_GetPointer(capsule, "dltensor");
  if (t != NULL && t->deleter != NULL) t->deleter(t);
}

const char *aib_capsule_name(int kind) {
  switch (kind) {
    case AIB_CAPSULE_SCHEMA: return "arrow_schema";
    case AIB_CAPSULE_ARRAY: return "arrow_array";
    case AIB_CAPSULE_DEVICE_ARRAY: return "arrow_device_array";
    case AIB_CAPSULE_STREAM: return "arrow_array_stream";
    case AIB_CAPSULE_DEVICE_STREAM: return "arrow_device_array_stream";
    default: return NULL;
  }
}

static PyCapsule_Destructor capsule_destructor(int kind) {
  switch (kind) {
    case AIB_CAPSULE_SCHEMA: return destroy_schema_capsule;
    case AIB_CAPSULE_ARRAY: return destroy_array_capsule;
    case AIB_CAPSULE_DEVICE_ARRAY: return destroy_device_array_capsule;
    case AIB_CAPSULE_STREAM: return destroy_stream_capsule;
    case AIB_CAPSULE_DEVICE_STREAM: return destroy_device_stream_capsule;
    default: return NULL;
  }
}

static void *struct_alloc(int kind) {
  switch (kind) {
    case AIB_CAPSULE_SCHEMA: return aib_schema_alloc();
    case AIB_CAPSULE_ARRAY: return aib_array_alloc();
    case AIB_CAPSULE_DEVICE_ARRAY: return aib_device_array_alloc();
    case AIB_CAPSULE_STREAM: return aib_stream_alloc();
    case AIB_CAPSULE_DEVICE_STREAM: return aib_device_stream_alloc();
    default: return NULL;
  }
}

static PyObject *new_capsule(int kind, void *p) {
  return PyCapsule_New(p, aib_capsule_name(kind), capsule_destructor(kind));
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

/* arg: a capsule kind (AIB_CAPSULE_*): (a capsule owning a fresh zeroed struct of that kind, the
 * struct's address). The capsule exists before anything is moved into the struct, so no error on the
 * way can leak: its destructor frees the struct and releases it only if it holds data. */
static PyObject *new_struct_capsule(PyObject *self, PyObject *arg) {
  long kind = PyLong_AsLong(arg);
  if (kind == -1 && PyErr_Occurred()) return NULL;
  if (aib_capsule_name((int)kind) == NULL) {
    PyErr_SetString(PyExc_ValueError, "no such capsule kind");
    return NULL;
  }
  void *p = struct_alloc((int)kind);
  if (p == NULL) return PyErr_NoMemory();
  PyObject *capsule = new_capsule((int)kind, p);
  if (capsule == NULL) {
    free(p);
    return NULL;
  }
  PyObject *address = PyLong_FromVoidPtr(p);
  if (address == NULL) {
    Py_DECREF(capsule); /* frees the struct */
    return NULL;
  }
  PyObject *pair = PyTuple_Pack(2, capsule, address);
  Py_DECREF(capsule);
  Py_DECREF(address);
  return pair;
}

/* arg: anything. The name a capsule carries (bytes; None for a nameless one), or None for an object
 * that is not a capsule: for error messages that say what the caller passed. */
static PyObject *capsule_name(PyObject *self, PyObject *arg) {
  if (!PyCapsule_CheckExact(arg)) Py_RETURN_NONE;
  const char *name = PyCapsule_GetName(arg);
  if (name == NULL) {
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
  }
  return PyBytes_FromString(name);
}

/* args: (owner address, data address, device type, device id, DLPack type code, bits, length). A
 * "dltensor" capsule over a new 1-D managed tensor that holds a reference on the owner; when the
 * capsule cannot be made, the tensor is deleted again here. */
static PyObject *dlpack_capsule(PyObject *self, PyObject *args) {
  PyObject *owner_address;
  unsigned long long data;
  int device_type, device_id, code, bits;
  long long length;
  if (!PyArg_ParseTuple(args, "OKiiiiL", &owner_address, &data, &device_type, &device_id, &code, &bits, &length))
    return NULL;
  aib_owner *owner = PyLong_AsVoidPtr(owner_address);
  if (owner == NULL) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "owner address is 0");
    return NULL;
  }
  DLManagedTensor *tensor = aib_dlpack_new(owner, data, device_type, device_id, (uint8_t)code, (uint8_t)bits, length);
  if (tensor == NULL) return PyErr_NoMemory();
  PyObject *capsule = PyCapsule_New(tensor, "dltensor", destroy_dlpack_capsule);
  if (capsule == NULL) tensor->deleter(tensor);
  return capsule;
}

/* The functions installed, with what their `self` is bound to (see install). */
static PyMethodDef pair_functions[] = {
    {"device_array_capsules", device_array_capsules, METH_VARARGS,
     "device_array_capsules(message, owner_address) -> (schema, device array) capsules of batch 0, or None"},
    {"array_capsules", array_capsules, METH_VARARGS,
     "array_capsules(message, owner_address) -> (schema, array) capsules of batch 0, or None"},
};
static PyMethodDef capsule_address_function = {
    "capsule_address", capsule_address, METH_O,
    "capsule_address(capsule) -> address of the struct it holds, or 0 when it is not of this kind"};
static PyMethodDef plain_functions[] = {
    {"new_struct_capsule", new_struct_capsule, METH_O,
     "new_struct_capsule(kind) -> (capsule owning a zeroed struct of kind, the struct's address)"},
    {"capsule_name", capsule_name, METH_O, "capsule_name(obj) -> the capsule's name (bytes), or None"},
    {"dlpack_capsule", dlpack_capsule, METH_VARARGS,
     "dlpack_capsule(owner, data, device_type, device_id, code, bits, length) -> a dltensor capsule"},
};

static int set_function(PyObject *module, PyMethodDef *def, PyObject *bound_to) {
  PyObject *f = PyCFunction_NewEx(def, bound_to, NULL);
  if (f == NULL) return -1;
  int rc = PyObject_SetAttrString(module, def->ml_name, f);
  Py_DECREF(f);
  return rc;
}

static int install(const char *module_name) {
  int rc = -1;
  PyObject *module = NULL, *errors = NULL, *released = NULL, *by_kind = NULL;
  module = PyImport_ImportModule(module_name);
  errors = module ? PyImport_ImportModule("arrow_ipc_bridge.errors") : NULL;
  released = errors ? PyObject_GetAttrString(errors, "ReleasedError") : NULL;
  if (released == NULL) goto done;
  /* The pair functions raise ReleasedError (their self) for a closed message. */
  for (size_t i = 0; i < sizeof(pair_functions) / sizeof(pair_functions[0]); i++)
    if (set_function(module, &pair_functions[i], released) < 0) goto done;
  for (size_t i = 0; i < sizeof(plain_functions) / sizeof(plain_functions[0]); i++)
    if (set_function(module, &plain_functions[i], NULL) < 0) goto done;
  /* capsule_address: a tuple indexed by AIB_CAPSULE_*, each function bound to its kind (METH_O: the
   * capsule is the only argument, the cheapest call there is). */
  by_kind = PyTuple_New(AIB_CAPSULE_DEVICE_STREAM + 1);
  if (by_kind == NULL) goto done;
  for (int kind = 0; kind <= AIB_CAPSULE_DEVICE_STREAM; kind++) {
    PyObject *k = PyLong_FromLong(kind);
    PyObject *f = k ? PyCFunction_NewEx(&capsule_address_function, k, NULL) : NULL;
    Py_XDECREF(k);
    if (f == NULL || PyTuple_SetItem(by_kind, kind, f) < 0) goto done; /* SetItem steals f */
  }
  rc = PyObject_SetAttrString(module, "capsule_address", by_kind);
done:
  if (rc < 0) PyErr_WriteUnraisable(NULL);
  Py_XDECREF(by_kind);
  Py_XDECREF(released);
  Py_XDECREF(errors);
  Py_XDECREF(module);
  return rc;
}

int aib_py_install(const char *module_name) {
  PyGILState_STATE gil = PyGILState_Ensure();
  int rc = install(module_name);
  PyGILState_Release(gil);
  return rc;
}
