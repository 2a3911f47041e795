/* The C-owned state of what a get makes: base types whose slots hold a Decoded's, an imported
 * object's and a remembered message's attributes (py_state.h lists them).
 *
 * The Python classes subclass them (wire/metadata.Decoded, consumer/imported._ImportedBase,
 * consumer/remembered.RememberedMessage), so Python reads and sets the slots as ordinary
 * attributes, and the C core's local getter (py_local_get.c) reads and fills them by offset: no C
 * code looks a Python attribute up by name, so renaming one is a change to py_state.h that the
 * compiler sees, not a silent fall to a slower path. An unset object slot reads as None.
 *
 * The types are garbage-collected (a slot may hold a reference back to its object) and subclassable;
 * their subclasses keep a __dict__ and weak references, as plain Python classes have. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <structmember.h> /* T_OBJECT, READONLY */

#include "internal.h"
#include "py_hot.h"
#include "py_state.h"

PyTypeObject *aib_py_decoded_state_type, *aib_py_import_state_type, *aib_py_remembered_state_type;

/* Each type's objects are PyObject_HEAD then n object slots; what GC and dealloc do with them. */
static int visit_slots(PyObject **slots, int n, visitproc visit, void *arg) {
  for (int i = 0; i < n; i++) Py_VISIT(slots[i]);
  return 0;
}

static void clear_slots(PyObject **slots, int n) {
  for (int i = 0; i < n; i++) Py_CLEAR(slots[i]);
}

/* One type's traverse, clear and dealloc over its slot array (the base's part of a subclass's
 * object: subtype_traverse and subtype_dealloc call these after the subclass's own part). */
#define STATE_GC(prefix, ctype, count)                                                \
  static int prefix##_traverse(PyObject *self, visitproc visit, void *arg) {          \
    Py_VISIT(Py_TYPE(self)); /* heap types' instances reference their type */        \
    return visit_slots(((ctype *)self)->slot, count, visit, arg);                     \
  }                                                                                   \
  static int prefix##_clear(PyObject *self) {                                         \
    clear_slots(((ctype *)self)->slot, count);                                        \
    return 0;                                                                         \
  }                                                                                   \
  static void prefix##_dealloc(PyObject *self) {                                      \
    PyObject_GC_UnTrack(self);                                                        \
    clear_slots(((ctype *)self)->slot, count);                                        \
    aib_py_free_instance(self);                                                       \
  }

/* copy.copy(obj): a new object of its class with the same slot values and a copy of its __dict__
 * (what copy.copy made of these objects when their state was in the __dict__). Pickling and
 * deepcopy still refuse them (their cffi pointers cannot be pickled). */
static PyObject *copy_state(PyObject *self, PyObject **slots, size_t offset, int n) {
  PyTypeObject *type = Py_TYPE(self);
  PyObject *copy = type->tp_alloc(type, 0);
  if (copy == NULL) return NULL;
  PyObject **to = (PyObject **)((char *)copy + offset);
  for (int i = 0; i < n; i++) to[i] = Py_XNewRef(slots[i]);
  if (type->tp_dictoffset != 0) {
    PyObject *dict = PyObject_GenericGetDict(self, NULL);
    PyObject *fresh = dict != NULL ? PyDict_Copy(dict) : NULL;
    int rc = fresh != NULL ? PyObject_GenericSetDict(copy, fresh, NULL) : -1;
    Py_XDECREF(fresh);
    Py_XDECREF(dict);
    if (rc < 0) Py_CLEAR(copy);
  }
  return copy;
}

#define STATE_COPY(prefix, ctype, count)                                                           \
  static PyObject *prefix##_copy(PyObject *self, PyObject *unused) {                              \
    (void)unused;                                                                                  \
    return copy_state(self, ((ctype *)self)->slot, offsetof(ctype, slot), count);                 \
  }                                                                                                \
  static PyMethodDef prefix##_methods[] = {                                                        \
      {"__copy__", prefix##_copy, METH_NOARGS, "a shallow copy: the same slot values and __dict__"}, \
      STATE_METHODS_##prefix{NULL, NULL, 0, NULL},                                                 \
  };
#define STATE_METHODS_decoded_state
#define STATE_METHODS_import_state
#define STATE_METHODS_remembered_state                                                                 \
  {"adopt", (PyCFunction)(void (*)(void))remembered_state_adopt, METH_FASTCALL,                        \
   "adopt(owner, sync, name, owner_address) -> a new import of this message: a Decoded sharing the "  \
   "template over owner (a cffi aib_owner *, held), and an object of imported_type over it"},

STATE_GC(decoded_state, aib_py_decoded_state, DS_COUNT)
STATE_GC(import_state, aib_py_import_state, IS_COUNT)
STATE_GC(remembered_state, aib_py_remembered_state, RS_COUNT)
static PyObject *remembered_state_adopt(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
STATE_COPY(decoded_state, aib_py_decoded_state, DS_COUNT)
STATE_COPY(import_state, aib_py_import_state, IS_COUNT)
STATE_COPY(remembered_state, aib_py_remembered_state, RS_COUNT)

#define SLOT(ctype, index, name, flags, doc) {name, T_OBJECT, offsetof(ctype, slot[index]), flags, doc}

static PyMemberDef decoded_state_members[] = {
    SLOT(aib_py_decoded_state, DS_OWNER, "owner", 0, "the import owner (a cffi aib_owner *)"),
    SLOT(aib_py_decoded_state, DS_D, "_d", 0, NULL),
    SLOT(aib_py_decoded_state, DS_MESSAGE, "_message", 0, NULL),
    SLOT(aib_py_decoded_state, DS_N_FDS, "_n_fds", 0, NULL),
    SLOT(aib_py_decoded_state, DS_ALLOW_PROCESS_REGIONS, "_allow_process_regions", 0, NULL),
    SLOT(aib_py_decoded_state, DS_READER_MAPS, "_reader_maps", 0, NULL),
    {NULL, 0, 0, 0, NULL},
};

static PyMemberDef import_state_members[] = {
    SLOT(aib_py_import_state, IS_DECODED, "_decoded", 0, NULL),
    SLOT(aib_py_import_state, IS_BASES, "_bases", 0, NULL),
    SLOT(aib_py_import_state, IS_N_BASES, "_n_bases", 0, NULL),
    SLOT(aib_py_import_state, IS_DEVICE_TYPE, "_device_type", 0, NULL),
    SLOT(aib_py_import_state, IS_DEVICE_ID, "_device_id", 0, NULL),
    SLOT(aib_py_import_state, IS_SYNC, "_sync", 0, NULL),
    SLOT(aib_py_import_state, IS_NAME, "name", 0, "the name it was got as (None: imported without one)"),
    SLOT(aib_py_import_state, IS_ON_RELEASE, "_on_release", 0, NULL),
    SLOT(aib_py_import_state, IS_OWNER_ADDRESS, "_owner_address", 0, NULL),
    SLOT(aib_py_import_state, IS_VERSION, "version", 0,
         "the publication's version, for objects got by waiting or from the version board; else None"),
    SLOT(aib_py_import_state, IS_PUBLISHER_ID, "publisher_id", 0,
         "the publisher the version is from (objects got by waiting); else None"),
    SLOT(aib_py_import_state, IS_KEPT_ARRAYS, "_kept_arrays", 0, NULL),
    SLOT(aib_py_import_state, IS_MAPPED_ON, "_mapped_on", 0, NULL),
    SLOT(aib_py_import_state, IS_NUM_ROWS, "_num_rows", 0, NULL),
    {NULL, 0, 0, 0, NULL},
};

static PyMemberDef remembered_state_members[] = {
    SLOT(aib_py_remembered_state, RS_TEMPLATE, "template", READONLY,
         "the validated message; its owner holds every region's owner open"),
    SLOT(aib_py_remembered_state, RS_BASES, "bases", READONLY,
         "uint64_t[] of region bases, shared read-only by every import of the message"),
    SLOT(aib_py_remembered_state, RS_N_BASES, "n_bases", READONLY, "len(bases)"),
    SLOT(aib_py_remembered_state, RS_DEVICE_TYPE, "device_type", READONLY, NULL),
    SLOT(aib_py_remembered_state, RS_DEVICE_ID, "device_id", READONLY, NULL),
    SLOT(aib_py_remembered_state, RS_IMPORTED_TYPE, "imported_type", READONLY, "the class of its imports"),
    SLOT(aib_py_remembered_state, RS_MAPPED_ON, "mapped_on", READONLY,
         "(reader GPU, regions opened again there) when bases are where the reader reads; else None"),
    {NULL, 0, 0, 0, NULL},
};

PyObject *aib_py_remembered_import(aib_py_remembered_state *hit, PyObject *owner, PyObject *sync, PyObject *name,
                                   PyObject *owner_address) {
  aib_py_decoded_state *template = (aib_py_decoded_state *)hit->slot[RS_TEMPLATE];
  PyTypeObject *decoded_type = Py_TYPE(template);
  /* One dict of reader maps shared by every decode of the message, made on first need (as
   * Decoded.reader_maps makes it). */
  if (template->slot[DS_READER_MAPS] == NULL && (template->slot[DS_READER_MAPS] = PyDict_New()) == NULL) return NULL;
  /* cls.__new__(cls), as the adopt constructors make them: these classes define no __new__ */
  aib_py_decoded_state *decoded = (aib_py_decoded_state *)decoded_type->tp_alloc(decoded_type, 0);
  if (decoded == NULL) return NULL;
  decoded->slot[DS_OWNER] = Py_NewRef(owner);
  for (int i = 0; i < DS_COUNT; i++)
    if (i != DS_OWNER) decoded->slot[i] = Py_XNewRef(template->slot[i]);
  PyTypeObject *imported_type = (PyTypeObject *)hit->slot[RS_IMPORTED_TYPE];
  aib_py_import_state *imported = (aib_py_import_state *)imported_type->tp_alloc(imported_type, 0);
  if (imported == NULL) {
    Py_DECREF(decoded);
    return NULL;
  }
  PyObject **slots = imported->slot;
  slots[IS_DECODED] = (PyObject *)decoded;
  slots[IS_BASES] = Py_NewRef(hit->slot[RS_BASES]);
  slots[IS_N_BASES] = Py_NewRef(hit->slot[RS_N_BASES]);
  slots[IS_DEVICE_TYPE] = Py_NewRef(hit->slot[RS_DEVICE_TYPE]);
  slots[IS_DEVICE_ID] = Py_NewRef(hit->slot[RS_DEVICE_ID]);
  slots[IS_MAPPED_ON] = Py_NewRef(hit->slot[RS_MAPPED_ON]);
  slots[IS_SYNC] = Py_NewRef(sync);
  slots[IS_NAME] = Py_NewRef(name);
  slots[IS_OWNER_ADDRESS] = Py_NewRef(owner_address);
  return (PyObject *)imported;
}

/* adopt(owner, sync, name, owner_address): aib_py_remembered_import for Python's path
 * (Session._adopt_remembered). */
static PyObject *remembered_state_adopt(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 4) {
    PyErr_Format(PyExc_TypeError, "adopt takes 4 arguments (owner, sync, name, owner_address), not %zd", nargs);
    return NULL;
  }
  return aib_py_remembered_import((aib_py_remembered_state *)self, args[0], args[1], args[2], args[3]);
}

/* RememberedState(template, bases, device_type, device_id, imported_type, mapped_on): checks what
 * the local getter relies on (a Decoded template, an imported class) once, here. */
static PyObject *remembered_state_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
  static char *names[] = {"template", "bases", "device_type", "device_id", "imported_type", "mapped_on", NULL};
  PyObject *values[RS_COUNT] = {NULL};
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO!O!O!O:RememberedState", names, &values[RS_TEMPLATE],
                                   &values[RS_BASES], &PyLong_Type, &values[RS_DEVICE_TYPE], &PyLong_Type,
                                   &values[RS_DEVICE_ID], &PyType_Type, &values[RS_IMPORTED_TYPE],
                                   &values[RS_MAPPED_ON]))
    return NULL;
  if (!PyObject_TypeCheck(values[RS_TEMPLATE], aib_py_decoded_state_type)) {
    PyErr_Format(PyExc_TypeError, "a remembered message's template must be a Decoded, not %.100s",
                 Py_TYPE(values[RS_TEMPLATE])->tp_name);
    return NULL;
  }
  if (!PyType_IsSubtype((PyTypeObject *)values[RS_IMPORTED_TYPE], aib_py_import_state_type)) {
    PyErr_Format(PyExc_TypeError, "a remembered message's imported_type must be an imported class, not %.100s",
                 ((PyTypeObject *)values[RS_IMPORTED_TYPE])->tp_name);
    return NULL;
  }
  Py_ssize_t n_bases = PyObject_Size(values[RS_BASES]);
  if (n_bases < 0) return NULL;
  aib_py_remembered_state *self = (aib_py_remembered_state *)type->tp_alloc(type, 0);
  if (self == NULL) return NULL;
  self->slot[RS_N_BASES] = PyLong_FromSsize_t(n_bases);
  if (self->slot[RS_N_BASES] == NULL) {
    Py_DECREF(self);
    return NULL;
  }
  for (int i = 0; i < RS_COUNT; i++)
    if (i != RS_N_BASES) self->slot[i] = Py_NewRef(values[i]);
  return (PyObject *)self;
}

#define STATE_FLAGS (Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC)

static PyType_Slot decoded_state_slots[] = {
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_traverse, decoded_state_traverse},
    {Py_tp_clear, decoded_state_clear},
    {Py_tp_dealloc, decoded_state_dealloc},
    {Py_tp_members, decoded_state_members},
    {Py_tp_methods, decoded_state_methods},
    {Py_tp_doc, "The slots of a decoded message (wire/metadata.Decoded subclasses it)."},
    {0, NULL},
};
static PyType_Slot import_state_slots[] = {
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_traverse, import_state_traverse},
    {Py_tp_clear, import_state_clear},
    {Py_tp_dealloc, import_state_dealloc},
    {Py_tp_members, import_state_members},
    {Py_tp_methods, import_state_methods},
    {Py_tp_doc, "The slots of an imported object (consumer/imported._ImportedBase subclasses it)."},
    {0, NULL},
};
static PyType_Slot remembered_state_slots[] = {
    {Py_tp_new, remembered_state_new},
    {Py_tp_traverse, remembered_state_traverse},
    {Py_tp_clear, remembered_state_clear},
    {Py_tp_dealloc, remembered_state_dealloc},
    {Py_tp_members, remembered_state_members},
    {Py_tp_methods, remembered_state_methods},
    {Py_tp_doc, "What every import of a remembered message is made of (consumer/remembered.RememberedMessage "
                "subclasses it); set once."},
    {0, NULL},
};

static PyType_Spec decoded_state_spec = {
    "arrow_ipc_bridge._ffi.DecodedState", sizeof(aib_py_decoded_state), 0, STATE_FLAGS, decoded_state_slots,
};
static PyType_Spec import_state_spec = {
    "arrow_ipc_bridge._ffi.ImportState", sizeof(aib_py_import_state), 0, STATE_FLAGS, import_state_slots,
};
static PyType_Spec remembered_state_spec = {
    "arrow_ipc_bridge._ffi.RememberedState", sizeof(aib_py_remembered_state), 0, STATE_FLAGS,
    remembered_state_slots,
};

int aib_py_install_state(const char *module_name) {
  if (aib_py_decoded_state_type != NULL) return 0; /* installed already (a module imported again) */
  if (aib_py_install_type(module_name, &decoded_state_spec, NULL, &aib_py_decoded_state_type) < 0 ||
      aib_py_install_type(module_name, &import_state_spec, NULL, &aib_py_import_state_type) < 0 ||
      aib_py_install_type(module_name, &remembered_state_spec, NULL, &aib_py_remembered_state_type) < 0)
    return -1;
  return 0;
}
