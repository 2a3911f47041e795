/* A publisher's in-place renewal as one builtin: the steady state of a step loop's producer.
 *
 * A producer that updates its from_cuda_arrays columns in place and publishes them again each step
 * gets its publication renewed (producer/publisher.py, Publisher._renew): the entry keeps its message, the
 * shared event is re-recorded on the legacy default stream, the version is bumped and held waits
 * are answered. In Python that cost a dozen frames around two C calls (the record, the renewal):
 * the publisher's checks, record_in_place, the shared event's and the event's methods, the version
 * and the counters. A producer that slept through its kernels runs them on cold caches. Here the
 * same work is one builtin call, over what the publication prepared once when it was first renewed
 * in Python (exporter.record_in_place sets Exported._in_place_c).
 *
 * It renews only what Python would renew the same way, and only when the columns announced the
 * legacy default stream or none (the record needs no wait on a producer's event). Anything else (a
 * closed publisher, another process, another object, other columns, an unprepared publication, a
 * record the driver refused) returns None having changed nothing the Python path would not redo,
 * and Publisher.publish takes the Python path, which raises the documented errors. The publisher's
 * lock is taken through its bound methods, as Python takes it; the event record (a few driver calls,
 * never blocking) runs with the GIL held. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h> /* T_ULONGLONG, READONLY */

#include "internal.h"
#include "py_hot.h"

enum { K_PREPARED, K_SIGNATURE, K_CLOSED, N_KEYS };
static const char *const key_names[N_KEYS] = {"_in_place_c", "column_signature", "_closed"};
static PyObject *keys[N_KEYS];

/* Exported._in_place_c: (column signature, the shared event's Event, the primary context, the
 * CUevent, the event's IPC handle, the CUevent a same-process consumer uses, the export's stats) */
enum { P_SIGNATURE, P_EVENT, P_CONTEXT, P_CUEVENT, P_HANDLE, P_LOCAL_EVENT, P_STATS, N_PREPARED };

typedef struct {
  PyObject_HEAD
  aib_pubtable *table;
  unsigned generation;
  int closed;
  unsigned long long renewals; /* renewals made here */
  PyObject *keep_alive;        /* what keeps table valid */
  PyObject *acquire, *release; /* the publisher's lock */
  PyObject *current;           /* Publisher._current: name -> Exported */
  PyObject *columns_type;      /* device._CudaColumns */
  PyObject *published, *deliver; /* Publisher._watch's */
  PyObject *remember_local_event; /* cuda.placer.remember_local_event */
  PyObject *counter;           /* process_stats.in_place_publishes */
} in_place_renewer;

static void renewer_dealloc(PyObject *self) {
  in_place_renewer *r = (in_place_renewer *)self;
  Py_XDECREF(r->keep_alive);
  Py_XDECREF(r->acquire);
  Py_XDECREF(r->release);
  Py_XDECREF(r->current);
  Py_XDECREF(r->columns_type);
  Py_XDECREF(r->published);
  Py_XDECREF(r->deliver);
  Py_XDECREF(r->remember_local_event);
  Py_XDECREF(r->counter);
  aib_py_free_instance(self);
}

/* The prepared tuple of the publication `current` when obj (exactly from_cuda_arrays columns)
 * renews it in place: a new reference, NULL for "not here" (no exception) or on an error (set). */
static PyObject *prepared_for(PyObject *current, PyObject *obj) {
  PyObject *prepared = PyObject_GetAttr(current, keys[K_PREPARED]);
  if (prepared == NULL || !PyTuple_Check(prepared) || PyTuple_GET_SIZE(prepared) != N_PREPARED) {
    Py_XDECREF(prepared);
    return NULL;
  }
  PyObject *event_closed = PyObject_GetAttr(PyTuple_GET_ITEM(prepared, P_EVENT), keys[K_CLOSED]);
  PyObject *current_closed = event_closed == Py_False ? PyObject_GetAttr(current, keys[K_CLOSED]) : NULL;
  PyObject *signature = current_closed == Py_False ? PyObject_GetAttr(obj, keys[K_SIGNATURE]) : NULL;
  int same = signature != NULL ? PyObject_RichCompareBool(signature, PyTuple_GET_ITEM(prepared, P_SIGNATURE), Py_EQ) : 0;
  Py_XDECREF(signature);
  Py_XDECREF(current_closed);
  Py_XDECREF(event_closed);
  if (same != 1) Py_CLEAR(prepared);
  return prepared;
}

/* Records the shared event after the new version (no wait: the columns' streams need none) and
 * remembers it for a same-process consumer; 0 when done, 1 when the driver refused (the Python
 * path records again and raises), -1 with an exception set. */
static int record(in_place_renewer *r, PyObject *prepared) {
  unsigned long long context = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(prepared, P_CONTEXT));
  unsigned long long event = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(prepared, P_CUEVENT));
  if (PyErr_Occurred()) return -1;
  if (aib_cuda_record_after((uint64_t)context, 0, (uint64_t)event) != 0) return 1;
  PyObject *done = PyObject_CallFunctionObjArgs(r->remember_local_event, PyTuple_GET_ITEM(prepared, P_HANDLE),
                                                PyTuple_GET_ITEM(prepared, P_LOCAL_EVENT), NULL);
  Py_XDECREF(done);
  return done != NULL ? 0 : -1;
}

/* renew(name, obj) -> the publication's stats when obj renewed name's publication in place, else
 * None (nothing done that the Python path would not do again). */
static PyObject *renew(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  in_place_renewer *r = (in_place_renewer *)self;
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "renew(name, obj) takes two arguments");
    return NULL;
  }
  PyObject *name = args[0], *obj = args[1];
  if (r->closed || r->generation != aib_py_fork_generation() || (PyObject *)Py_TYPE(obj) != r->columns_type ||
      !PyUnicode_Check(name))
    Py_RETURN_NONE;
  Py_ssize_t name_len;
  const char *raw = PyUnicode_AsUTF8AndSize(name, &name_len);
  if (raw == NULL) { /* not a name: the Python path says why */
    PyErr_Clear();
    Py_RETURN_NONE;
  }
  if (aib_py_call_lock(r->acquire) < 0) return NULL;
  PyObject *result = NULL, *prepared = NULL, *raw_name = NULL, *waiting = NULL;
  PyObject *current = r->closed ? NULL : PyDict_GetItemWithError(r->current, name); /* borrowed */
  if (current != NULL) prepared = prepared_for(current, obj);
  if (prepared == NULL) goto unlock;
  int recorded = record(r, prepared);
  if (recorded != 0) goto unlock;
  uint64_t version = aib_pubtable_renew(r->table, (const uint8_t *)raw, (size_t)name_len);
  if (version == 0) goto unlock; /* cannot happen (_current and the table change together) */
  raw_name = PyBytes_FromStringAndSize(raw, name_len);
  PyObject *version_number = raw_name != NULL ? PyLong_FromUnsignedLongLong((unsigned long long)version) : NULL;
  waiting = version_number != NULL ? PyObject_CallFunctionObjArgs(r->published, raw_name, version_number, NULL) : NULL;
  Py_XDECREF(version_number);
  if (waiting != NULL) result = Py_NewRef(PyTuple_GET_ITEM(prepared, P_STATS));
unlock:
  aib_py_release_lock(r->release);
  if (result == NULL) {
    Py_XDECREF(prepared);
    Py_XDECREF(raw_name);
    Py_XDECREF(waiting);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
  }
  r->renewals++;
  PyObject *n = PyIter_Next(r->counter); /* an itertools.count: never ends, never fails */
  if (n == NULL && PyErr_Occurred()) PyErr_WriteUnraisable(r->counter);
  Py_XDECREF(n);
  /* The held waits this version answers (a step loop's usual case: none), after the lock. */
  if (PyList_Check(waiting) && PyList_GET_SIZE(waiting) > 0) {
    PyObject *delivered = PyObject_CallOneArg(r->deliver, waiting);
    if (delivered == NULL) Py_CLEAR(result);
    Py_XDECREF(delivered);
  }
  Py_DECREF(prepared);
  Py_DECREF(raw_name);
  Py_DECREF(waiting);
  return result;
}

static PyObject *renewer_close(PyObject *self, PyObject *unused) {
  (void)unused;
  ((in_place_renewer *)self)->closed = 1;
  Py_RETURN_NONE;
}

/* InPlaceRenewer(table address, keep_alive, lock, current, columns type, published, deliver,
 *                remember_local_event, counter) */
static PyObject *renewer_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
  unsigned long long table;
  PyObject *keep_alive, *lock, *current, *columns_type, *published, *deliver, *remember, *counter;
  if (kwargs != NULL && PyDict_Size(kwargs) != 0) {
    PyErr_SetString(PyExc_TypeError, "InPlaceRenewer takes positional arguments only");
    return NULL;
  }
  if (!PyArg_ParseTuple(args, "KOOO!OOOOO:InPlaceRenewer", &table, &keep_alive, &lock, &PyDict_Type, &current,
                        &columns_type, &published, &deliver, &remember, &counter))
    return NULL;
  if (table == 0 || !PyType_Check(columns_type)) {
    PyErr_SetString(PyExc_ValueError, "InPlaceRenewer needs a publication table and a type");
    return NULL;
  }
  in_place_renewer *r = (in_place_renewer *)PyType_GenericAlloc(type, 0);
  if (r == NULL) return NULL;
  r->table = (aib_pubtable *)(uintptr_t)table;
  r->generation = aib_py_fork_generation();
  r->keep_alive = Py_NewRef(keep_alive);
  r->current = Py_NewRef(current);
  r->columns_type = Py_NewRef(columns_type);
  r->published = Py_NewRef(published);
  r->deliver = Py_NewRef(deliver);
  r->remember_local_event = Py_NewRef(remember);
  r->counter = Py_NewRef(counter);
  r->acquire = PyObject_GetAttrString(lock, "acquire");
  r->release = PyObject_GetAttrString(lock, "release");
  if (r->acquire == NULL || r->release == NULL) {
    Py_DECREF(r);
    return NULL;
  }
  return (PyObject *)r;
}

static PyMethodDef renewer_methods[] = {
    {"renew", (PyCFunction)(void (*)(void))renew, METH_FASTCALL,
     "renew(name, obj) -> the publication's stats when obj renewed it in place, else None"},
    {"close", renewer_close, METH_NOARGS, "close() -> None; every renew answers None from now on"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef renewer_members[] = {
    {"renewals", T_ULONGLONG, offsetof(in_place_renewer, renewals), READONLY, "in-place renewals made here"},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot renewer_slots[] = {
    {Py_tp_new, renewer_new},
    {Py_tp_dealloc, renewer_dealloc},
    {Py_tp_methods, renewer_methods},
    {Py_tp_members, renewer_members},
    {Py_tp_doc, "A publisher's in-place renewals in one builtin call (producer/publisher.py makes one per publisher)."},
    {0, NULL},
};

/* No Py_TPFLAGS_HAVE_GC: nothing a renewer references (the publisher's lock, dict and watch
 * methods, a type, a function, a counter) references it back; the publisher holds it. */
static PyType_Spec renewer_spec = {
    "arrow_ipc_bridge._ffi.InPlaceRenewer", sizeof(in_place_renewer), 0, Py_TPFLAGS_DEFAULT, renewer_slots,
};

int aib_py_install_in_place(const char *module_name) {
  return aib_py_install_type(module_name, &renewer_spec, keys, key_names, N_KEYS);
}
