package httpidem_test

import (
	"context"
	"net"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/pgtest"
)

// delayProxy forwards TCP connections to Postgres and holds every chunk of bytes,
// in each direction, for half of rtt before passing it on: a database that far
// away on the network, for the benchmark. Order is kept, and so is pipelining:
// bytes sent back to back arrive back to back, rtt later.
type delayProxy struct {
	ln              net.Listener
	network, target string
	rtt             time.Duration
	wg              sync.WaitGroup
}

func newDelayProxy(tb testing.TB, rtt time.Duration) *delayProxy {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(tb, err)
	network, target := postgresAddr(tb)
	p := &delayProxy{ln: ln, network: network, target: target, rtt: rtt}
	p.wg.Go(p.accept)
	tb.Cleanup(func() { _ = ln.Close(); p.wg.Wait() })
	return p
}

func (p *delayProxy) accept() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.wg.Go(func() {
			defer c.Close()
			s, err := net.Dial(p.network, p.target)
			if err != nil {
				return
			}
			defer s.Close()
			var wg sync.WaitGroup
			wg.Go(func() { p.pipe(s, c) })
			wg.Go(func() { p.pipe(c, s) })
			wg.Wait()
		})
	}
}

type chunk struct {
	due  time.Time
	data []byte
}

// pipe copies from src to dst, each chunk rtt/2 after it was read; when either
// side ends, both connections are closed.
func (p *delayProxy) pipe(dst, src net.Conn) {
	queue := make(chan chunk, 4096)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for ch := range queue {
			time.Sleep(time.Until(ch.due))
			if _, err := dst.Write(ch.data); err != nil {
				_ = src.Close()
				for range queue {
				}
				return
			}
		}
	}()
	buf := make([]byte, 64<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			queue <- chunk{due: time.Now().Add(p.rtt / 2), data: append([]byte(nil), buf[:n]...)}
		}
		if err != nil {
			close(queue)
			<-done
			_ = dst.Close()
			return
		}
	}
}

// poolVia is a pool on schema that reaches Postgres through proxy.
func poolVia(tb testing.TB, proxy *delayProxy, schema string, maxConns int32) *pgxpool.Pool {
	cfg, err := pgxpool.ParseConfig(pgtest.URL())
	require.NoError(tb, err)
	host, port, err := net.SplitHostPort(proxy.ln.Addr().String())
	require.NoError(tb, err)
	n, err := strconv.ParseUint(port, 10, 16)
	require.NoError(tb, err)
	cfg.ConnConfig.Host, cfg.ConnConfig.Port = host, uint16(n)
	cfg.ConnConfig.Fallbacks = nil
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	cfg.ConnConfig.RuntimeParams["application_name"] = "idem-test:" + schema
	cfg.MaxConns = maxConns
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(tb, err)
	tb.Cleanup(pool.Close)
	return pool
}

// TestDelayProxy: the proxy delays a round trip by its rtt and keeps the
// connection usable.
func TestDelayProxy(t *testing.T) {
	t.Parallel()
	_, schema := pgtest.Setup(t)
	proxy := newDelayProxy(t, 20*time.Millisecond)
	pool := poolVia(t, proxy, schema, 1)
	ctx := context.Background()
	var one int
	require.NoError(t, pool.QueryRow(ctx, `SELECT 1`).Scan(&one)) // connect
	start := time.Now()
	require.NoError(t, pool.QueryRow(ctx, `SELECT 1`).Scan(&one))
	took := time.Since(start)
	require.GreaterOrEqual(t, took, 20*time.Millisecond)
	require.Less(t, took, 2*time.Second)
}

// postgresAddr is where DATABASE_URL's Postgres listens: TCP host:port, or its
// Unix socket.
func postgresAddr(tb testing.TB) (network, addr string) {
	cfg, err := pgxpool.ParseConfig(pgtest.URL())
	require.NoError(tb, err)
	host, port := cfg.ConnConfig.Host, strconv.Itoa(int(cfg.ConnConfig.Port))
	if strings.HasPrefix(host, "/") {
		return "unix", host + "/.s.PGSQL." + port
	}
	return "tcp", net.JoinHostPort(host, port)
}
