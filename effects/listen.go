package effects

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/internal/effectsdb"
)

// listen wakes the claim loop on each notification for this schema. It holds one
// connection of its own, outside the pool, and reconnects when it drops; after a
// reconnect it wakes the loop once, for notifications missed meanwhile.
//
// The wait before a reconnect doubles, from listenBackoffInitial up to
// listenBackoffMax, while attempts keep failing, and starts again from the initial
// wait once a connection got as far as LISTEN: a cut of a connection that worked is
// a new incident, and every moment without LISTEN delays wake-ups (up to the poll
// interval).
func (d *dispatcher) listen(ctx context.Context) {
	wait := listenBackoffInitial
	for ctx.Err() == nil {
		listened, err := d.listenOnce(ctx)
		if ctx.Err() != nil {
			return
		}
		if listened {
			wait = listenBackoffInitial
		}
		d.log.Warn("effects dispatcher: LISTEN connection lost; polling until it is back", "error", err, "retry_in", wait)
		select {
		case <-ctx.Done():
			return
		case <-time.After(wait):
		}
		wait = min(2*wait, listenBackoffMax)
	}
}

// The LISTEN connection's reconnect backoff.
const (
	listenBackoffInitial = 100 * time.Millisecond
	listenBackoffMax     = 5 * time.Second
)

// listenOnce connects, listens and wakes the claim loop on notifications until the
// connection fails. listened reports whether it got as far as LISTEN.
func (d *dispatcher) listenOnce(ctx context.Context) (listened bool, err error) {
	cc := d.cfg.ListenConnConfig
	if cc == nil {
		cc = d.pool.Config().ConnConfig
	}
	conn, err := pgx.ConnectConfig(ctx, cc)
	if err != nil {
		return false, err
	}
	defer func() {
		cctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_ = conn.Close(cctx)
	}()
	if _, err := conn.Exec(ctx, "LISTEN "+effectsdb.NotifyChannel); err != nil {
		return false, err
	}
	d.signalWake()
	for {
		n, err := conn.WaitForNotification(ctx)
		if err != nil {
			return true, err
		}
		if n.Payload == d.cfg.Schema {
			d.signalWake()
		}
	}
}

func (d *dispatcher) refreshPendingLoop(ctx context.Context) {
	t := time.NewTicker(d.cfg.PendingRefresh)
	defer t.Stop()
	// Kinds whose gauge this loop has set: each is set on every refresh, to 0 once it
	// has no pending effects, so that no kind's gauge is left at a stale count.
	seen := map[string]bool{}
	for _, l := range d.lanes {
		seen[l.kind] = true
	}
	for {
		d.refreshPending(ctx, seen)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// refreshPending sets idem_effects_pending for every kind that has pending effects,
// whether or not this Dispatcher sends it, and to 0 for every kind in seen that has
// none (this Dispatcher's kinds, and kinds counted before). It adds the counted kinds
// to seen.
func (d *dispatcher) refreshPending(ctx context.Context, seen map[string]bool) {
	rows, err := d.pool.Query(ctx, d.q.pending)
	if err != nil {
		if ctx.Err() == nil {
			d.log.Warn("effects dispatcher: counting pending effects failed", "error", err)
		}
		return
	}
	counts := map[string]float64{}
	var kind string
	var n int64
	_, err = pgx.ForEachRow(rows, []any{&kind, &n}, func() error { counts[kind] = float64(n); return nil })
	if err != nil {
		return
	}
	for k := range counts {
		seen[k] = true
	}
	for k := range seen {
		d.m.pending.WithLabelValues(k).Set(counts[k])
	}
}
