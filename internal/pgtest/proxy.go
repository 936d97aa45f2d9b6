package pgtest

import (
	"net"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// Proxy stands between a test's pool and Postgres, on a loopback port of its own.
// It can hold every chunk of bytes for half a round trip in each direction (a
// database across a network), and it can cut every connection and refuse new ones
// for a while (a restart, a failover, a partition), for this pool only: the
// tests of other packages that share the Postgres are not touched.
type Proxy struct {
	ln              net.Listener
	network, target string
	rtt             time.Duration

	mu        sync.Mutex
	live      map[net.Conn]struct{}
	downUntil time.Time
	refused   int

	wg sync.WaitGroup
}

// NewProxy starts a proxy to DATABASE_URL's Postgres that adds rtt to every round
// trip (0: none). It stops when the test ends.
func NewProxy(tb testing.TB, rtt time.Duration) *Proxy {
	tb.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		fatalf(tb, "proxy: listen: %v", err)
	}
	network, target := postgresAddr(tb)
	p := &Proxy{ln: ln, network: network, target: target, rtt: rtt, live: map[net.Conn]struct{}{}}
	p.wg.Go(p.accept)
	tb.Cleanup(func() {
		_ = ln.Close()
		p.cut()
		p.wg.Wait()
	})
	return p
}

// Pool opens a pool on schema whose connections go through the proxy (opts as for
// NewPoolWith); it closes when the test ends.
func (p *Proxy) Pool(tb testing.TB, schema string, opts Options) *pgxpool.Pool {
	tb.Helper()
	return OpenPool(tb, p.Config(tb, schema, opts))
}

// Config is PoolConfig with its connections going through the proxy; its
// ConnConfig serves a single connection (a Dispatcher's ListenConnConfig).
func (p *Proxy) Config(tb testing.TB, schema string, opts Options) *pgxpool.Config {
	tb.Helper()
	cfg := PoolConfig(tb, schema, opts)
	host, port, _ := net.SplitHostPort(p.ln.Addr().String()) // our own listener's: well formed
	n, _ := strconv.ParseUint(port, 10, 16)
	cfg.ConnConfig.Host, cfg.ConnConfig.Port, cfg.ConnConfig.Fallbacks = host, uint16(n), nil
	return cfg
}

// Outage cuts every connection through the proxy and, for d, refuses new ones (it
// accepts and closes them at once, as a server that is going down does).
func (p *Proxy) Outage(d time.Duration) {
	p.mu.Lock()
	p.downUntil = time.Now().Add(d)
	p.mu.Unlock()
	p.cut()
}

// Refused reports how many connections the proxy refused during outages.
func (p *Proxy) Refused() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.refused
}

func (p *Proxy) cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for c := range p.live {
		_ = c.Close()
	}
}

// track adds c to the live connections; false means the proxy is down.
func (p *Proxy) track(c net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if time.Now().Before(p.downUntil) {
		p.refused++
		return false
	}
	p.live[c] = struct{}{}
	return true
}

func (p *Proxy) untrack(c net.Conn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	delete(p.live, c)
}

func (p *Proxy) accept() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		if !p.track(c) {
			_ = c.Close()
			continue
		}
		p.wg.Go(func() {
			defer p.untrack(c)
			defer func() { _ = c.Close() }()
			s, err := net.Dial(p.network, p.target)
			if err != nil {
				return
			}
			if !p.track(s) {
				_ = s.Close()
				return
			}
			defer p.untrack(s)
			defer func() { _ = s.Close() }()
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

// pipe copies from src to dst, each chunk rtt/2 after it was read, keeping their
// order (bytes sent back to back arrive back to back); when either side ends, both
// are closed.
func (p *Proxy) pipe(dst, src net.Conn) {
	if p.rtt == 0 {
		buf := make([]byte, 64<<10)
		for {
			n, err := src.Read(buf)
			if n > 0 {
				if _, werr := dst.Write(buf[:n]); werr != nil {
					err = werr
				}
			}
			if err != nil {
				_ = src.Close()
				_ = dst.Close()
				return
			}
		}
	}
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

// postgresAddr is where DATABASE_URL's Postgres listens: TCP host:port, or its
// Unix socket.
func postgresAddr(tb testing.TB) (network, addr string) {
	tb.Helper()
	cfg, err := pgxpool.ParseConfig(URL())
	if err != nil {
		fatalf(tb, "parse DATABASE_URL: %v", err)
	}
	host, port := cfg.ConnConfig.Host, strconv.Itoa(int(cfg.ConnConfig.Port))
	if strings.HasPrefix(host, "/") {
		return "unix", host + "/.s.PGSQL." + port
	}
	return "tcp", net.JoinHostPort(host, port)
}
