package effects_test

import (
	"bytes"
	"encoding/binary"
	"io"
	"net"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/pgtest"
)

// replyCutter is a TCP proxy in front of Postgres that loses a COMMIT's reply, as a
// network cut or a failover at the worst moment would: on a connection whose client
// sent the marker bytes (in a statement's text or its bind parameters), it lets the
// server run COMMIT, then closes both sides before the client has read COMMIT's
// CommandComplete. The server has committed; the client gets a broken connection and
// cannot tell.
//
// It reads the server's side as the Postgres wire protocol (a type byte and a length
// per message), so the client must not ask for TLS: poolVia turns it off.
type replyCutter struct {
	t      testing.TB
	ln     net.Listener
	target string

	mu     sync.Mutex
	marker []byte
	armed  int // connections still to cut
	conns  []net.Conn

	cut atomic.Int32 // connections cut so far
	wg  sync.WaitGroup
}

func newReplyCutter(t testing.TB) *replyCutter {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(pgtest.URL())
	require.NoError(t, err)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	p := &replyCutter{t: t, ln: ln, target: net.JoinHostPort(cfg.ConnConfig.Host, strconv.Itoa(int(cfg.ConnConfig.Port)))}
	p.wg.Go(p.accept)
	t.Cleanup(p.close)
	return p
}

// arm makes the proxy cut the next n connections whose client sends marker.
func (p *replyCutter) arm(marker string, n int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.marker, p.armed = []byte(marker), n
}

// poolVia opens a pool on schema whose connections go through the proxy.
func (p *replyCutter) poolVia(schema string, maxConns int32) *pgxpool.Pool {
	p.t.Helper()
	cfg, err := pgxpool.ParseConfig(pgtest.URL())
	require.NoError(p.t, err)
	addr := p.ln.Addr().(*net.TCPAddr)
	cfg.ConnConfig.Host, cfg.ConnConfig.Port = addr.IP.String(), uint16(addr.Port)
	cfg.ConnConfig.TLSConfig, cfg.ConnConfig.Fallbacks = nil, nil
	cfg.MaxConns = maxConns
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	cfg.ConnConfig.RuntimeParams["application_name"] = "idem-test:" + schema
	pool, err := pgxpool.NewWithConfig(p.t.Context(), cfg)
	require.NoError(p.t, err)
	p.t.Cleanup(pool.Close)
	return pool
}

func (p *replyCutter) accept() {
	for {
		client, err := p.ln.Accept()
		if err != nil {
			return
		}
		server, err := net.Dial("tcp", p.target)
		if err != nil {
			_ = client.Close()
			continue
		}
		p.mu.Lock()
		p.conns = append(p.conns, client, server)
		p.mu.Unlock()
		var doomed atomic.Bool
		p.wg.Go(func() { p.clientToServer(client, server, &doomed) })
		p.wg.Go(func() { p.serverToClient(server, client, &doomed) })
	}
}

// clientToServer forwards the client's bytes, and dooms the connection when they
// hold the marker, before forwarding them: the server cannot answer what it has not
// received, so the other direction sees doomed in time.
func (p *replyCutter) clientToServer(client, server net.Conn, doomed *atomic.Bool) {
	defer func() { _ = server.Close() }()
	buf := make([]byte, 64<<10)
	var tail []byte // the end of the previous read, for a marker split across reads
	for {
		n, err := client.Read(buf)
		if n > 0 {
			p.mu.Lock()
			if p.armed > 0 && len(p.marker) > 0 && !doomed.Load() {
				window := slices.Concat(tail, buf[:n])
				if bytes.Contains(window, p.marker) {
					p.armed--
					doomed.Store(true)
				}
				tail = window[max(0, len(window)-len(p.marker)):]
			}
			p.mu.Unlock()
			if _, werr := server.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// serverToClient forwards the server's messages one by one; on a doomed connection
// it drops COMMIT's CommandComplete and everything after it, and closes both sides.
func (p *replyCutter) serverToClient(server, client net.Conn, doomed *atomic.Bool) {
	defer func() { _ = client.Close() }()
	defer func() { _ = server.Close() }()
	var head [5]byte
	for {
		if _, err := io.ReadFull(server, head[:]); err != nil {
			return
		}
		body := make([]byte, int(binary.BigEndian.Uint32(head[1:]))-4)
		if _, err := io.ReadFull(server, body); err != nil {
			return
		}
		if head[0] == 'C' && bytes.Equal(body, []byte("COMMIT\x00")) && doomed.Load() {
			p.cut.Add(1)
			return // the deferred closes cut the connection
		}
		if _, err := client.Write(append(head[:], body...)); err != nil {
			return
		}
	}
}

func (p *replyCutter) close() {
	_ = p.ln.Close()
	p.mu.Lock()
	for _, c := range p.conns {
		_ = c.Close()
	}
	p.mu.Unlock()
	p.wg.Wait()
}
