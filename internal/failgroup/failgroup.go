// Package failgroup turns a failure's error text into the fingerprint that groups
// it with its siblings: Mask replaces the parts of the text that vary from one
// failure to the next (numbers, UUIDs, quoted values, hex) with placeholders, and
// GroupSQL is the SQL expression of the group's ID, a hash over where the failure
// happened (the consumer or the effect kind, and the tenant), its code and the
// masked text. The code that records a failed inbox key or a dead effect stores
// both, once, so that listing the groups is a GROUP BY that an index serves.
//
// One masking function serves every writer (inboxdb.Store, the consumer's batch
// claim, httpidem, the effects Dispatcher) and the operator API's backfill of rows
// written before the columns existed, so a failure lands in the same group
// whichever path wrote it. It imports only internal/text of idem.
package failgroup

import (
	"regexp"
	"strings"

	"github.com/idemkit/idem/internal/text"
)

// MaxMasked is the most bytes Mask returns: the text a group is shown with, not
// the failure's whole story (each row keeps its full error).
const MaxMasked = 1000

// Placeholders that stand where the variable parts were.
const (
	UUID   = "<uuid>"
	Hex    = "<hex>"
	Number = "<n>"
	Quoted = "…"
)

var (
	// A quoted value: "…", '…' or `…`, on one line, with backslash escapes.
	quoted = regexp.MustCompile(`"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*'|` + "`[^`\\n]*`")
	uuid   = regexp.MustCompile(`(?i)\b[0-9a-f]{8}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{12}\b`)
	// 0x… of any length, or a run of 8 or more hex digits holding a digit and a
	// letter (a hash, a trace ID): plain words such as "deadbeef" stay words, and
	// digits alone are numbers.
	hexRun = regexp.MustCompile(`(?i)\b0x[0-9a-f]+\b|\b[0-9a-f]*[0-9][0-9a-f]*\b`)
	// A number: digits, with a fraction or an exponent. Digits inside a word count
	// too ("pay_789", "v2"): an identifier's number is what varies.
	number = regexp.MustCompile(`[0-9]+(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?`)
	spaces = regexp.MustCompile(`\s+`)
)

// Mask returns s with its variable parts replaced: a quoted value keeps its quotes
// around Quoted, then UUIDs become UUID, hex runs Hex, numbers Number, and runs of
// white space one space. Two failures that differ only in those parts mask the
// same. The result is valid UTF-8 without NUL bytes, clipped after MaxMasked bytes
// (text.Clip).
func Mask(s string) string {
	s = text.Sanitize(s, 0)
	s = quoted.ReplaceAllStringFunc(s, func(q string) string { return q[:1] + Quoted + q[len(q)-1:] })
	s = uuid.ReplaceAllString(s, UUID)
	s = hexRun.ReplaceAllStringFunc(s, func(h string) string {
		if strings.HasPrefix(strings.ToLower(h), "0x") || len(h) >= 8 && strings.Trim(h, "0123456789") != "" {
			return Hex
		}
		return h // a number, or too short to tell: left to the number rule
	})
	s = number.ReplaceAllString(s, Number)
	s = strings.TrimSpace(spaces.ReplaceAllString(s, " "))
	return text.Clip(s, MaxMasked)
}

// GroupSQL is the SQL expression of a failure group's ID, given the SQL
// expressions of its place (consumer or kind), tenant, code and masked text: the
// first 8 bytes of the SHA-256 of the four, each followed by a NUL byte (which text
// never holds, so no two inputs share an encoding). A NULL code counts as "". The
// ID is computed by the database wherever it is written, so every writer agrees.
func GroupSQL(place, tenant, code, masked string) string {
	part := func(e string) string { return `convert_to(coalesce(` + e + `, ''), 'UTF8') || '\x00'::bytea` }
	return `substr(sha256(` + part(place) + ` || ` + part(tenant) + ` || ` + part(code) + ` || ` + part(masked) + `), 1, 8)`
}
