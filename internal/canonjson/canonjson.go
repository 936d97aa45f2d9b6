// Package canonjson writes the canonical form of a JSON payload, which the
// inbox's canonical-JSON fingerprint (inbox.CanonicalJSON) and httpidem's default
// fingerprint hash: object members sorted, no whitespace, strings and numbers in one
// form, numbers by their exact decimal value. It imports nothing public of idem.
package canonjson

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
	"unicode/utf16"
	"unicode/utf8"

	"github.com/idemkit/idem/internal/errcode"
)

// ErrNotJSON is returned when the payload is not JSON. It is permanent.
var ErrNotJSON = errcode.Permanent("payload_not_json", "payload is not valid JSON (the consumer fingerprints canonical JSON)")

// Options chooses the fields the canonical form keeps. Paths are dot-separated
// object keys ("order.id"). With Include set, only those fields count; Exclude
// then removes fields from what is left. A path that is absent is ignored.
type Options struct {
	Include []string
	Exclude []string
}

// MaxDepth is the deepest nesting of arrays and objects Canonicalize accepts
// (the limit encoding/json has too).
const MaxDepth = 10000

// Canonicalize returns the canonical form of payload after the field selection in
// opts. Canonicalizing its own output returns the same bytes.
//
// The form is RFC 8785 (JCS) except for numbers: object members sorted by the
// UTF-16 code units of their names, no whitespace, strings escaped as JCS says.
// Duplicate member names, invalid UTF-8 and lone surrogates are ErrNotJSON.
//
// Numbers keep their exact decimal value. JCS would read every number as an IEEE
// double, so 9007199254740993 and 9007199254740992, or 0.1 and
// 0.10000000000000001, would come out the same, and a changed amount would pass as
// a duplicate. Here a number is written in JCS's (ECMAScript's) layout with the
// digits of its exact value: 1, 1.0, 1e0, 10e-1 and 0.1e1 are all "1"; -0 and 0e5
// are "0"; 1.50 is "1.5"; 1e2 and 100.0 are "100"; 1e21 is "1e+21"; 0.0000001 is
// "1e-7". Two numbers are equal exactly when their decimal values are equal. For
// every number that a double holds in its shortest form (what JCS prints), the
// output is byte for byte the same as JCS's, so fingerprints made by earlier
// versions stay valid. Numbers out of a double's range (1e400) are accepted.
func Canonicalize(payload []byte, opts Options) ([]byte, error) {
	if len(opts.Include) == 0 && len(opts.Exclude) == 0 && IsCanonical(payload) {
		return slices.Clone(payload), nil
	}
	return canonicalize(payload, opts)
}

// canonicalize is Canonicalize without the shortcut for canonical payloads.
func canonicalize(payload []byte, opts Options) ([]byte, error) {
	p := parser{in: payload}
	v, err := p.document()
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrNotJSON, err)
	}
	if len(opts.Include) > 0 {
		v = includePaths(v, opts.Include)
	}
	for _, path := range opts.Exclude {
		excludePath(&v, strings.Split(path, "."))
	}
	out := make([]byte, 0, len(payload))
	return v.appendTo(out), nil
}

// jsonKind is the kind of a parsed value.
type jsonKind uint8

const (
	jsonScalar jsonKind = iota // literal, number or string: text is its canonical form
	jsonArray
	jsonObject
)

// jsonValue is one parsed value. Parsing and writing are two passes, so each byte
// of the output is written once whatever the nesting.
type jsonValue struct {
	kind    jsonKind
	text    string
	elems   []jsonValue
	members []jsonMember // sorted by sortKey
}

type jsonMember struct {
	name    string
	sortKey []uint16
	value   jsonValue
}

func (v *jsonValue) appendTo(out []byte) []byte {
	switch v.kind {
	case jsonArray:
		out = append(out, '[')
		for i := range v.elems {
			if i > 0 {
				out = append(out, ',')
			}
			out = v.elems[i].appendTo(out)
		}
		return append(out, ']')
	case jsonObject:
		out = append(out, '{')
		for i := range v.members {
			if i > 0 {
				out = append(out, ',')
			}
			out = appendString(out, v.members[i].name)
			out = append(out, ':')
			out = v.members[i].value.appendTo(out)
		}
		return append(out, '}')
	}
	return append(out, v.text...)
}

func (v *jsonValue) member(name string) (*jsonValue, bool) {
	if v.kind != jsonObject {
		return nil, false
	}
	for i := range v.members {
		if v.members[i].name == name {
			return &v.members[i].value, true
		}
	}
	return nil, false
}

// set puts value under name in an object, keeping the members sorted.
func (v *jsonValue) set(name string, value jsonValue) {
	key := utf16.Encode([]rune(name))
	i, found := slices.BinarySearchFunc(v.members, key, func(m jsonMember, k []uint16) int { return slices.Compare(m.sortKey, k) })
	if found {
		v.members[i].value = value
		return
	}
	v.members = slices.Insert(v.members, i, jsonMember{name: name, sortKey: key, value: value})
}

// includePaths returns an object with only the given paths of v. A path that names
// a whole subtree wins over a longer path inside it.
func includePaths(v jsonValue, paths []string) jsonValue {
	out := jsonValue{kind: jsonObject}
	whole := map[string]bool{} // paths copied whole
	sorted := slices.Clone(paths)
	slices.SortFunc(sorted, func(a, b string) int { return len(strings.Split(a, ".")) - len(strings.Split(b, ".")) })
next:
	for _, path := range sorted {
		parts := strings.Split(path, ".")
		src := &v
		for _, k := range parts {
			var ok bool
			if src, ok = src.member(k); !ok {
				continue next
			}
		}
		dst := &out
		for i, k := range parts[:len(parts)-1] {
			if whole[strings.Join(parts[:i+1], ".")] {
				continue next
			}
			child, ok := dst.member(k)
			if !ok {
				dst.set(k, jsonValue{kind: jsonObject})
				child, _ = dst.member(k)
			}
			dst = child
		}
		dst.set(parts[len(parts)-1], *src)
		whole[path] = true
	}
	return out
}

func excludePath(v *jsonValue, parts []string) {
	for len(parts) > 1 {
		var ok bool
		if v, ok = v.member(parts[0]); !ok {
			return
		}
		parts = parts[1:]
	}
	if v.kind != jsonObject || len(parts) == 0 {
		return
	}
	v.members = slices.DeleteFunc(v.members, func(m jsonMember) bool { return m.name == parts[0] })
}

// parser reads one JSON document (RFC 8259) strictly: no trailing data, no bytes
// outside the grammar, valid UTF-8 in strings.
type parser struct {
	in    []byte
	i     int
	depth int
}

func (p *parser) document() (jsonValue, error) {
	v, err := p.value()
	if err != nil {
		return v, err
	}
	p.skipSpace()
	if p.i < len(p.in) {
		return v, fmt.Errorf("trailing data at byte %d", p.i)
	}
	return v, nil
}

func (p *parser) skipSpace() {
	for p.i < len(p.in) {
		switch p.in[p.i] {
		case ' ', '\t', '\n', '\r':
			p.i++
		default:
			return
		}
	}
}

func (p *parser) value() (jsonValue, error) {
	p.skipSpace()
	if p.i >= len(p.in) {
		return jsonValue{}, fmt.Errorf("unexpected end of input")
	}
	switch c := p.in[p.i]; {
	case c == '{':
		return p.object()
	case c == '[':
		return p.array()
	case c == '"':
		s, err := p.str()
		if err != nil {
			return jsonValue{}, err
		}
		return jsonValue{text: string(appendString(nil, s))}, nil
	case c == '-' || c >= '0' && c <= '9':
		start := p.i
		for p.i < len(p.in) && isNumberByte(p.in[p.i]) {
			p.i++
		}
		text, err := canonicalNumber(p.in[start:p.i])
		if err != nil {
			return jsonValue{}, err
		}
		return jsonValue{text: text}, nil
	default:
		for _, lit := range [...]string{"true", "false", "null"} {
			if strings.HasPrefix(string(p.in[p.i:min(len(p.in), p.i+5)]), lit) {
				p.i += len(lit)
				return jsonValue{text: lit}, nil
			}
		}
		return jsonValue{}, fmt.Errorf("unexpected byte %q at %d", c, p.i)
	}
}

func (p *parser) enter() error {
	p.depth++
	if p.depth > MaxDepth {
		return fmt.Errorf("nesting deeper than %d", MaxDepth)
	}
	return nil
}

func (p *parser) expect(c byte) error {
	p.skipSpace()
	if p.i >= len(p.in) {
		return fmt.Errorf("unexpected end of input, want %q", c)
	}
	if p.in[p.i] != c {
		return fmt.Errorf("unexpected byte %q at %d, want %q", p.in[p.i], p.i, c)
	}
	p.i++
	return nil
}

// peek returns the next byte after whitespace, or 0 at the end.
func (p *parser) peek() byte {
	p.skipSpace()
	if p.i >= len(p.in) {
		return 0
	}
	return p.in[p.i]
}

func (p *parser) array() (jsonValue, error) {
	if err := p.enter(); err != nil {
		return jsonValue{}, err
	}
	defer func() { p.depth-- }()
	p.i++ // '['
	v := jsonValue{kind: jsonArray}
	if p.peek() == ']' {
		p.i++
		return v, nil
	}
	for {
		e, err := p.value()
		if err != nil {
			return v, err
		}
		v.elems = append(v.elems, e)
		if p.peek() == ',' {
			p.i++
			continue
		}
		return v, p.expect(']')
	}
}

func (p *parser) object() (jsonValue, error) {
	if err := p.enter(); err != nil {
		return jsonValue{}, err
	}
	defer func() { p.depth-- }()
	p.i++ // '{'
	v := jsonValue{kind: jsonObject}
	if p.peek() == '}' {
		p.i++
		return v, nil
	}
	for {
		if p.peek() != '"' {
			return v, p.expect('"')
		}
		name, err := p.str()
		if err != nil {
			return v, err
		}
		if err := p.expect(':'); err != nil {
			return v, err
		}
		val, err := p.value()
		if err != nil {
			return v, err
		}
		v.members = append(v.members, jsonMember{name: name, sortKey: utf16.Encode([]rune(name)), value: val})
		if p.peek() == ',' {
			p.i++
			continue
		}
		if err := p.expect('}'); err != nil {
			return v, err
		}
		break
	}
	slices.SortFunc(v.members, func(a, b jsonMember) int { return slices.Compare(a.sortKey, b.sortKey) })
	for i := 1; i < len(v.members); i++ {
		if slices.Equal(v.members[i-1].sortKey, v.members[i].sortKey) {
			return v, fmt.Errorf("duplicate member name %s", clipQuoted(v.members[i].name))
		}
	}
	return v, nil
}

// str reads a string literal at p.i and returns its decoded value.
func (p *parser) str() (string, error) {
	p.i++ // opening quote
	var b strings.Builder
	for {
		if p.i >= len(p.in) {
			return "", fmt.Errorf("unterminated string")
		}
		c := p.in[p.i]
		switch {
		case c == '"':
			p.i++
			return b.String(), nil
		case c < 0x20:
			return "", fmt.Errorf("control byte 0x%02x in a string at %d", c, p.i)
		case c == '\\':
			if p.i+1 >= len(p.in) {
				return "", fmt.Errorf("unterminated escape")
			}
			e := p.in[p.i+1]
			p.i += 2
			switch e {
			case '"', '\\', '/':
				b.WriteByte(e)
			case 'b':
				b.WriteByte('\b')
			case 'f':
				b.WriteByte('\f')
			case 'n':
				b.WriteByte('\n')
			case 'r':
				b.WriteByte('\r')
			case 't':
				b.WriteByte('\t')
			case 'u':
				r, err := p.hex4()
				if err != nil {
					return "", err
				}
				if utf16.IsSurrogate(r) {
					if r >= 0xDC00 {
						return "", fmt.Errorf("lone low surrogate \\u%04x", r)
					}
					if p.i+1 >= len(p.in) || p.in[p.i] != '\\' || p.in[p.i+1] != 'u' {
						return "", fmt.Errorf("high surrogate \\u%04x without a low one", r)
					}
					p.i += 2
					r2, err := p.hex4()
					if err != nil {
						return "", err
					}
					if r2 < 0xDC00 || r2 > 0xDFFF {
						return "", fmt.Errorf("high surrogate \\u%04x followed by \\u%04x", r, r2)
					}
					r = utf16.DecodeRune(r, r2)
				}
				b.WriteRune(r)
			default:
				return "", fmt.Errorf("unknown escape \\%c", e)
			}
		case c < utf8.RuneSelf:
			b.WriteByte(c)
			p.i++
		default:
			r, size := utf8.DecodeRune(p.in[p.i:])
			if r == utf8.RuneError && size <= 1 {
				return "", fmt.Errorf("invalid UTF-8 at byte %d", p.i)
			}
			b.Write(p.in[p.i : p.i+size])
			p.i += size
		}
	}
}

func (p *parser) hex4() (rune, error) {
	if p.i+4 > len(p.in) {
		return 0, fmt.Errorf("short \\u escape")
	}
	n, err := strconv.ParseUint(string(p.in[p.i:p.i+4]), 16, 32)
	if err != nil {
		return 0, fmt.Errorf("bad \\u escape %q", p.in[p.i:p.i+4])
	}
	p.i += 4
	return rune(n), nil
}

// appendString writes s as JCS does: the two-character escapes for \b \t \n \f \r
// " and \, \u00xx for the other control characters, every other character as it is.
func appendString(out []byte, s string) []byte {
	const hex = "0123456789abcdef"
	out = append(out, '"')
	for i := range len(s) {
		switch c := s[i]; c {
		case '"', '\\':
			out = append(out, '\\', c)
		case '\b':
			out = append(out, '\\', 'b')
		case '\f':
			out = append(out, '\\', 'f')
		case '\n':
			out = append(out, '\\', 'n')
		case '\r':
			out = append(out, '\\', 'r')
		case '\t':
			out = append(out, '\\', 't')
		default:
			if c < 0x20 {
				out = append(out, '\\', 'u', '0', '0', hex[c>>4], hex[c&0xf])
			} else {
				out = append(out, c)
			}
		}
	}
	return append(out, '"')
}
