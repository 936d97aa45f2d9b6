package inbox

import "github.com/idemkit/idem/internal/text"

// SanitizeText returns s as text that a Postgres text column always accepts: valid
// UTF-8 without NUL bytes, each NUL byte or invalid byte written as \xNN, and at
// most maxBytes bytes (when maxBytes > 0), cut between two characters and ended
// with "…". The Store applies it to every code and error text it records.
//
// Deprecated: idem sanitises the text it stores itself (FailTx, FailLease); nothing
// else in the inbox needs it.
func SanitizeText(s string, maxBytes int) string { return text.Sanitize(s, maxBytes) }
