package janitor_test

import (
	"context"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/idemkit/idem/janitor"
)

// docInProcessJanitor is the guide's snippet (docs/retention.md) of a janitor
// in a service's main: compiled with the tests, not run.
func docInProcessJanitor(ctx context.Context, pool *pgxpool.Pool, logger *slog.Logger, reg prometheus.Registerer) error {
	j, err := janitor.New(janitor.Config{
		Pool: pool, Schema: "idem", Interval: time.Minute,
		Logger: logger, Registerer: reg,
	})
	if err != nil {
		return err
	}
	go func() { _ = j.Run(ctx) }() // logs a failed pass and goes on; returns nil when ctx ends
	return nil
}

var _ = docInProcessJanitor
