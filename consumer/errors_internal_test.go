package consumer

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"syscall"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/inbox"
)

// What counts as Postgres being unavailable: the connection, never the statement.
func TestConnectionLost(t *testing.T) {
	pg := func(code string) error { return &pgconn.PgError{Severity: "ERROR", Code: code, Message: "m"} }
	for _, c := range []struct {
		name string
		err  error
		lost bool
	}{
		{"terminated backend 57P01", &pgconn.PgError{Severity: "FATAL", Code: "57P01"}, true},
		{"crash shutdown 57P02", pg("57P02"), true},
		{"idle-in-transaction timeout 25P03", &pgconn.PgError{Severity: "FATAL", Code: "25P03"}, true},
		{"idle-session timeout 57P05", &pgconn.PgError{Severity: "FATAL", Code: "57P05"}, true},
		{"starting up 57P03", pg("57P03"), true},
		{"too many connections 53300", pg("53300"), true},
		{"connection failure 08006", pg("08006"), true},
		{"wrapped by a handler", fmt.Errorf("insert order: %w", pg("08003")), true},
		{"connect error", &pgconn.ConnectError{}, true},
		{"network error", &net.OpError{Op: "read", Net: "tcp", Err: syscall.ECONNRESET}, true},
		{"unexpected EOF", fmt.Errorf("read: %w", io.ErrUnexpectedEOF), true},
		{"connection refused", fmt.Errorf("dial: %w", syscall.ECONNREFUSED), true},
		{"unique violation", pg("23505"), false},
		{"serialization failure", pg("40001"), false},
		{"lock timeout", pg("55P03"), false},
		{"undefined table", pg("42P01"), false},
		{"query canceled 57014", pg("57014"), false},
		{"context canceled", context.Canceled, false},
		{"deadline", fmt.Errorf("x: %w", context.DeadlineExceeded), false},
		{"handler error", errors.New("conn closed? no: the provider said no"), false},
		{"schema missing", inbox.ErrSchemaMissing, false},
		{"nil", nil, false},
	} {
		require.Equal(t, c.lost, connectionLost(c.err), c.name)
	}
}
