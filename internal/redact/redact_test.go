package redact_test

import (
	"errors"
	"fmt"
	"net/url"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/redact"
)

func TestDSN(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ in, want string }{
		{"postgres://app:s3cret@db:5432/app?sslmode=disable", "postgres://app:xxxxx@db:5432/app?sslmode=disable"},
		{"postgresql://app:p%40ss%2Fw@db/app", "postgresql://app:xxxxx@db/app"},
		{"postgres://app@db/app?password=s3cret&sslmode=disable", "postgres://app@db/app?password=xxxxx&sslmode=disable"},
		{"postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable", "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"},
		{"host=db user=app password=s3cret dbname=app", "host=db user=app password=xxxxx dbname=app"},
		{"host=db user=app password='s3 cr\\'et' dbname=app", "host=db user=app password=xxxxx dbname=app"},
		{"host=db user=app dbname=app", "host=db user=app dbname=app"},
	} {
		require.Equal(t, c.want, redact.DSN(c.in), c.in)
	}
}

// Text hides the password wherever a message quotes it, in any spelling, even
// when the DSN itself does not parse.
func TestText(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ dsn, secret string }{
		{"postgres://app:s3cret-pw@127.0.0.1:1/app?sslmode=disable", "s3cret-pw"},
		{"postgres://app:p%40ss%2Fword@127.0.0.1:1/app", "p@ss/word"},
		{"postgres://app@127.0.0.1:1/app?sslpassword=k3y-pw", "k3y-pw"},
		{"host=127.0.0.1 port=1 user=app password='s3 cr3t' dbname=app", "s3 cr3t"},
		{"postgres://app:br0ken-pw@[::1/app", "br0ken-pw"}, // unparsable
	} {
		msg := fmt.Sprintf("cannot connect with %s (password %s, escaped %s %s)", c.dsn, c.secret, url.QueryEscape(c.secret), url.PathEscape(c.secret))
		got := redact.Text(msg, c.dsn)
		require.NotContains(t, got, c.secret, got)
		require.NotContains(t, got, url.QueryEscape(c.secret), got)
		require.NotContains(t, got, url.PathEscape(c.secret), got)
		require.Contains(t, got, redact.Mask)
	}
	require.Equal(t, "nothing to hide", redact.Text("nothing to hide", "postgres://u@h/db"))
}

func TestTextReadsPGPASSWORD(t *testing.T) {
	t.Setenv("PGPASSWORD", "from-env-pw")
	require.Equal(t, "auth as u with xxxxx failed", redact.Text("auth as u with from-env-pw failed", "postgres://u@127.0.0.1:1/db"))
}

func TestErrorKeepsTheChain(t *testing.T) {
	t.Parallel()
	base := errors.New("dial postgres://u:hunter2@h/db: refused")
	err := redact.Error(fmt.Errorf("open: %w", base), "postgres://u:hunter2@h/db")
	require.NotContains(t, err.Error(), "hunter2")
	require.ErrorIs(t, err, base)
	require.NoError(t, redact.Error(nil, "postgres://u:hunter2@h/db"))
	plain := errors.New("plain")
	require.Same(t, plain, redact.Error(plain, "postgres://u:hunter2@h/db"))
}
