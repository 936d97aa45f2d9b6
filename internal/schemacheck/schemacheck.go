// Package schemacheck is the check that consumer.New, effects.NewDispatcher and
// httpidem.New run once at start: the schema holds idem's tables at the newest
// migration this build knows, on one database or on every shard of a map. It reads
// Postgres's catalog (pg_class, pg_attribute, pg_proc), not a migration tool's
// version table, so a schema that goose, golang-migrate or idem's own migrator
// made passes alike.
//
// The constructors take no context, so the check bounds itself: it gives up after
// Timeout. A database that does not answer (a refused or broken connection, or a
// server that is starting or shutting down) is tried again within that time, so a
// process that starts while Postgres restarts comes up once Postgres is back. After
// Timeout, the one database of a config without shards fails the constructor with
// ErrUnavailable (nothing could be served; the process's supervisor starts it
// again), while a shard of a map is logged and left out of the check: the other
// shards are served, as when a shard goes down later, and the shard's own
// messages are nacked until it is back. A server that answers is not tried again:
// its answer stands.
//
// It imports nothing public of idem, so every package can use it.
package schemacheck

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/internal/errcode"
	"github.com/idemkit/idem/internal/pgschema"
)

// Timeout bounds the whole check, every shard included (they are checked at once).
const Timeout = 10 * time.Second

// retryEvery is the pause between two tries at a database that does not answer.
const retryEvery = 250 * time.Millisecond

var (
	// ErrUnavailable is returned when no database answered within Timeout. Its code
	// is the one the consumer and httpidem give a database that is down.
	ErrUnavailable = errcode.Transient("database_unavailable",
		"Postgres did not answer the start-up check of idem's schema within "+Timeout.String()+
			"; start again once it is up (the constructor fails rather than start unchecked)")
	// ErrCatalog is returned when the role may not read Postgres's catalog. Grant it
	// (SELECT on pg_catalog.pg_class, pg_namespace, pg_attribute and pg_proc, which
	// every role has unless revoked), or set SkipSchemaCheck in the config.
	ErrCatalog = errcode.Permanent("schema_check_refused",
		"the role may not read Postgres's catalog, so idem cannot check its schema at start: grant SELECT on pg_catalog.pg_class, pg_namespace, pg_attribute and pg_proc, or set SkipSchemaCheck in the config")
)

// Beginner starts a transaction: *pgxpool.Pool, *pgx.Conn, and the consumer's
// Beginner all do.
type Beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// probe is one catalog object that a migration leaves behind: a relation (table or
// index), a column of a relation, or, with absent, a function it drops.
type probe struct {
	rel, col, fn string
	absent       bool
}

// probes are, for each migration version in order (index 0 is 001), the objects
// that show it applied. A test applies the migrations one at a time and checks that
// these find exactly the level, so a new migration needs its probes here.
var probes = [][]probe{
	{{rel: "inbox"}, {rel: "effects"}},                                         // 001_core
	{{rel: "effects", col: "tenant"}, {rel: "effects", col: "recorded_fence"}}, // 002_effects_tenant
	{{rel: "inbox", col: "response_status"}},                                   // 003_http_responses
	{{rel: "commit_guard"}, {fn: "idem_commit_guard"}},                         // 004_commit_guard
	{{rel: "effects", col: "trace_context"}},                                   // 005_trace_context
	{{rel: "failure_actions"}, {rel: "effects", col: "dead_at"}},               // 006_failure_groups
	{{rel: "inbox_settled_at_idx"}, {rel: "effects_dead_at_idx"}},              // 007_activity
	{{fn: "idem_effects_notify", absent: true}},                                // 008_explicit_notify
}

// Versions is the number of migrations the check knows: the newest version this
// build needs.
func Versions() int { return len(probes) }

// query answers whether the schema exists, and one bool a probe, in order.
var query = func() string {
	var b strings.Builder
	b.WriteString(`SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = $1), ARRAY[`)
	first := true
	for _, ps := range probes {
		for _, p := range ps {
			if !first {
				b.WriteString(", ")
			}
			first = false
			switch {
			case p.fn != "":
				if p.absent {
					b.WriteString("NOT ")
				}
				b.WriteString(`EXISTS (SELECT 1 FROM pg_catalog.pg_proc p JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace
					WHERE n.nspname = $1 AND p.proname = '` + p.fn + `')`)
			case p.col != "":
				b.WriteString(`EXISTS (SELECT 1 FROM pg_catalog.pg_attribute a JOIN pg_catalog.pg_class c ON c.oid = a.attrelid
					JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
					WHERE n.nspname = $1 AND c.relname = '` + p.rel + `' AND a.attname = '` + p.col + `' AND NOT a.attisdropped)`)
			default:
				b.WriteString(`EXISTS (SELECT 1 FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
					WHERE n.nspname = $1 AND c.relname = '` + p.rel + `')`)
			}
		}
	}
	b.WriteString(`]`)
	return b.String()
}()

// Level reads the newest migration applied to schema, as the catalog shows it:
// the number of versions, from 001 on, whose objects are all there (0 when the
// schema does not exist or holds none of idem's tables). exists says whether the
// schema exists.
func Level(ctx context.Context, db Beginner, schema string) (level int, exists bool, err error) {
	var found []bool
	err = pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		return tx.QueryRow(ctx, query, schema).Scan(&exists, &found)
	})
	if err != nil {
		return 0, false, err
	}
	i := 0
	for _, ps := range probes {
		ok := true
		for range ps {
			ok = ok && found[i]
			i++
		}
		if !ok {
			break
		}
		level++
	}
	return level, exists, nil
}

// A Target is one database to check: a shard's (Shard is its name) or, with Shard
// empty, the one database of a config without shards.
type Target struct {
	Shard  string
	DB     Beginner
	Schema string
}

// Start checks the schemas of a constructor's config at start, every target at
// once. It does nothing when skip is set. The error wraps pgschema.ErrMissing
// (code schema_missing) and names the schema, the missing versions and the
// command that applies them; ErrUnavailable when the database of a target without
// a Shard name did not answer within Timeout (a shard that did not answer is
// logged on log, and is no error); ErrCatalog when the role may not read the
// catalog. It names each shard that failed.
func Start(skip bool, log *slog.Logger, targets []Target) error {
	if skip {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), Timeout)
	defer cancel()
	errs := make([]error, len(targets))
	var wg sync.WaitGroup
	for i, t := range targets {
		wg.Go(func() {
			err := one(ctx, t.DB, t.Schema)
			if err != nil && t.Shard != "" {
				if errors.Is(err, ErrUnavailable) {
					log.Warn("idem: a shard did not answer the start-up check of its schema; starting without it: its messages wait until it is back, and find its schema then",
						"shard", t.Shard, "schema", t.Schema, "err", err)
					return
				}
				err = fmt.Errorf("shard %q: %w", t.Shard, err)
			}
			errs[i] = err
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

// one checks one database, trying again while it does not answer.
func one(ctx context.Context, db Beginner, schema string) error {
	for {
		level, exists, err := Level(ctx, db, schema)
		switch {
		case err == nil:
			return levelError(schema, level, exists)
		case pgschema.SQLState(err) == "42501":
			return fmt.Errorf("%w (schema %q): %v", ErrCatalog, schema, err)
		case !unreachable(err):
			return fmt.Errorf("check idem's schema %q at start: %w", schema, err)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%w (schema %q): %v", ErrUnavailable, schema, err)
		case <-time.After(retryEvery):
		}
	}
}

// unreachable reports whether err means that the database did not answer: no
// SQLSTATE (the connection failed or broke), a connection exception (class 08), or
// a server starting up or shutting down (57P01 to 57P03).
func unreachable(err error) bool {
	state := pgschema.SQLState(err)
	return state == "" || strings.HasPrefix(state, "08") || strings.HasPrefix(state, "57P")
}

// levelError is nil at the newest level, and otherwise says what is missing and
// what to run.
func levelError(schema string, level int, exists bool) error {
	newest := len(probes)
	if level >= newest {
		return nil
	}
	fix := "run `idem migrate up --schema " + schema + "` (or migrate.Migrator.Up, or your migration tool with idem's files)"
	switch {
	case !exists:
		return fmt.Errorf("%w: schema %q does not exist: %s", pgschema.ErrMissing, schema, fix)
	case level == 0:
		return fmt.Errorf("%w: schema %q holds none of idem's tables: %s", pgschema.ErrMissing, schema, fix)
	}
	missing := make([]string, 0, newest-level)
	for v := level + 1; v <= newest; v++ {
		missing = append(missing, fmt.Sprintf("%03d", v))
	}
	return fmt.Errorf("%w: schema %q is at migration %03d, and this build of idem needs %03d: %s not applied: %s",
		pgschema.ErrMissing, schema, level, newest, strings.Join(missing, ", "), fix)
}
