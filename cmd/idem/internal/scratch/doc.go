// Package scratch gives idem's own tools (idem demo, idem bench) schemas to drop
// and fill, and keeps them from dropping or emptying anyone else's.
//
// What it guarantees:
//
//   - Claim drops a schema only if it carries the scratch marker, a COMMENT that
//     Claim writes in the same transaction that creates the schema. Any other
//     existing schema is refused with a *RefusedError, and so are public, the
//     default idem schema, information_schema and the pg_ schemas, marker or not.
//   - A scratch schema that objects outside it depend on (a user's view over the
//     demo's ledger, a foreign key into it) is refused too: DROP ... CASCADE would
//     take those objects with it.
//   - A session advisory lock on the schema name, taken before anything else and
//     held on a connection of its own until Release, keeps two runs out of one
//     schema: the second gets ErrInUse and changes nothing.
//
// What it does not guarantee: a user who writes the marker onto a schema by hand
// has declared it scratch. The lock lives as long as its connection; a run whose
// lock connection is cut goes on without it.
package scratch
