package inboxdb

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// TestAppendHeader: the lines of an allow-list are those EncodeHeader writes for
// the same headers, CR and LF in values made spaces.
func TestAppendHeader(t *testing.T) {
	h := map[string][]string{"Location": {"/p/1"}, "Content-Type": {"application/json"}, "Link": {"<a>", "<b>\r\nX: y"},
		"Set-Cookie": {"s=1"}, "Etag": {}}
	allow := []string{"Content-Type", "Etag", "Link", "Location"}
	kept := map[string][]string{"Location": h["Location"], "Content-Type": h["Content-Type"], "Link": h["Link"]}
	require.Equal(t, EncodeHeader(kept), AppendHeader(nil, h, allow))
	require.Equal(t, "Content-Type: application/json\r\nLink: <a>\r\nLink: <b>  X: y\r\nLocation: /p/1\r\n", string(AppendHeader(nil, h, allow)))
	require.Nil(t, AppendHeader(nil, h, []string{"Vary"}), "nothing to store: NULL, as an empty map encodes")
	clean := map[string][]string{"Location": {"/p/1"}, "Link": {"<a>", "<b>"}}
	require.Equal(t, clean, DecodeHeader(AppendHeader(nil, clean, allow)), "DecodeHeader reads it back")
}
