package inboxdb

import (
	"bytes"
	"slices"
	"strings"
)

var headerNewlines = strings.NewReplacer("\r", " ", "\n", " ")

// EncodeHeader writes h as HTTP/1.1 header lines, "Name: value\r\n", sorted by
// name, values in their order: the response_headers column. CR and LF in a value
// become spaces, as net/http does when it writes a header.
func EncodeHeader(h map[string][]string) []byte {
	names := make([]string, 0, len(h))
	for name := range h {
		names = append(names, name)
	}
	slices.Sort(names)
	return AppendHeader(nil, h, names)
}

// AppendHeader appends to dst the lines EncodeHeader writes for the headers of h
// named in names, which are sorted and unique (a stored-header allow-list), so
// that storing a response's allow-listed headers needs no map of its own.
func AppendHeader(dst []byte, h map[string][]string, names []string) []byte {
	size := 0
	for _, name := range names {
		for _, v := range h[name] {
			size += len(name) + len(v) + 4
		}
	}
	if size == 0 {
		return dst
	}
	dst = slices.Grow(dst, size)
	for _, name := range names {
		for _, v := range h[name] {
			dst = append(dst, name...)
			dst = append(dst, ": "...)
			if strings.ContainsAny(v, "\r\n") {
				v = headerNewlines.Replace(v)
			}
			dst = append(dst, v...)
			dst = append(dst, "\r\n"...)
		}
	}
	return dst
}

// DecodeHeader reads what EncodeHeader wrote.
func DecodeHeader(b []byte) map[string][]string {
	h := map[string][]string{}
	for line := range bytes.SplitSeq(b, []byte("\r\n")) {
		name, value, ok := bytes.Cut(line, []byte(": "))
		if !ok {
			continue
		}
		h[string(name)] = append(h[string(name)], string(value))
	}
	return h
}
