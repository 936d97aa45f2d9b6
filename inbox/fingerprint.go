package inbox

import (
	"crypto/sha256"

	"github.com/idemkit/idem/internal/canonjson"
)

// A Fingerprinter turns a payload into the fingerprint stored with its key. Two
// deliveries of one key are the same command only if their fingerprints are equal.
// It sees the payload alone: metadata such as trace IDs, delivery counts and broker
// timestamps is transport, never intent, so a redelivery fingerprints the same.
type Fingerprinter func(payload []byte) ([]byte, error)

// SHA256 is the default Fingerprinter: sha256 of the raw payload bytes.
func SHA256(payload []byte) ([]byte, error) {
	sum := sha256.Sum256(payload)
	return sum[:], nil
}

// JSONOptions chooses the fields a canonical-JSON fingerprint covers. Paths are
// dot-separated object keys ("order.id"). With Include set, only those fields count;
// Exclude then removes fields from what is left. A path that is absent is ignored.
type JSONOptions struct {
	Include []string
	Exclude []string
}

// CanonicalJSON returns a Fingerprinter over the canonical form of a JSON payload
// after the field selection in opts. The form is RFC 8785 (JCS) except for
// numbers: object members sorted by the UTF-16 code units of their names, no
// whitespace, strings escaped as JCS says. Numbers keep their exact decimal value
// in JCS's layout: 1, 1.0, 1e0 and 10e-1 are one number, and 9007199254740993 is
// not 9007199254740992 (JCS would read both as one double, and a changed amount
// would pass as a duplicate). Two payloads that differ only in those respects get
// one fingerprint. Arrays and objects nest at most MaxJSONDepth deep. A payload
// that is not JSON (duplicate member names, invalid UTF-8 and lone surrogates
// included) fails with ErrNotJSON, a permanent error.
func CanonicalJSON(opts JSONOptions) Fingerprinter {
	return func(payload []byte) ([]byte, error) {
		canon, err := canonjson.Canonicalize(payload, canonjson.Options(opts))
		if err != nil {
			return nil, err
		}
		return SHA256(canon)
	}
}
