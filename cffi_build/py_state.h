/* The C-owned state of the objects a get makes (py_state.c): the base types whose slots hold a
 * Decoded's, an imported object's and a remembered message's attributes. The Python classes
 * (wire/metadata.Decoded, consumer/imported._ImportedBase, consumer/remembered.RememberedMessage)
 * subclass them and read the slots as ordinary attributes; C reads and fills them by offset, never
 * by name (py_local_get.c). Needs <Python.h> first. Not part of the cffi surface. */
#ifndef AIB_PY_STATE_H
#define AIB_PY_STATE_H

/* A Decoded's slots (wire/metadata.py names each attribute). */
enum {
  DS_OWNER,                 /* owner: the cffi aib_owner * (ffi.gc) this handle holds a reference on */
  DS_D,                     /* _d: the aib_decoded * */
  DS_MESSAGE,               /* _message: the bytes */
  DS_N_FDS,                 /* _n_fds */
  DS_ALLOW_PROCESS_REGIONS, /* _allow_process_regions */
  DS_READER_MAPS,           /* _reader_maps: shared by every decode sharing one (None until made) */
  DS_COUNT
};
typedef struct {
  PyObject_HEAD
  PyObject *slot[DS_COUNT];
} aib_py_decoded_state;

/* An imported object's slots (consumer/imported.py names each attribute). */
enum {
  IS_DECODED,       /* _decoded */
  IS_BASES,         /* _bases: the uint64_t[] of region bases */
  IS_N_BASES,       /* _n_bases */
  IS_DEVICE_TYPE,   /* _device_type */
  IS_DEVICE_ID,     /* _device_id */
  IS_SYNC,          /* _sync: the owner's event slot, or ffi.NULL */
  IS_NAME,          /* name */
  IS_ON_RELEASE,    /* _on_release */
  IS_OWNER_ADDRESS, /* _owner_address */
  IS_VERSION,       /* version */
  IS_PUBLISHER_ID,  /* publisher_id */
  IS_KEPT_ARRAYS,   /* _kept_arrays */
  IS_MAPPED_ON,     /* _mapped_on */
  IS_NUM_ROWS,      /* _num_rows */
  IS_COUNT
};
typedef struct {
  PyObject_HEAD
  PyObject *slot[IS_COUNT];
} aib_py_import_state;

/* A remembered message's slots (consumer/remembered.py): what every import of it is made of. Set
 * once, by the constructor, which checks their types. */
enum {
  RS_TEMPLATE,      /* template: the Decoded every import shares */
  RS_BASES,         /* bases */
  RS_N_BASES,       /* len(bases) */
  RS_DEVICE_TYPE,   /* device_type */
  RS_DEVICE_ID,     /* device_id */
  RS_IMPORTED_TYPE, /* imported_type: a subclass of ImportState */
  RS_MAPPED_ON,     /* mapped_on */
  RS_COUNT
};
typedef struct {
  PyObject_HEAD
  PyObject *slot[RS_COUNT];
} aib_py_remembered_state;

/* A new import of the remembered message hit (a new reference, or NULL with an exception set): a
 * Decoded of the template's class sharing its decode over owner (the cffi aib_owner * the import
 * holds), and an object of hit's imported_type over it with its bases, device and mapped_on, and
 * sync, name and owner_address. version, _kept_arrays and the rest stay unset (None). What
 * Session._adopt_remembered (through RememberedState.adopt) and the local getter both build with. */
PyObject *aib_py_remembered_import(aib_py_remembered_state *hit, PyObject *owner, PyObject *sync, PyObject *name,
                                   PyObject *owner_address);

/* The three types once installed (aib_py_install_state); NULL before. */
extern PyTypeObject *aib_py_decoded_state_type, *aib_py_import_state_type, *aib_py_remembered_state_type;

#endif
