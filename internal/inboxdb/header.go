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
	var b bytes.Buffer
	for _, name := range names {
		for _, v := range h[name] {
			b.WriteString(name)
			b.WriteString(": ")
			b.WriteString(headerNewlines.Replace(v))
			b.WriteString("\r\n")
		}
	}
	return b.Bytes()
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
