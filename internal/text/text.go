// Package text makes arbitrary strings safe to store and show: Storable says
// whether the text columns of Postgres take a string as it is, Sanitize makes it
// so, Clip makes a bounded excerpt. Neither ever cuts a UTF-8
// character in half. It imports nothing of idem.
package text

import (
	"strings"
	"unicode/utf8"
)

// ellipsis ends text that was cut.
const ellipsis = "…"

// Storable reports whether a Postgres text column accepts s as it is: valid UTF-8
// without NUL bytes. idem refuses keys, tenants and names that are not, rather
// than change them.
func Storable(s string) bool {
	return utf8.ValidString(s) && strings.IndexByte(s, 0) < 0
}

// Sanitize returns s as text that a Postgres text column always accepts: valid
// UTF-8 without NUL bytes. Use it wherever an error (a handler's, a sender's, a
// panic value, a quoted binary response body) becomes stored text: one NUL byte or
// invalid UTF-8 sequence would otherwise make Postgres reject the whole statement
// (SQLSTATE 22021), losing every row written with it.
//
// A NUL byte becomes the four characters \x00, and each byte that is not part of a
// valid UTF-8 sequence becomes \xNN, so the text keeps saying what was there. When
// maxBytes > 0 the result is at most maxBytes bytes long: it is cut between two
// characters (never inside an escape or a multi-byte character) and ends in "…".
func Sanitize(s string, maxBytes int) string {
	if Storable(s) && (maxBytes <= 0 || len(s) <= maxBytes) {
		return s
	}
	const hex = "0123456789abcdef"
	room := maxBytes // the most text before the ellipsis, if one is needed
	if maxBytes > len(ellipsis) {
		room -= len(ellipsis)
	}
	var b strings.Builder
	fit := 0 // b.Len() at the last character boundary within room
	for i := 0; i < len(s); {
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == 0 || r == utf8.RuneError && size == 1 {
			b.Write([]byte{'\\', 'x', hex[s[i]>>4], hex[s[i]&0xf]})
		} else {
			b.WriteString(s[i : i+size])
		}
		i += size
		if maxBytes > 0 {
			if b.Len() <= room {
				fit = b.Len()
			}
			if b.Len() > maxBytes {
				break // it will not fit whole
			}
		}
	}
	out := b.String()
	if maxBytes <= 0 || len(out) <= maxBytes {
		return out
	}
	if maxBytes > len(ellipsis) {
		return out[:fit] + ellipsis
	}
	return out[:fit]
}

// Clip returns s if it is at most n bytes long; otherwise its first n bytes or
// fewer, cut at a character boundary, followed by "…". Bytes that are not valid
// UTF-8 are kept as they are (Sanitize first for text that must be valid).
func Clip(s string, n int) string {
	if len(s) <= n {
		return s
	}
	cut := max(n, 0)
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + ellipsis
}
