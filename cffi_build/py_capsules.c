/* Every PyCapsule of the core: made, read and destroyed here, and nowhere else.
 *
 * cffi cannot pass a PyObject*, so what takes or returns Python objects is written here against the
 * limited API and handed to Python as builtin function objects: aib_py_install (the one call Python
 * makes, from arrow_ipc_bridge/_ffi.py at import) puts them on a module as attributes. After that a
 * call costs what calling len() costs (no ctypes argument conversion, no capsule round trip through
 * ctypes.pythonapi on the consumer's hot path). Everything here runs with the GIL held: the
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
#define PY_SSIZE_T_CLEAN /* Py_ssize_t lengths for the "#" formats */
#include <Python.h>
#include <structmember.h> /* PyMemberDef's types (T_ULONGLONG, READONLY) */

#include <stddef.h>
#include <stdlib.h>
#include <string.h>

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

static void destroy_dlpack_versioned_capsule(PyObject *capsule) {
  /* A consumer that took the tensor renamed the capsule "used_dltensor_versioned" and owns it now. */
  if (!PyCapsule_IsValid(capsule, "dltensor_versioned")) return;
  DLManagedTensorVersioned *t = PyCapsule_GetPointer(capsule, "dltensor_versioned");
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
 * what calling len() costs, without ctypes' conversion of every argument. */
/* arg: an owner's address. The caller holds the owner alive for the call (Python borrows the
 * decoded message around it: Decoded.borrow), so nothing here reads a Python object's state. */
static aib_owner *owner_at(PyObject *address) {
  void *p = PyLong_AsVoidPtr(address);
  if (p == NULL && !PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "owner address is 0");
  return p;
}

static PyObject *device_array_capsules(PyObject *self, PyObject *address) {
  (void)self;
  aib_owner *owner = owner_at(address);
  return owner == NULL ? NULL : capsule_pair(owner, 1);
}

static PyObject *array_capsules(PyObject *self, PyObject *address) {
  (void)self;
  aib_owner *owner = owner_at(address);
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

/* ---------- columns as plain arrays (arrow_ipc_bridge/arrays/columns.py) --------------------------------
 * A DLPack capsule over one column, in either ABI: versioned ("dltensor_versioned", DLPack 1.x, with
 * the read-only flag when asked) or legacy ("dltensor"). The tensor holds a reference on owner; when
 * the capsule cannot be made the tensor is deleted again here. */
static PyObject *column_capsule(aib_owner *owner, uint64_t data, int32_t device_type, int32_t device_id, int numeric,
                                int64_t length, int versioned, int read_only) {
  uint8_t code, bits;
  if (!aib_numeric_dlpack_type(numeric, &code, &bits)) {
    PyErr_SetString(PyExc_ValueError, "no such numeric type");
    return NULL;
  }
  if (versioned) {
    DLManagedTensorVersioned *t = aib_dlpack_versioned_new(owner, data, device_type, device_id, code, bits, length,
                                                           read_only ? AIB_DLPACK_FLAG_READ_ONLY : 0);
    if (t == NULL) return PyErr_NoMemory();
    PyObject *capsule = PyCapsule_New(t, "dltensor_versioned", destroy_dlpack_versioned_capsule);
    if (capsule == NULL) t->deleter(t);
    return capsule;
  }
  DLManagedTensor *t = aib_dlpack_new(owner, data, device_type, device_id, code, bits, length);
  if (t == NULL) return PyErr_NoMemory();
  PyObject *capsule = PyCapsule_New(t, "dltensor", destroy_dlpack_capsule);
  if (capsule == NULL) t->deleter(t);
  return capsule;
}

/* DLPackColumn: one column as DLPack consumers see it (`__dlpack__`, `__dlpack_device__`), made by
 * batch_columns and wrapped by columns.ColumnView. Everything a capsule needs is kept here, so
 * `__dlpack__` is this one call. It holds a reference on the imported message's owner. */
typedef struct dlpack_column {
  PyObject_HEAD
  aib_owner *owner;
  uint64_t data;
  int64_t length;
  int32_t device_type; /* DLPack's numbering, which is Arrow's for CPU (1) and CUDA (2) */
  int32_t device_id;
  int numeric;
  int read_only;       /* host data: our mappings are read-only */
  uint64_t *sync_slot; /* the owner's slot holding the producer's CUevent; NULL: nothing to wait for */
  PyObject *waiter;    /* waiter(stream, event): makes a CUDA stream wait for the event; NULL for host */
  PyObject *device;    /* the (device type, device id) tuple __dlpack_device__ returns */
} dlpack_column;

static PyObject *dlpack_column_type; /* made by install */

static void dlpack_column_dealloc(PyObject *self) {
  dlpack_column *c = (dlpack_column *)self;
  PyTypeObject *type = Py_TYPE(self);
  Py_XDECREF(c->waiter);
  Py_XDECREF(c->device);
  aib_owner *owner = c->owner;
  freefunc tp_free = (freefunc)PyType_GetSlot(type, Py_tp_free);
  tp_free(self);
  Py_DECREF(type); /* instances of heap types hold a reference on their type */
  if (owner != NULL) aib_owner_unref(owner);
}

/* The keyword names, interned once by install: kwnames of a vectorcall are interned strings, so
 * the usual match is a pointer comparison. */
static PyObject *dlpack_keywords[4];
static const char *const dlpack_keyword_names[4] = {"stream", "max_version", "dl_device", "copy"};

/* __dlpack__(*, stream=None, max_version=None, dl_device=None, copy=None), as the Python array API
 * standard has it: max_version (1, 0) or higher gives the versioned capsule, None or lower the
 * legacy one; dl_device must be where the data is and copy must not be True (BufferError: we never
 * copy); for CUDA data, stream (None: the legacy default stream; -1: no synchronisation) waits for
 * the producer's event while it is pending. Host data ignores stream.
 * METH_FASTCALL | METH_KEYWORDS with the keywords matched by hand: PyArg_ParseTupleAndKeywords
 * parses its format and builds an argument tuple on every call, and every np.from_dlpack comes here. */
static PyObject *dlpack_column_dlpack(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
  PyObject *given[4] = {Py_None, Py_None, Py_None, Py_None};
  if (nargs != 0) {
    PyErr_SetString(PyExc_TypeError, "__dlpack__() takes keyword arguments only");
    return NULL;
  }
  Py_ssize_t n_keywords = kwnames == NULL ? 0 : PyTuple_Size(kwnames);
  for (Py_ssize_t i = 0; i < n_keywords; i++) {
    PyObject *key = PyTuple_GetItem(kwnames, i);
    int found = -1;
    for (int k = 0; k < 4 && found < 0; k++)
      if (key == dlpack_keywords[k]) found = k;
    for (int k = 0; k < 4 && found < 0; k++)
      if (PyUnicode_CompareWithASCIIString(key, dlpack_keyword_names[k]) == 0) found = k;
    if (found < 0) {
      PyErr_Format(PyExc_TypeError, "__dlpack__() got an unexpected keyword argument %R", key);
      return NULL;
    }
    given[found] = args[i];
  }
  PyObject *stream = given[0], *max_version = given[1], *dl_device = given[2], *copy = given[3];
  dlpack_column *c = (dlpack_column *)self;
  if (c->owner == NULL) {
    PyErr_SetString(PyExc_BufferError, "this column holds no data");
    return NULL;
  }
  if (copy != Py_None) {
    int wants_copy = PyObject_IsTrue(copy);
    if (wants_copy < 0) return NULL;
    if (wants_copy) {
      PyErr_SetString(PyExc_BufferError, "column views share the imported memory and never copy (copy=True)");
      return NULL;
    }
  }
  if (dl_device != Py_None) {
    int same = PyObject_RichCompareBool(dl_device, c->device, Py_EQ);
    if (same < 0) return NULL;
    if (!same) {
      PyErr_Format(PyExc_BufferError, "the column lives on DLPack device %R, not %R, and is never copied", c->device,
                   dl_device);
      return NULL;
    }
  }
  int versioned = 0;
  if (max_version != Py_None) {
    PyObject *major = PySequence_Check(max_version) ? PySequence_GetItem(max_version, 0) : NULL;
    long value = major != NULL ? PyLong_AsLong(major) : -1;
    Py_XDECREF(major);
    if (value == -1 && PyErr_Occurred()) return NULL;
    if (major == NULL) {
      PyErr_SetString(PyExc_TypeError, "max_version must be a (major, minor) tuple or None");
      return NULL;
    }
    versioned = value >= AIB_DLPACK_MAJOR;
  }
  /* Once the driver said the event completed it stays so (it is not recorded again while a lease on
   * this data lives: lifetime.md, Synchronisation), so later calls skip the query. */
  if (c->sync_slot != NULL && aib_sync_event_if_pending(ARROW_DEVICE_CUDA, c->sync_slot) == NULL) c->sync_slot = NULL;
  if (c->sync_slot != NULL && c->waiter != NULL) {
    long wanted = stream == Py_None ? 1 : PyLong_AsLong(stream);
    if (wanted == -1 && PyErr_Occurred()) return NULL;
    if (wanted != -1) {
      /* None is the legacy default stream (CU_STREAM_LEGACY, 1), as the standard says */
      PyObject *done = PyObject_CallFunction(c->waiter, "lK", wanted, (unsigned long long)*c->sync_slot);
      if (done == NULL) return NULL;
      Py_DECREF(done);
    }
  }
  return column_capsule(c->owner, c->data, c->device_type, c->device_id, c->numeric, c->length, versioned,
                        c->read_only);
}

static PyObject *dlpack_column_device(PyObject *self, PyObject *unused) {
  dlpack_column *c = (dlpack_column *)self;
  if (c->device == NULL) {
    PyErr_SetString(PyExc_BufferError, "this column holds no data");
    return NULL;
  }
  Py_INCREF(c->device);
  return c->device;
}

static PyMethodDef dlpack_column_methods[] = {
    {"__dlpack__", (PyCFunction)(void (*)(void))dlpack_column_dlpack, METH_FASTCALL | METH_KEYWORDS,
     "__dlpack__(*, stream=None, max_version=None, dl_device=None, copy=None) -> a DLPack capsule "
     "(versioned for max_version >= (1, 0), else legacy)"},
    {"__dlpack_device__", dlpack_column_device, METH_NOARGS, "__dlpack_device__() -> (device type, device id)"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef dlpack_column_members[] = {
    {"address", T_ULONGLONG, offsetof(dlpack_column, data), READONLY, "the address of the first value (0: none)"},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot dlpack_column_slots[] = {
    {Py_tp_dealloc, dlpack_column_dealloc},
    {Py_tp_methods, dlpack_column_methods},
    {Py_tp_members, dlpack_column_members},
    {Py_tp_doc, "One column of imported data as DLPack consumers see it (made by the bridge only)."},
    {0, NULL},
};

static PyType_Spec dlpack_column_spec = {
    "arrow_ipc_bridge._ffi.DLPackColumn",
    sizeof(dlpack_column),
    0,
#ifdef Py_TPFLAGS_DISALLOW_INSTANTIATION
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION,
#else
    Py_TPFLAGS_DEFAULT,
#endif
    dlpack_column_slots,
};

static PyObject *new_dlpack_column(aib_owner *owner, const aib_column_fact *f, int32_t device_type, int32_t device_id,
                                   uint64_t *sync_slot, PyObject *waiter) {
  PyTypeObject *type = (PyTypeObject *)dlpack_column_type;
  allocfunc alloc = (allocfunc)PyType_GetSlot(type, Py_tp_alloc);
  dlpack_column *c = (dlpack_column *)alloc(type, 0); /* zeroed; holds a reference on type */
  if (c == NULL) return NULL;
  c->device = Py_BuildValue("(ii)", device_type, device_type == ARROW_DEVICE_CPU ? 0 : device_id);
  if (c->device == NULL) {
    Py_DECREF(c);
    return NULL;
  }
  c->owner = owner;
  aib_owner_ref(owner);
  c->data = f->data;
  c->length = f->length;
  c->device_type = device_type;
  c->device_id = device_type == ARROW_DEVICE_CPU ? 0 : device_id;
  c->numeric = f->numeric;
  c->read_only = device_type == ARROW_DEVICE_CPU;
  if (device_type == ARROW_DEVICE_CUDA && sync_slot != NULL && waiter != Py_None) {
    c->sync_slot = sync_slot;
    Py_INCREF(waiter);
    c->waiter = waiter;
  }
  return (PyObject *)c;
}

static void destroy_lease_capsule(PyObject *capsule) {
  aib_owner *owner = PyCapsule_GetPointer(capsule, "arrow_ipc_bridge.batch_lease");
  if (owner == NULL) PyErr_Clear();
  else aib_owner_unref(owner);
}

#define COLUMNS_AS_ADDRESSES 0
#define COLUMNS_AS_LEGACY_CAPSULES 1
#define COLUMNS_AS_DLPACK_COLUMNS 2

/* args: (owner address, bases address, n bases, device type, device id, sync slot address, batch,
 * form, select, waiter); the caller keeps the owner alive for the call (Python borrows the decoded
 * message around it). On a failed read: the reason, a str. select: None (every column), a
 * column index, or a name (the first column of that name): columns not selected are None.
 * The columns of batch `batch` of the owner's decode, in one call:
 *   (lease, event, ((name, numeric, length, null_count, item), ...), is_record_batch)
 * (a record batch's columns are its struct root's children; any other root is the one column).
 * lease: a capsule holding a reference on the owner (what an array library keeps as the memory's
 * owner); event: the producer's CUevent while it is pending, else 0 (stats counted as for structs);
 * numeric: the index of the column's type in the numeric table, -1 when it has none; null_count -1:
 * unknown, or the rows have nulls. item, by form: the address of the first value (0: none), a legacy
 * "dltensor" capsule, or a DLPackColumn (waiter(stream, event) makes a stream wait for the event);
 * for the last two None for columns that are not numeric or have nulls. */
static PyObject *batch_columns(PyObject *self, PyObject *args) {
  PyObject *address, *select, *waiter;
  unsigned long long bases_address, sync_address;
  Py_ssize_t n_bases;
  int device_type, form;
  long long device_id, batch;
  if (!PyArg_ParseTuple(args, "OKniLKLiOO", &address, &bases_address, &n_bases, &device_type, &device_id,
                        &sync_address, &batch, &form, &select, &waiter))
    return NULL;
  /* select: None (every column), an index, or a name (the first column of that name) */
  Py_ssize_t select_index = -1, select_len = 0;
  const char *select_name = NULL;
  if (PyUnicode_Check(select)) {
    select_name = PyUnicode_AsUTF8AndSize(select, &select_len);
    if (select_name == NULL) return NULL;
  } else if (select != Py_None) {
    select_index = PyLong_AsSsize_t(select);
    if (select_index == -1 && PyErr_Occurred()) return NULL;
    if (select_index < 0) select_index = PY_SSIZE_T_MAX; /* selects nothing */
  }
  (void)self;
  aib_owner *owner = owner_at(address);
  if (owner == NULL) return NULL;
  const aib_decoded *decoded = aib_owner_decoded(owner);
  if (decoded == NULL) {
    return PyUnicode_FromString("the imported data has no decoded message");
  }
  size_t capacity = aib_decoded_column_count(decoded), n = 0;
  aib_column_fact *facts = malloc((capacity ? capacity : 1) * sizeof(*facts));
  if (facts == NULL) return PyErr_NoMemory();
  aib_error err;
  int rc = aib_decoded_columns(decoded, batch, (const uint64_t *)(uintptr_t)bases_address, (size_t)n_bases, facts,
                               capacity, &n, &err);
  if (rc != AIB_OK) {
    free(facts);
    return PyUnicode_FromFormat("reading the columns of batch %lld failed: %s", batch, err.message);
  }
  uint64_t *slot = (uint64_t *)(uintptr_t)sync_address;
  uint64_t event = 0;
  if (slot != NULL && device_type == ARROW_DEVICE_CUDA && aib_sync_event_if_pending(device_type, slot) != NULL)
    event = *slot;
  int selected_by_name = 0;
  PyObject *result = NULL, *lease = NULL, *columns = PyTuple_New((Py_ssize_t)n);
  if (columns == NULL) goto done;
  for (size_t i = 0; i < n; i++) {
    const aib_column_fact *f = &facts[i];
    int wanted = select == Py_None || (Py_ssize_t)i == select_index;
    if (select_name != NULL && !selected_by_name)
      wanted = selected_by_name =
          f->name_len == (size_t)select_len && memcmp(f->name, select_name, (size_t)select_len) == 0;
    if (!wanted) { /* a view of one column needs nothing of the others */
      Py_INCREF(Py_None);
      PyTuple_SetItem(columns, (Py_ssize_t)i, Py_None);
      continue;
    }
    /* names come from another process: undecodable bytes become U+FFFD rather than an error */
    PyObject *name = PyUnicode_DecodeUTF8(f->name, (Py_ssize_t)f->name_len, "replace");
    if (name == NULL) goto done;
    int plain = f->numeric >= 0 && f->null_count == 0;
    PyObject *item;
    if (form == COLUMNS_AS_ADDRESSES)
      item = PyLong_FromUnsignedLongLong(f->data);
    else if (!plain)
      item = (Py_INCREF(Py_None), Py_None);
    else if (form == COLUMNS_AS_LEGACY_CAPSULES)
      item = column_capsule(owner, f->data, device_type, device_type == ARROW_DEVICE_CPU ? 0 : (int32_t)device_id,
                            f->numeric, f->length, 0, 0);
    else
      item = new_dlpack_column(owner, f, device_type, (int32_t)device_id, event ? slot : NULL, waiter);
    /* Built item by item: Py_BuildValue would parse its format string again for every column */
    PyObject *column = PyTuple_New(5);
    PyObject *numeric = PyLong_FromLong(f->numeric), *length = PyLong_FromLongLong(f->length);
    PyObject *null_count = PyLong_FromLongLong(f->null_count);
    if (column == NULL || item == NULL || numeric == NULL || length == NULL || null_count == NULL) {
      Py_XDECREF(column);
      Py_DECREF(name);
      Py_XDECREF(item);
      Py_XDECREF(numeric);
      Py_XDECREF(length);
      Py_XDECREF(null_count);
      goto done;
    }
    /* SetItem steals each reference */
    PyTuple_SetItem(column, 0, name);
    PyTuple_SetItem(column, 1, numeric);
    PyTuple_SetItem(column, 2, length);
    PyTuple_SetItem(column, 3, null_count);
    PyTuple_SetItem(column, 4, item);
    PyTuple_SetItem(columns, (Py_ssize_t)i, column);
  }
  lease = PyCapsule_New(owner, "arrow_ipc_bridge.batch_lease", destroy_lease_capsule);
  if (lease == NULL) goto done;
  aib_owner_ref(owner);
  result = Py_BuildValue("(OKOO)", lease, (unsigned long long)event, columns,
                         aib_decoded_is_record_batch(decoded) ? Py_True : Py_False);
done:
  free(facts);
  Py_XDECREF(lease);
  Py_XDECREF(columns);
  return result;
}

/* The functions installed, with what their `self` is bound to (see install). */
static PyMethodDef pair_functions[] = {
    {"device_array_capsules", device_array_capsules, METH_O,
     "device_array_capsules(owner_address) -> (schema, device array) capsules of batch 0, or None"},
    {"array_capsules", array_capsules, METH_O,
     "array_capsules(owner_address) -> (schema, array) capsules of batch 0, or None"},
};
static PyMethodDef batch_columns_function = {
    "batch_columns", batch_columns, METH_VARARGS,
    "batch_columns(owner, bases, n_bases, device_type, device_id, sync_slot, batch, form, select, waiter)"
    " -> (lease, event, ((name, numeric, length, null_count, item), ...), is_record_batch), or the reason"
    " the columns could not be read (a str)"};
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
  PyObject *module = NULL, *by_kind = NULL;
  module = PyImport_ImportModule(module_name);
  if (module == NULL) goto done;
  if (set_function(module, &batch_columns_function, NULL) < 0) goto done;
  for (int k = 0; k < 4; k++)
    if (dlpack_keywords[k] == NULL && (dlpack_keywords[k] = PyUnicode_InternFromString(dlpack_keyword_names[k])) == NULL)
      goto done;
  if (dlpack_column_type == NULL) {
    dlpack_column_type = PyType_FromSpec(&dlpack_column_spec);
    if (dlpack_column_type == NULL) goto done;
  }
  if (PyObject_SetAttrString(module, "DLPackColumn", dlpack_column_type) < 0) goto done;
  for (size_t i = 0; i < sizeof(pair_functions) / sizeof(pair_functions[0]); i++)
    if (set_function(module, &pair_functions[i], NULL) < 0) goto done;
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
  Py_XDECREF(module);
  return rc;
}

int aib_py_install(const char *module_name) {
  PyGILState_STATE gil = PyGILState_Ensure();
  int rc = install(module_name);
  PyGILState_Release(gil);
  return rc;
}
