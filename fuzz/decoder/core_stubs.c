/* What the wire_*.c files need from owner.c, without Python: the harness links the decoder, the layout rules,
 * the content checks and base.c alone. Owners here only count references (the harness checks that every
 * rebuilt tree gives its references back). */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

struct aib_owner {
  int64_t refs;
};

atomic_llong aib_node_counter;

aib_owner *aib_owner_new(uint64_t token) {
  (void)token;
  aib_owner *o = calloc(1, sizeof(*o));
  if (o != NULL) o->refs = 1;
  return o;
}
void aib_owner_ref(aib_owner *owner) {
  if (owner != NULL) owner->refs++;
}
void aib_owner_unref(aib_owner *owner) {
  if (owner != NULL && --owner->refs == 0) free(owner);
}
int aib_owner_hold_decoded(aib_owner *owner, aib_decoded *decoded, void (*release)(aib_decoded *)) {
  (void)owner;
  (void)decoded;
  (void)release;
  return AIB_E_STATE; /* the harness never attaches a decode to an owner */
}
