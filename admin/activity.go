package admin

import (
	"context"
	"slices"
	"sort"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/internal/fanout"
)

// Activity is what happened per minute over a window that ends now, read from the
// tables themselves (no Prometheus needed). Rows as they are now tell it: a key
// the janitor deleted, an effect retried since it died, drop out of their minute.
// Duplicates are not counted: a duplicate writes nothing to the tables (the
// metrics count them).
type Activity struct {
	// Now is the database's clock when the activity was read.
	Now time.Time `json:"now"`
	// Minutes are the window's minutes, oldest first, the last one the current
	// (partial) minute.
	Minutes []struct {
		// At is the minute's start.
		At time.Time `json:"at"`
		// Completed and Failed are the inbox keys settled in the minute (messages and
		// HTTP requests).
		Completed int64 `json:"completed"`
		Failed    int64 `json:"failed"`
		// Sent and Dead are the effects sent (done) and given up on (dead) in the
		// minute.
		Sent int64 `json:"sent"`
		Dead int64 `json:"dead"`
		// Pending is the backlog at the minute's end (at Now for the last one): the
		// effects enqueued and not yet sent or dead. OldestPendingSeconds is the age
		// then of the oldest of them, 0 when there were none.
		Pending              int64   `json:"pending"`
		OldestPendingSeconds float64 `json:"oldest_pending_seconds"`
	} `json:"minutes"`
}

// activityQueries renders the statements of Activity. $1 is the window's first
// minute. Each reads one range of a partial index, so its cost grows with the
// rows settled in the window, not with the table:
//   - inbox: inbox_settled_at_idx (completed_at, state) WHERE state IN
//     ('completed', 'failed'), an index-only scan from $1;
//   - sent: effects_done_at_idx (done_at) WHERE state = 'done', index-only;
//   - dead: effects_dead_at_idx (dead_at) WHERE state = 'dead', index-only;
//   - the backlog reads the effects that were pending at some time in the window:
//     those pending now (effects_due_idx, WHERE state = 'pending', whole: it is
//     the backlog), and those settled since $1 (done, dead or discarded, each
//     through its index above or effects_discarded_idx), with their created_at
//     from the heap. It returns them folded by (minute enqueued, minute settled),
//     the minutes before the window folded into one, so a big backlog comes back
//     as a few rows.
func activityQueries(q *queries, inbox, effects string) {
	q.activityInbox = `SELECT date_trunc('minute', i.completed_at),
				count(*) FILTER (WHERE i.state = 'completed'), count(*) FILTER (WHERE i.state = 'failed')
			FROM ` + inbox + ` i
			WHERE i.state IN ('completed', 'failed') AND i.completed_at >= $1
			GROUP BY 1`
	q.activityEffects = `SELECT m, sum(sent)::bigint, sum(dead)::bigint FROM (
				SELECT date_trunc('minute', e.done_at) AS m, count(*) AS sent, 0 AS dead FROM ` + effects + ` e
				WHERE e.state = 'done' AND e.done_at >= $1 GROUP BY 1
				UNION ALL
				SELECT date_trunc('minute', e.dead_at), 0, count(*) FROM ` + effects + ` e
				WHERE e.state = 'dead' AND e.dead_at >= $1 GROUP BY 1
			) x GROUP BY m`
	q.activityBacklog = `SELECT date_trunc('minute', greatest(x.created_at, $1 - interval '1 minute')), date_trunc('minute', x.settled),
				count(*), min(x.created_at)
			FROM (
				SELECT e.created_at, NULL::timestamptz AS settled FROM ` + effects + ` e WHERE e.state = 'pending'
				UNION ALL
				SELECT e.created_at, e.done_at FROM ` + effects + ` e WHERE e.state = 'done' AND e.done_at >= $1
				UNION ALL
				SELECT e.created_at, e.dead_at FROM ` + effects + ` e WHERE e.state = 'dead' AND e.dead_at >= $1
				UNION ALL
				SELECT e.created_at, coalesce(e.dead_at, e.done_at) FROM ` + effects + ` e WHERE e.state = 'discarded' AND e.done_at >= $1
			) x
			GROUP BY 1, 2`
}

// Activity returns per-minute activity over the window that ends now (from
// MinActivityWindow to MaxActivityWindow, rounded up to whole minutes): inbox keys
// completed and failed, effects sent and dead, and the pending backlog with the
// age of its oldest effect at each minute's end. It reads partial indexes only
// (see the queries), so it stays cheap on big tables.
func (a *Admin) Activity(ctx context.Context, window time.Duration) (*Activity, error) {
	if window < MinActivityWindow || window > MaxActivityWindow {
		return nil, errorf(ErrBadFilter, "activity window %s: use from %s to %s", window, MinActivityWindow, MaxActivityWindow)
	}
	res, errs := fanout.Collect(a.parts, func(_ int, p *part) (*Activity, error) { return p.activity(ctx, window) })
	if err := a.join(errs); err != nil {
		return nil, err
	}
	// The parts' activity summed minute by minute (the latest Now, the oldest
	// pending age of any part).
	out := &Activity{}
	byMinute := map[time.Time]int{} // in out.Minutes
	for _, r := range res {
		out.Now = maxTime(out.Now, r.Now)
		for _, m := range r.Minutes {
			at := m.At.UTC()
			i, ok := byMinute[at]
			if !ok {
				byMinute[at] = len(out.Minutes)
				out.Minutes = append(out.Minutes, m)
				continue
			}
			x := &out.Minutes[i]
			x.Completed += m.Completed
			x.Failed += m.Failed
			x.Sent += m.Sent
			x.Dead += m.Dead
			x.Pending += m.Pending
			x.OldestPendingSeconds = max(x.OldestPendingSeconds, m.OldestPendingSeconds)
		}
	}
	slices.SortFunc(out.Minutes, func(x, y activityMinute) int { return x.At.Compare(y.At) })
	// Shards whose clocks straddle a minute give one more minute: keep the
	// window's length, the newest minutes.
	n := int((window + time.Minute - 1) / time.Minute)
	out.Minutes = out.Minutes[max(0, len(out.Minutes)-n):]
	return out, nil
}

// activity is Activity on one database.
func (a *part) activity(ctx context.Context, window time.Duration) (*Activity, error) {
	n := int((window + time.Minute - 1) / time.Minute)
	var now, minute time.Time
	if err := a.db.QueryRow(ctx, `SELECT now(), date_trunc('minute', now())`).Scan(&now, &minute); err != nil {
		return nil, a.wrap(err)
	}
	start := minute.Add(-time.Duration(n-1) * time.Minute)
	out := &Activity{Now: now}
	out.Minutes = make([]activityMinute, n)
	for i := range out.Minutes {
		out.Minutes[i].At = start.Add(time.Duration(i) * time.Minute)
	}
	index := func(t time.Time) (int, bool) {
		i := int(t.Sub(start) / time.Minute)
		return i, i >= 0 && i < n
	}
	// The inbox's and the effects' counts per minute.
	for _, q := range []struct {
		sql  string
		a, b func(m *activityMinute) *int64
	}{
		{a.q.activityInbox, func(m *activityMinute) *int64 { return &m.Completed }, func(m *activityMinute) *int64 { return &m.Failed }},
		{a.q.activityEffects, func(m *activityMinute) *int64 { return &m.Sent }, func(m *activityMinute) *int64 { return &m.Dead }},
	} {
		rows, err := a.db.Query(ctx, q.sql, start)
		if err != nil {
			return nil, a.wrap(err)
		}
		var at time.Time
		var x, y int64
		_, err = pgx.ForEachRow(rows, []any{&at, &x, &y}, func() error {
			if i, ok := index(at); ok {
				*q.a(&out.Minutes[i]) += x
				*q.b(&out.Minutes[i]) += y
			}
			return nil
		})
		if err != nil {
			return nil, a.wrap(err)
		}
	}
	// The backlog at each minute's end: the effects enqueued before it and not
	// settled by it.
	rows, err := a.db.Query(ctx, a.q.activityBacklog, start)
	if err != nil {
		return nil, a.wrap(err)
	}
	type fold struct {
		created, settled *time.Time // minutes; settled nil while pending
		n                int64
		oldest           time.Time
	}
	var folds []fold
	var f fold
	_, err = pgx.ForEachRow(rows, []any{&f.created, &f.settled, &f.n, &f.oldest}, func() error {
		c, s := *f.created, f.settled
		if s != nil {
			v := *s
			s = &v
		}
		folds = append(folds, fold{created: &c, settled: s, n: f.n, oldest: f.oldest})
		return nil
	})
	if err != nil {
		return nil, a.wrap(err)
	}
	sort.Slice(folds, func(i, j int) bool { return folds[i].oldest.Before(folds[j].oldest) })
	for i := range out.Minutes {
		m := &out.Minutes[i]
		end := m.At.Add(time.Minute)
		at := end
		if at.After(now) {
			at = now
		}
		for _, f := range folds {
			// Enqueued in a minute before end, and not settled in a minute before it.
			if !f.created.Before(end) || f.settled != nil && f.settled.Before(end) {
				continue
			}
			if m.Pending == 0 {
				m.OldestPendingSeconds = max(0, at.Sub(f.oldest).Seconds())
			}
			m.Pending += f.n
		}
	}
	return out, nil
}

// activityMinute is the type of one of Activity.Minutes.
type activityMinute = struct {
	At                   time.Time `json:"at"`
	Completed            int64     `json:"completed"`
	Failed               int64     `json:"failed"`
	Sent                 int64     `json:"sent"`
	Dead                 int64     `json:"dead"`
	Pending              int64     `json:"pending"`
	OldestPendingSeconds float64   `json:"oldest_pending_seconds"`
}

func minTime(a, b time.Time) time.Time {
	if b.Before(a) {
		return b
	}
	return a
}

func maxTime(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}
