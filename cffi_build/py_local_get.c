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
 * The objects it makes are those Python makes, by the same C function (aib_py_remembered_import,
 * py_state.c): a Decoded sharing the remembered template's decode and an ImportedArray or
 * ImportedStream. Their state, and the remembered message's, lives in the C base types of py_state.c:
 * it is read and filled by offset, never by attribute name, and the channel's closed state is the
 * C channel's own. The Python objects the getter calls (the locks' methods, ffi.cast, ffi.gc, the
 * counters, the set's discard) are handed to its constructor one by one.
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
#include "py_state.h"

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
  PyObject *request_acquire, *request_release, *recv_acquire, *recv_release; /* the locks' bound methods */
  PyObject *by_id;        /* RememberedMessages._by_id: entry id -> RememberedMessage (a RememberedState) */
  PyObject *cast, *gc, *unref, *owner_ctype, *slot_ctype, *null; /* ffi.cast, ffi.gc, lib.aib_owner_unref, ... */
  PyObject *remembered_gets, *local_gets; /* process-wide counters: itertools.count objects */
  PyObject *kept_arrays;  /* the session's KeptCupyArrays, or None */
  PyObject *tracked;      /* the session's set of weak references to its live imports */
  PyObject *untrack;      /* tracked.discard: each reference's callback */
} local_getter;

/* The getter's object references, in one list for dealloc. */
#define GETTER_OBJECTS(g)                                                                               \
  {&(g)->keep_alive,   &(g)->request_acquire, &(g)->request_release, &(g)->recv_acquire, &(g)->recv_release, \
   &(g)->by_id,        &(g)->cast,            &(g)->gc,              &(g)->unref,        &(g)->owner_ctype,  \
   &(g)->slot_ctype,   &(g)->null,            &(g)->remembered_gets, &(g)->local_gets,   &(g)->kept_arrays,  \
   &(g)->tracked,      &(g)->untrack}
#define N_GETTER_OBJECTS 17

static void local_getter_dealloc(PyObject *self) {
  local_getter *g = (local_getter *)self;
  PyObject **objects[N_GETTER_OBJECTS] = GETTER_OBJECTS(g);
  for (int i = 0; i < N_GETTER_OBJECTS; i++) Py_CLEAR(*objects[i]);
  aib_py_free_instance(self);
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

/* The imported object of a local answer (out) of the remembered message hit: what
 * Session._adopt_remembered makes (aib_py_remembered_import, py_state.c), with the answer's version
 * and the session's kept arrays, tracked in the session's set. Takes over the owner's reference. */
static PyObject *build_imported(local_getter *g, PyObject *name, const aib_get_result *out,
                                aib_py_remembered_state *hit) {
  PyObject *address = NULL, *owner = NULL, *sync = NULL, *imported = NULL, *ref = NULL, *result = NULL;
  address = PyLong_FromUnsignedLongLong((unsigned long long)out->owner_address);
  if (address == NULL) {
    aib_owner_unref(out->owner);
    return NULL;
  }
  owner = owned_pointer(g, out->owner, address); /* from here the owner's reference is owner's */
  if (owner == NULL) goto done;
  if (out->sync_slot != NULL) {
    PyObject *slot = PyLong_FromVoidPtr(out->sync_slot);
    sync = slot != NULL ? PyObject_CallFunctionObjArgs(g->cast, g->slot_ctype, slot, NULL) : NULL;
    Py_XDECREF(slot);
    if (sync == NULL) goto done;
  } else {
    sync = Py_NewRef(g->null);
  }
  imported = aib_py_remembered_import(hit, owner, sync, name, address);
  if (imported == NULL) goto done;
  PyObject **slots = ((aib_py_import_state *)imported)->slot;
  if (out->version != 0 && (slots[IS_VERSION] = PyLong_FromUnsignedLongLong((unsigned long long)out->version)) == NULL)
    goto done;
  if (g->kept_arrays != Py_None && (slots[IS_KEPT_ARRAYS] = PyTuple_Pack(2, g->kept_arrays, hit)) == NULL) goto done;
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
  Py_XDECREF(sync);
  Py_XDECREF(owner);
  Py_XDECREF(address);
  return result;
}

/* Counts a local get: this getter's count (Session.remembered_gets and local_gets add it) and the
 * process-wide counters (process_stats.import_counters). */
static int count_get(local_getter *g) {
  g->gets++;
  PyObject *counters[2] = {g->remembered_gets, g->local_gets};
  for (int i = 0; i < 2; i++) {
    PyObject *n = PyIter_Next(counters[i]);
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
  /* The channel's closed state is the C channel's own: aib_session_get_local answers nothing for a
   * closed channel (aib_channel_quiet), read under the receive lock as Channel.get reads it, since
   * a closed channel's descriptor may be closed (and its number reused) once nobody holds its
   * locks. */
  aib_get_result out;
  int rc = aib_session_get_local(g->channel, g->remembered, g->board, g->board_slots, (const uint8_t *)raw,
                                 (size_t)name_len, &out);
  aib_py_release_lock(g->recv_release);
  if (rc != AIB_GET_IMPORTED) {
    aib_py_release_lock(g->request_release);
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
  PyObject *imported = NULL;
  if (!PyObject_TypeCheck(hit, aib_py_remembered_state_type)) { /* RememberedMessages keeps only these */
    aib_owner_unref(out.owner);
    PyErr_Format(PyExc_TypeError, "a remembered message is a %.100s, not a RememberedState", Py_TYPE(hit)->tp_name);
  } else {
    imported = build_imported(g, name, &out, (aib_py_remembered_state *)hit);
  }
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

/* LocalGetter(channel, remembered, board, board_slots, keep_alive, request_acquire, request_release,
 *             recv_acquire, recv_release, by_id, cast, gc, unref, owner_ctype,
 *             slot_ctype, null, remembered_gets, local_gets, kept_arrays, tracked, untrack)
 * (consumer/local_getter.py says what each is; by keyword or position). */
static PyObject *local_getter_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
  static char *names[] = {"channel",         "remembered",   "board",      "board_slots",     "keep_alive",
                          "request_acquire", "request_release", "recv_acquire", "recv_release", "by_id",
                          "cast",         "gc",         "unref",           "owner_ctype",
                          "slot_ctype",      "null",         "remembered_gets", "local_gets", "kept_arrays",
                          "tracked",         "untrack",      NULL};
  unsigned long long channel, remembered, board;
  unsigned int board_slots;
  local_getter parsed = {0};
  if (!PyArg_ParseTupleAndKeywords(
          args, kwargs, "KKKIOOOOOO!OOOOOOOOOO!O:LocalGetter", names, &channel, &remembered, &board, &board_slots,
          &parsed.keep_alive, &parsed.request_acquire, &parsed.request_release, &parsed.recv_acquire,
          &parsed.recv_release, &PyDict_Type, &parsed.by_id, &parsed.cast,
          &parsed.gc, &parsed.unref, &parsed.owner_ctype, &parsed.slot_ctype, &parsed.null, &parsed.remembered_gets,
          &parsed.local_gets, &parsed.kept_arrays, &PySet_Type, &parsed.tracked, &parsed.untrack))
    return NULL;
  if (channel == 0 || remembered == 0 || board == 0) {
    PyErr_SetString(PyExc_ValueError, "LocalGetter needs a channel, a remembered set and a board");
    return NULL;
  }
  local_getter *g = (local_getter *)PyType_GenericAlloc(type, 0);
  if (g == NULL) return NULL;
  g->channel = (aib_channel *)(uintptr_t)channel;
  g->remembered = (aib_remembered *)(uintptr_t)remembered;
  g->board = (const void *)(uintptr_t)board;
  g->board_slots = board_slots;
  g->generation = aib_py_fork_generation();
  PyObject **from[N_GETTER_OBJECTS] = GETTER_OBJECTS(&parsed);
  PyObject **to[N_GETTER_OBJECTS] = GETTER_OBJECTS(g);
  for (int i = 0; i < N_GETTER_OBJECTS; i++) *to[i] = Py_NewRef(*from[i]);
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
  return aib_py_install_type(module_name, &local_getter_spec, NULL, NULL);
}
