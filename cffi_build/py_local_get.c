/* A session's local re-get as one builtin: the steady state of a standing-lease consumer.
 *
 * A re-get of a name whose remembered message holds a standing lease is answered from the
 * publisher's version board with no round trip (aib_session_get_local). In Python around that C
 * call, the get cost some fifteen frames: the session's checks, the locks, cffi's argument
 * conversion, the remembered message's Python side, the Decoded and Imported objects, the session's
 * set of live imports and the counters. Cheap in a tight loop, but a consumer that slept between
 * steps (a step loop waiting for the producer's next version) runs them on cold caches, where
 * their cost follows how much code and data they touch. Here the same work is one builtin call
 * over state prepared once per session (consumer/session.py, Session._local_getter).
 *
 * It does exactly what Session._get_unplaced does for a local answer, and nothing else: anything
 * else (a closed session or channel, another process, a name not remembered with a standing lease,
 * bytes on the channel, a str that is not a name) returns None having sent and changed nothing,
 * and the caller takes the Python path, which asks the publisher and raises the documented errors.
 * The objects it makes are those Python makes: a Decoded sharing the remembered template's decode
 * (its attributes copied from a dict the remembered message prepared) and an ImportedArray or
 * ImportedStream, each made with its type's tp_new, as cls.__new__(cls) makes them.
 *
 * Everything here runs with the GIL held: the board read and the remembered set's lookup are a
 * memory read and a hash lookup and never block (the set's mutex is held only inside C calls that need
 * no GIL). The session's request lock and the channel's receive lock (threading.Lock objects) are
 * taken through their bound methods, in the order Python takes them; a contended acquire
 * releases the GIL while it waits, as in Python. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h> /* T_ULONGLONG, READONLY */

#include "internal.h"
#include "py_hot.h"

/* Attribute names, interned once at install (a lookup by an interned str hashes nothing). */
enum { K_DECODED, K_OWNER_ADDRESS, K_SYNC, K_NAME, K_VERSION, K_KEPT, K_OWNER, K_DICT, K_CLOSED, K_STEADY, N_KEYS };
static const char *const key_names[N_KEYS] = {"_decoded", "_owner_address", "_sync", "name", "version",
                                              "_kept_arrays", "owner", "__dict__", "_closed", "steady_fields"};
static PyObject *keys[N_KEYS];

typedef struct {
  PyObject_HEAD
  /* What the C call reads; the Python objects below keep each alive. */
  aib_channel *channel;
  aib_remembered *remembered;
  const void *board;
  uint32_t board_slots;
  unsigned generation;
  int closed;
  unsigned long long gets; /* local gets answered here */
  PyObject *keep_alive;    /* (channel, remembered table, board): the owners of the three pointers */
  PyObject *channel_obj;   /* the Python Channel: its _closed is read under its receive lock */
  PyObject *request_acquire, *request_release, *recv_acquire, *recv_release;
  PyObject *by_id;        /* RememberedMessages._by_id: entry id -> RememberedMessage */
  PyObject *decoded_type; /* metadata.Decoded */
  PyObject *cast, *gc, *unref, *owner_ctype, *slot_ctype, *null; /* ffi.cast, ffi.gc, lib.aib_owner_unref, ... */
  PyObject *counters;     /* (process-wide remembered gets, local gets): itertools.count objects */
  PyObject *kept_arrays;  /* the session's KeptCupyArrays, or None */
  PyObject *tracked;      /* the session's set of weak references to its live imports */
  PyObject *untrack;      /* tracked.discard: each reference's callback */
} local_getter;

static void local_getter_dealloc(PyObject *self) {
  local_getter *g = (local_getter *)self;
  Py_XDECREF(g->keep_alive);
  Py_XDECREF(g->channel_obj);
  Py_XDECREF(g->request_acquire);
  Py_XDECREF(g->request_release);
  Py_XDECREF(g->recv_acquire);
  Py_XDECREF(g->recv_release);
  Py_XDECREF(g->by_id);
  Py_XDECREF(g->decoded_type);
  Py_XDECREF(g->cast);
  Py_XDECREF(g->gc);
  Py_XDECREF(g->unref);
  Py_XDECREF(g->owner_ctype);
  Py_XDECREF(g->slot_ctype);
  Py_XDECREF(g->null);
  Py_XDECREF(g->counters);
  Py_XDECREF(g->kept_arrays);
  Py_XDECREF(g->tracked);
  Py_XDECREF(g->untrack);
  aib_py_free_instance(self);
}

/* cls.__new__(cls) for a Python class (what the adopt constructors do). */
static PyObject *new_instance(PyObject *type) {
  newfunc make = (newfunc)PyType_GetSlot((PyTypeObject *)type, Py_tp_new);
  PyObject *empty = PyTuple_New(0);
  PyObject *obj = empty != NULL ? make((PyTypeObject *)type, empty, NULL) : NULL;
  Py_XDECREF(empty);
  return obj;
}

/* A new instance of type whose attributes are a copy of fields; NULL with an exception set. */
static PyObject *instance_with(PyObject *type, PyObject *fields) {
  PyObject *obj = new_instance(type);
  if (obj == NULL) return NULL;
  if (PyObject_SetAttr(obj, keys[K_DICT], fields) < 0) {
    Py_DECREF(obj);
    return NULL;
  }
  return obj;
}

/* The owner the C core gave us as a cffi pointer whose collection drops the reference
 * (ffi.gc(ffi.cast("aib_owner *", address), lib.aib_owner_unref), as Decoded.adopt holds it). On
 * failure the reference is dropped here. */
static PyObject *owned_pointer(local_getter *g, aib_owner *owner, PyObject *address) {
  PyObject *pointer = PyObject_CallFunctionObjArgs(g->cast, g->owner_ctype, address, NULL);
  PyObject *held = pointer != NULL ? PyObject_CallFunctionObjArgs(g->gc, pointer, g->unref, NULL) : NULL;
  Py_XDECREF(pointer);
  if (held == NULL) aib_owner_unref(owner);
  return held;
}

/* The imported object of a local answer (out): the Python side of the message, as
 * Session._get_unplaced builds it. Takes over the owner's reference. */
static PyObject *build_imported(local_getter *g, PyObject *name, const aib_get_result *out, PyObject *hit,
                                PyObject *steady) {
  PyObject *address = NULL, *owner = NULL, *decoded_fields = NULL, *decoded = NULL;
  PyObject *imported_fields = NULL, *imported = NULL, *sync = NULL, *version = NULL, *kept = NULL;
  PyObject *ref = NULL, *result = NULL;
  /* steady_fields: (imported type, the Decoded's attributes, the imported object's attributes) */
  if (!PyTuple_Check(steady) || PyTuple_GET_SIZE(steady) != 3) {
    aib_owner_unref(out->owner);
    PyErr_SetString(PyExc_TypeError, "a remembered message's steady_fields is not a 3-tuple");
    return NULL;
  }
  address = PyLong_FromUnsignedLongLong((unsigned long long)out->owner_address);
  if (address == NULL) {
    aib_owner_unref(out->owner);
    return NULL;
  }
  owner = owned_pointer(g, out->owner, address); /* from here the owner's reference is owner's */
  if (owner == NULL) goto done;
  decoded_fields = PyDict_Copy(PyTuple_GET_ITEM(steady, 1));
  if (decoded_fields == NULL || PyDict_SetItem(decoded_fields, keys[K_OWNER], owner) < 0) goto done;
  decoded = instance_with(g->decoded_type, decoded_fields);
  if (decoded == NULL) goto done;
  if (out->sync_slot != NULL) {
    PyObject *slot = PyLong_FromVoidPtr(out->sync_slot);
    sync = slot != NULL ? PyObject_CallFunctionObjArgs(g->cast, g->slot_ctype, slot, NULL) : NULL;
    Py_XDECREF(slot);
    if (sync == NULL) goto done;
  } else {
    sync = Py_NewRef(g->null);
  }
  imported_fields = PyDict_Copy(PyTuple_GET_ITEM(steady, 2));
  if (imported_fields == NULL || PyDict_SetItem(imported_fields, keys[K_DECODED], decoded) < 0 ||
      PyDict_SetItem(imported_fields, keys[K_OWNER_ADDRESS], address) < 0 ||
      PyDict_SetItem(imported_fields, keys[K_SYNC], sync) < 0 || PyDict_SetItem(imported_fields, keys[K_NAME], name) < 0)
    goto done;
  if (out->version != 0) {
    version = PyLong_FromUnsignedLongLong((unsigned long long)out->version);
    if (version == NULL || PyDict_SetItem(imported_fields, keys[K_VERSION], version) < 0) goto done;
  }
  if (g->kept_arrays != Py_None) {
    kept = PyTuple_Pack(2, g->kept_arrays, hit);
    if (kept == NULL || PyDict_SetItem(imported_fields, keys[K_KEPT], kept) < 0) goto done;
  }
  imported = instance_with(PyTuple_GET_ITEM(steady, 0), imported_fields);
  if (imported == NULL) goto done;
  /* The session's live imports (Session.close releases them): a weak reference that removes
   * itself, as a WeakSet holds them. */
  ref = PyWeakref_NewRef(imported, g->untrack);
  if (ref == NULL || PySet_Add(g->tracked, ref) < 0) goto done;
  result = Py_NewRef(imported);
done:
  /* On failure the Decoded (or, before it, the cffi pointer) lets go of the owner when it dies
   * here, ending the lease's hold as Python's path does on an error. */
  Py_XDECREF(ref);
  Py_XDECREF(imported);
  Py_XDECREF(kept);
  Py_XDECREF(version);
  Py_XDECREF(imported_fields);
  Py_XDECREF(sync);
  Py_XDECREF(decoded);
  Py_XDECREF(decoded_fields);
  Py_XDECREF(owner);
  Py_XDECREF(address);
  return result;
}

/* Counts a local get: this getter's count (Session.remembered_gets and local_gets add it) and the
 * process-wide counters (process_stats.import_counters). */
static int count_get(local_getter *g) {
  g->gets++;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(g->counters); i++) {
    PyObject *n = PyIter_Next(PyTuple_GET_ITEM(g->counters, i));
    if (n == NULL) return PyErr_Occurred() ? -1 : 0;
    Py_DECREF(n);
  }
  return 0;
}

/* get(name) -> the imported object of a local answer, or None (nothing sent or changed). */
static PyObject *local_get(PyObject *self, PyObject *name) {
  local_getter *g = (local_getter *)self;
  if (g->closed || g->generation != aib_py_fork_generation() || !PyUnicode_Check(name)) Py_RETURN_NONE;
  Py_ssize_t name_len;
  const char *raw = PyUnicode_AsUTF8AndSize(name, &name_len);
  if (raw == NULL) { /* not encodable: the Python path says why */
    PyErr_Clear();
    Py_RETURN_NONE;
  }
  if (aib_py_call_lock(g->request_acquire) < 0) return NULL;
  if (g->closed) { /* closed while we waited: Session.close sets it before it tears anything down */
    aib_py_release_lock(g->request_release);
    Py_RETURN_NONE;
  }
  if (aib_py_call_lock(g->recv_acquire) < 0) {
    aib_py_release_lock(g->request_release);
    return NULL;
  }
  /* A closed channel's descriptor may be closed (and its number reused) once nobody holds its locks:
   * read its state under the receive lock, as Channel.get does. */
  PyObject *channel_closed = PyObject_GetAttr(g->channel_obj, keys[K_CLOSED]);
  int usable = channel_closed != NULL && channel_closed == Py_False;
  Py_XDECREF(channel_closed);
  aib_get_result out;
  int rc = usable ? aib_session_get_local(g->channel, g->remembered, g->board, g->board_slots, (const uint8_t *)raw,
                                          (size_t)name_len, &out)
                  : AIB_OK;
  aib_py_release_lock(g->recv_release);
  if (rc != AIB_GET_IMPORTED) {
    aib_py_release_lock(g->request_release);
    if (channel_closed == NULL) return NULL;
    Py_RETURN_NONE;
  }
  /* Changes to the remembered set wait for the request lock, so the message's Python side is here. */
  PyObject *entry_id = PyLong_FromUnsignedLongLong((unsigned long long)out.entry_id);
  PyObject *hit = entry_id != NULL ? PyDict_GetItemWithError(g->by_id, entry_id) : NULL; /* borrowed */
  Py_XINCREF(hit);
  Py_XDECREF(entry_id);
  aib_py_release_lock(g->request_release);
  if (hit == NULL) {
    aib_owner_unref(out.owner); /* cannot happen; if it did, the lease's hold ends here */
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "a remembered message vanished during a get");
    return NULL;
  }
  PyObject *steady = PyObject_GetAttr(hit, keys[K_STEADY]);
  PyObject *imported = NULL;
  if (steady == NULL)
    aib_owner_unref(out.owner);
  else
    imported = build_imported(g, name, &out, hit, steady);
  Py_XDECREF(steady);
  Py_DECREF(hit);
  if (imported != NULL && count_get(g) < 0) Py_CLEAR(imported);
  return imported;
}

/* close(): answer nothing from now on (Session.close, before it tears anything down). */
static PyObject *local_getter_close(PyObject *self, PyObject *unused) {
  (void)unused;
  ((local_getter *)self)->closed = 1;
  Py_RETURN_NONE;
}

/* LocalGetter(channel address, remembered address, board address, board slots, keep_alive,
 *             channel, request lock, receive lock, by_id, Decoded, kit, counters, kept arrays,
 *             tracked)
 * kit: (ffi.cast, ffi.gc, lib.aib_owner_unref, ffi.typeof("aib_owner *"),
 *       ffi.typeof("uint64_t *"), ffi.NULL) */
static PyObject *local_getter_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
  unsigned long long channel, remembered, board;
  unsigned int board_slots;
  PyObject *keep_alive, *channel_obj, *request_lock, *recv_lock, *by_id, *decoded_type, *kit, *counters, *kept, *tracked;
  if (kwargs != NULL && PyDict_Size(kwargs) != 0) {
    PyErr_SetString(PyExc_TypeError, "LocalGetter takes positional arguments only");
    return NULL;
  }
  if (!PyArg_ParseTuple(args, "KKKIOOOOO!OO!O!OO!:LocalGetter", &channel, &remembered, &board, &board_slots,
                        &keep_alive, &channel_obj, &request_lock, &recv_lock, &PyDict_Type, &by_id, &decoded_type,
                        &PyTuple_Type, &kit, &PyTuple_Type, &counters, &kept, &PySet_Type, &tracked))
    return NULL;
  if (channel == 0 || remembered == 0 || board == 0 || PyTuple_GET_SIZE(kit) != 6 || !PyType_Check(decoded_type)) {
    PyErr_SetString(PyExc_ValueError, "LocalGetter needs a channel, a remembered set, a board and a 6-item kit");
    return NULL;
  }
  local_getter *g = (local_getter *)PyType_GenericAlloc(type, 0);
  if (g == NULL) return NULL;
  g->channel = (aib_channel *)(uintptr_t)channel;
  g->remembered = (aib_remembered *)(uintptr_t)remembered;
  g->board = (const void *)(uintptr_t)board;
  g->board_slots = board_slots;
  g->generation = aib_py_fork_generation();
  g->keep_alive = Py_NewRef(keep_alive);
  g->channel_obj = Py_NewRef(channel_obj);
  g->by_id = Py_NewRef(by_id);
  g->decoded_type = Py_NewRef(decoded_type);
  g->counters = Py_NewRef(counters);
  g->kept_arrays = Py_NewRef(kept);
  g->tracked = Py_NewRef(tracked);
  PyObject **kit_items[6] = {&g->cast, &g->gc, &g->unref, &g->owner_ctype, &g->slot_ctype, &g->null};
  for (int i = 0; i < 6; i++) *kit_items[i] = Py_NewRef(PyTuple_GET_ITEM(kit, i));
  g->request_acquire = PyObject_GetAttrString(request_lock, "acquire");
  g->request_release = PyObject_GetAttrString(request_lock, "release");
  g->recv_acquire = PyObject_GetAttrString(recv_lock, "acquire");
  g->recv_release = PyObject_GetAttrString(recv_lock, "release");
  g->untrack = PyObject_GetAttrString(tracked, "discard");
  if (g->request_acquire == NULL || g->request_release == NULL || g->recv_acquire == NULL ||
      g->recv_release == NULL || g->untrack == NULL) {
    Py_DECREF(g);
    return NULL;
  }
  return (PyObject *)g;
}

static PyMethodDef local_getter_methods[] = {
    {"get", local_get, METH_O,
     "get(name) -> the imported object of a local answer from the board, or None (nothing sent)"},
    {"close", local_getter_close, METH_NOARGS, "close() -> None; every get answers None from now on"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef local_getter_members[] = {
    {"gets", T_ULONGLONG, offsetof(local_getter, gets), READONLY, "local gets answered here"},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot local_getter_slots[] = {
    {Py_tp_new, local_getter_new},
    {Py_tp_dealloc, local_getter_dealloc},
    {Py_tp_methods, local_getter_methods},
    {Py_tp_members, local_getter_members},
    {Py_tp_doc, "A session's local re-gets in one builtin call (consumer/session.py makes one per session)."},
    {0, NULL},
};

/* No Py_TPFLAGS_HAVE_GC: what a getter references (locks, the session's set, types, the ffi's
 * functions) never references the getter back; the session holds it, nothing else. */
static PyType_Spec local_getter_spec = {
    "arrow_ipc_bridge._ffi.LocalGetter", sizeof(local_getter), 0, Py_TPFLAGS_DEFAULT, local_getter_slots,
};

int aib_py_install_local_get(const char *module_name) {
  return aib_py_install_type(module_name, &local_getter_spec, keys, key_names, N_KEYS);
}
