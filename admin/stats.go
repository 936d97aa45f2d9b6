package admin

import (
	"context"
	"maps"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/internal/fanout"
)

// Stats is the state of one schema's tables.
type Stats struct {
	// Shard is the shard of one of Stats.Shards.
	Shard  string `json:"shard,omitempty"`
	Schema string `json:"schema"`
	// Error says why the shard of one of Stats.Shards did not answer; its figures
	// are then empty.
	Error     string          `json:"error,omitempty"`
	Consumers []ConsumerStats `json:"consumers"`
	Effects   []KindStats     `json:"effects"`
	// Shards are each shard's own figures, and which shard did not answer (an
	// Admin over a shard map; the figures above are their sums).
	Shards []Stats `json:"shards,omitempty"`
}

// Up says whether the shard of one of Stats.Shards answered.
func (s *Stats) Up() bool { return s.Error == "" }

// ConsumerStats counts one consumer's inbox rows by state.
type ConsumerStats struct {
	Consumer   string `json:"consumer"`
	Rows       int64  `json:"rows"`
	Completed  int64  `json:"completed"`
	Failed     int64  `json:"failed"`
	Processing int64  `json:"processing"`
	// Expired rows are settled and past expires_at: the janitor's next work.
	Expired int64 `json:"expired"`
	// Oldest is when the oldest row was received.
	Oldest *time.Time `json:"oldest_received_at,omitempty"`
	// OldestProcessingSeconds is the age of the oldest processing row (lease mode),
	// in seconds; 0 when none.
	OldestProcessingSeconds float64 `json:"oldest_processing_age_seconds"`
}

// KindStats counts one effect kind's rows by state.
type KindStats struct {
	Kind    string `json:"kind"`
	Pending int64  `json:"pending"`
	// Due are pending effects whose due time has come.
	Due  int64 `json:"due"`
	Dead int64 `json:"dead"`
	Done int64 `json:"done"`
	// Discarded are dead effects an operator discarded (DiscardGroup): never
	// sent, deleted by the janitor after the retention.
	Discarded int64 `json:"discarded"`
	// InFlight are pending effects claimed by a dispatcher, outcome not recorded yet.
	InFlight int64 `json:"in_flight"`
	// Stuck are pending effects that look stuck (see Effect.Stuck).
	Stuck int64 `json:"stuck"`
	// OldestPendingSeconds is the age of the oldest pending effect, in seconds
	// (0 when none is pending).
	OldestPendingSeconds float64 `json:"oldest_pending_age_seconds"`
}

// OldestPendingAge is OldestPendingSeconds as a duration.
func (k KindStats) OldestPendingAge() time.Duration {
	return time.Duration(k.OldestPendingSeconds * float64(time.Second))
}

// Stats counts the inbox rows per consumer and state, and the effects per kind and
// state, with the age of the oldest pending one. It scans both tables.
//
// Over a shard map the figures are the shards' sums, and Stats.Shards lists each
// shard's own; a shard that does not answer is marked there, and the others'
// figures come back together with its error.
func (a *Admin) Stats(ctx context.Context) (*Stats, error) {
	res, errs := fanout.Collect(a.parts, func(_ int, p *part) (*Stats, error) { return p.stats(ctx) })
	out := &Stats{Schema: a.Schema(), Consumers: []ConsumerStats{}, Effects: []KindStats{}}
	consumers := map[string]*ConsumerStats{}
	kinds := map[string]*KindStats{}
	for i, st := range res {
		if name := a.parts.Name(i); name != "" {
			ss := Stats{Shard: name, Schema: a.parts.Part(i).cfg.Schema, Consumers: []ConsumerStats{}, Effects: []KindStats{}}
			if errs[i] != nil {
				ss.Error = errs[i].Error()
			} else {
				ss.Consumers, ss.Effects = st.Consumers, st.Effects
			}
			out.Shards = append(out.Shards, ss)
		}
		if errs[i] != nil {
			continue
		}
		for _, c := range st.Consumers {
			m := consumers[c.Consumer]
			if m == nil {
				m = &ConsumerStats{Consumer: c.Consumer}
				consumers[c.Consumer] = m
			}
			m.Rows += c.Rows
			m.Completed += c.Completed
			m.Failed += c.Failed
			m.Processing += c.Processing
			m.Expired += c.Expired
			if c.Oldest != nil && (m.Oldest == nil || c.Oldest.Before(*m.Oldest)) {
				m.Oldest = c.Oldest
			}
			m.OldestProcessingSeconds = max(m.OldestProcessingSeconds, c.OldestProcessingSeconds)
		}
		for _, k := range st.Effects {
			m := kinds[k.Kind]
			if m == nil {
				m = &KindStats{Kind: k.Kind}
				kinds[k.Kind] = m
			}
			m.Pending += k.Pending
			m.Due += k.Due
			m.Dead += k.Dead
			m.Done += k.Done
			m.Discarded += k.Discarded
			m.InFlight += k.InFlight
			m.Stuck += k.Stuck
			m.OldestPendingSeconds = max(m.OldestPendingSeconds, k.OldestPendingSeconds)
		}
	}
	for _, name := range slices.Sorted(maps.Keys(consumers)) {
		out.Consumers = append(out.Consumers, *consumers[name])
	}
	for _, name := range slices.Sorted(maps.Keys(kinds)) {
		out.Effects = append(out.Effects, *kinds[name])
	}
	err := a.join(errs)
	if err != nil && len(out.Shards) == 0 {
		return nil, err // no shard list says which part failed: no figures
	}
	return out, err
}

func (a *part) stats(ctx context.Context) (*Stats, error) {
	rows, err := a.db.Query(ctx, a.q.consumerStats)
	if err != nil {
		return nil, a.wrap(err)
	}
	cs, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (ConsumerStats, error) {
		var s ConsumerStats
		err := r.Scan(&s.Consumer, &s.Rows, &s.Completed, &s.Failed, &s.Processing, &s.Expired, &s.Oldest, &s.OldestProcessingSeconds)
		return s, err
	})
	if err != nil {
		return nil, a.wrap(err)
	}
	rows, err = a.db.Query(ctx, a.q.effectStats, a.cfg.StuckAfter, a.cfg.StuckAttempts)
	if err != nil {
		return nil, a.wrap(err)
	}
	ks, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (KindStats, error) {
		var s KindStats
		err := r.Scan(&s.Kind, &s.Pending, &s.Due, &s.Dead, &s.Done, &s.Discarded, &s.InFlight, &s.Stuck, &s.OldestPendingSeconds)
		return s, err
	})
	if err != nil {
		return nil, a.wrap(err)
	}
	return &Stats{Schema: a.cfg.Schema, Consumers: nonNil(cs), Effects: nonNil(ks)}, nil
}
