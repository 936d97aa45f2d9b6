package inbox

import (
	"bytes"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"strings"

	"github.com/gowebpki/jcs"
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

// CanonicalJSON returns a Fingerprinter over the RFC 8785 (JCS) canonical form of a
// JSON payload: object keys sorted, whitespace gone, numbers in one form. Two payloads
// that differ only in those respects get one fingerprint. A payload that is not JSON
// fails with ErrNotJSON, a permanent error.
func CanonicalJSON(opts JSONOptions) Fingerprinter {
	return func(payload []byte) ([]byte, error) {
		canon, err := Canonicalize(payload, opts)
		if err != nil {
			return nil, err
		}
		return SHA256(canon)
	}
}

// Canonicalize returns the RFC 8785 canonical form of payload after the field
// selection in opts. Canonicalizing its own output returns the same bytes.
func Canonicalize(payload []byte, opts JSONOptions) ([]byte, error) {
	if len(opts.Include) == 0 && len(opts.Exclude) == 0 {
		out, err := jcs.Transform(payload)
		if err != nil {
			return nil, fmt.Errorf("%w: %v", ErrNotJSON, err)
		}
		return out, nil
	}

	dec := json.NewDecoder(bytes.NewReader(payload))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrNotJSON, err)
	}
	if dec.More() {
		return nil, fmt.Errorf("%w: trailing data after the JSON value", ErrNotJSON)
	}
	if len(opts.Include) > 0 {
		v = includePaths(v, opts.Include)
	}
	for _, p := range opts.Exclude {
		excludePath(v, strings.Split(p, "."))
	}
	selected, err := json.Marshal(v)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrNotJSON, err)
	}
	out, err := jcs.Transform(selected)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrNotJSON, err)
	}
	return out, nil
}

func includePaths(v any, paths []string) any {
	out := map[string]any{}
	for _, p := range paths {
		parts := strings.Split(p, ".")
		val, ok := lookup(v, parts)
		if !ok {
			continue
		}
		dst := out
		for _, k := range parts[:len(parts)-1] {
			next, ok := dst[k].(map[string]any)
			if !ok {
				next = map[string]any{}
				dst[k] = next
			}
			dst = next
		}
		dst[parts[len(parts)-1]] = val
	}
	return out
}

func lookup(v any, parts []string) (any, bool) {
	for _, k := range parts {
		m, ok := v.(map[string]any)
		if !ok {
			return nil, false
		}
		if v, ok = m[k]; !ok {
			return nil, false
		}
	}
	return v, true
}

func excludePath(v any, parts []string) {
	m, ok := v.(map[string]any)
	if !ok || len(parts) == 0 {
		return
	}
	if len(parts) == 1 {
		delete(m, parts[0])
		return
	}
	excludePath(m[parts[0]], parts[1:])
}
