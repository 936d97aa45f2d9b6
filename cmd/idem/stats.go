package main

import (
	"context"
	"flag"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

var statsCmd = &command{
	name:    "stats",
	args:    "[flags]",
	summary: "Rows and failures per consumer; pending, due, dead and oldest pending age per effect kind",
	example: `idem stats
idem stats --schema idem --json | jq '.effects[] | select(.dead > 0)'`,
	setup: func(fs *flag.FlagSet) runFunc { return runStats },
}

type consumerStatsJSON struct {
	Consumer   string     `json:"consumer"`
	Rows       int64      `json:"rows"`
	Completed  int64      `json:"completed"`
	Failed     int64      `json:"failed"`
	Processing int64      `json:"processing"`
	Expired    int64      `json:"expired"` // settled, past expires_at: the janitor's next work
	Oldest     *time.Time `json:"oldest_received_at,omitempty"`
}

type kindStatsJSON struct {
	Kind    string `json:"kind"`
	Pending int64  `json:"pending"`
	Due     int64  `json:"due"`
	Dead    int64  `json:"dead"`
	Done    int64  `json:"done"`
	// OldestPendingAge is the age of the oldest pending effect, in seconds (0 when
	// none is pending).
	OldestPendingAge float64 `json:"oldest_pending_age_seconds"`
}

type statsJSON struct {
	Schema    string              `json:"schema"`
	Consumers []consumerStatsJSON `json:"consumers"`
	Effects   []kindStatsJSON     `json:"effects"`
}

func runStats(ctx context.Context, e *env, args []string) error {
	if len(args) > 0 {
		return usagef("takes no arguments, got %q", args)
	}
	pool, err := e.connect(ctx)
	if err != nil {
		return err
	}
	q := newQueries(e.schema)
	rows, err := pool.Query(ctx, q.consumerStats)
	if err != nil {
		return err
	}
	cs, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (consumerStatsJSON, error) {
		var s consumerStatsJSON
		err := r.Scan(&s.Consumer, &s.Rows, &s.Completed, &s.Failed, &s.Processing, &s.Expired, &s.Oldest)
		return s, err
	})
	if err != nil {
		return err
	}
	rows, err = pool.Query(ctx, q.effectStats)
	if err != nil {
		return err
	}
	ks, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (kindStatsJSON, error) {
		var s kindStatsJSON
		err := r.Scan(&s.Kind, &s.Pending, &s.Due, &s.Dead, &s.Done, &s.OldestPendingAge)
		return s, err
	})
	if err != nil {
		return err
	}
	if e.json {
		return e.writeJSON(statsJSON{Schema: e.schema, Consumers: nonNil(cs), Effects: nonNil(ks)})
	}
	fmt.Fprintf(e.stdout, "Inbox (schema %s)\n", e.schema)
	if len(cs) == 0 {
		fmt.Fprintln(e.stdout, "  no rows")
	} else {
		tw := e.table("CONSUMER", "ROWS", "COMPLETED", "FAILED", "PROCESSING", "EXPIRED")
		for _, s := range cs {
			row(tw, s.Consumer, s.Rows, s.Completed, s.Failed, s.Processing, s.Expired)
		}
		if err := tw.Flush(); err != nil {
			return err
		}
	}
	fmt.Fprintln(e.stdout, "\nEffects")
	if len(ks) == 0 {
		fmt.Fprintln(e.stdout, "  no rows")
		return nil
	}
	tw := e.table("KIND", "PENDING", "DUE", "DEAD", "DONE", "OLDEST PENDING")
	for _, s := range ks {
		oldest := "-"
		if s.Pending > 0 {
			oldest = age(time.Duration(s.OldestPendingAge * float64(time.Second)))
		}
		row(tw, s.Kind, s.Pending, s.Due, s.Dead, s.Done, oldest)
	}
	return tw.Flush()
}
