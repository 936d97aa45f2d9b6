package canonjson

import (
	"bytes"
	"unicode/utf8"
)

// IsCanonical reports whether payload is JSON already in the form Canonicalize
// writes (with no field selection), so that Canonicalize would return the same
// bytes. It reads payload once and allocates nothing. It answers false for some
// canonical payloads, which Canonicalize then reads in full: member names that are
// not printable ASCII, \u escapes, numbers with an exponent.
//
// Bodies and messages written compact with sorted keys (Go's encoding/json of a
// map, a client that sorts) are canonical, and hashing them needs no parse tree.
func IsCanonical(payload []byte) bool {
	c := canonChecker{in: payload}
	return c.value(0) && c.i == len(c.in)
}

// canonChecker reads one JSON value in the canonical form, or fails.
type canonChecker struct {
	in []byte
	i  int
}

func (c *canonChecker) at(b byte) bool { return c.i < len(c.in) && c.in[c.i] == b }

func (c *canonChecker) value(depth int) bool {
	if c.i >= len(c.in) {
		return false
	}
	switch b := c.in[c.i]; {
	case b == '{':
		return c.object(depth + 1)
	case b == '[':
		return c.array(depth + 1)
	case b == '"':
		return c.str()
	case b == '-' || b >= '0' && b <= '9':
		return c.number()
	case b == 't':
		return c.literal("true")
	case b == 'f':
		return c.literal("false")
	case b == 'n':
		return c.literal("null")
	}
	return false
}

func (c *canonChecker) literal(lit string) bool {
	if !bytes.HasPrefix(c.in[c.i:], []byte(lit)) {
		return false
	}
	c.i += len(lit)
	return true
}

func (c *canonChecker) array(depth int) bool {
	if depth > MaxDepth {
		return false
	}
	c.i++ // '['
	if c.at(']') {
		c.i++
		return true
	}
	for {
		if !c.value(depth) {
			return false
		}
		switch {
		case c.at(','):
			c.i++
		case c.at(']'):
			c.i++
			return true
		default:
			return false
		}
	}
}

// object checks an object whose member names are printable ASCII without escapes,
// in strictly increasing order: byte order is UTF-16 code unit order for them,
// and strictly increasing means no duplicates.
func (c *canonChecker) object(depth int) bool {
	if depth > MaxDepth {
		return false
	}
	c.i++ // '{'
	if c.at('}') {
		c.i++
		return true
	}
	var prev []byte
	for first := true; ; first = false {
		if !c.at('"') {
			return false
		}
		start := c.i + 1
		end := start
		for end < len(c.in) && c.in[end] != '"' {
			if b := c.in[end]; b < 0x20 || b > 0x7e || b == '\\' {
				return false
			}
			end++
		}
		if end == len(c.in) {
			return false
		}
		name := c.in[start:end]
		if !first && bytes.Compare(prev, name) >= 0 {
			return false
		}
		prev = name
		c.i = end + 1
		if !c.at(':') {
			return false
		}
		c.i++
		if !c.value(depth) {
			return false
		}
		switch {
		case c.at(','):
			c.i++
		case c.at('}'):
			c.i++
			return true
		default:
			return false
		}
	}
}

// str checks a string as appendString writes it: valid UTF-8, no control
// characters, and only the two-character escapes.
func (c *canonChecker) str() bool {
	c.i++ // opening quote
	for c.i < len(c.in) {
		switch b := c.in[c.i]; {
		case b == '"':
			c.i++
			return true
		case b < 0x20:
			return false
		case b == '\\':
			if c.i+1 >= len(c.in) {
				return false
			}
			switch c.in[c.i+1] {
			case '"', '\\', 'b', 'f', 'n', 'r', 't':
				c.i += 2
			default:
				return false // \/ is written as /, and \u is left to Canonicalize
			}
		case b < utf8.RuneSelf:
			c.i++
		default:
			r, size := utf8.DecodeRune(c.in[c.i:])
			if r == utf8.RuneError && size <= 1 {
				return false
			}
			c.i += size
		}
	}
	return false
}

// number checks a number as canonicalNumber writes it, for the forms without an
// exponent: an integer of at most 21 digits, not -0; or one with a fraction that
// does not end in 0, whose integer part has at most 21 digits, and which, below 1,
// has at most five zeros after the point.
func (c *canonChecker) number() bool {
	neg := c.at('-')
	if neg {
		c.i++
	}
	intStart := c.i
	for c.i < len(c.in) && c.in[c.i] >= '0' && c.in[c.i] <= '9' {
		c.i++
	}
	intPart := c.in[intStart:c.i]
	if len(intPart) == 0 || len(intPart) > 21 || len(intPart) > 1 && intPart[0] == '0' {
		return false
	}
	if !c.at('.') {
		if c.at('e') || c.at('E') {
			return false
		}
		return !neg || intPart[0] != '0' // -0 is written 0
	}
	c.i++
	fracStart := c.i
	for c.i < len(c.in) && c.in[c.i] >= '0' && c.in[c.i] <= '9' {
		c.i++
	}
	frac := c.in[fracStart:c.i]
	if len(frac) == 0 || frac[len(frac)-1] == '0' || c.at('e') || c.at('E') {
		return false
	}
	if intPart[0] == '0' {
		zeros := 0
		for frac[zeros] == '0' {
			zeros++
		}
		if zeros > 5 { // 0.0000001 is written 1e-7
			return false
		}
	}
	return true
}
