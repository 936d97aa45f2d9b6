package scratch

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/pgschema"
	"github.com/idemkit/idem/internal/redact"
)

// MarkerPrefix starts the COMMENT of every scratch schema.
const MarkerPrefix = "idem scratch schema"

// marker is the whole COMMENT, naming the tool that made the schema.
func marker(tool string) string {
	return MarkerPrefix + ", made by " + tool + ": idem demo and idem bench drop it and make it again on every run that names it"
}

// ErrInUse is returned when another run holds the schema's lock.
var ErrInUse = errors.New("scratch schema in use by another run")

// RefusedError is returned for a schema that Claim may not drop.
type RefusedError struct {
	Schema string
	// Reason says why, as a sentence fragment: "it is public", "it exists and has
	// no idem scratch marker", "objects outside it depend on it: …".
	Reason string
}

func (e *RefusedError) Error() string {
	return fmt.Sprintf("schema %q is not a scratch schema of idem's: %s", e.Schema, e.Reason)
}

// Code is the stable code of a refusal.
func (e *RefusedError) Code() string { return "scratch_refused" }

// Schema is a claimed scratch schema: fresh, empty, marked, and locked until
// Release.
type Schema struct {
	Name string
	// Reset is true when an earlier scratch schema of that name was dropped.
	Reset bool
	conn  *pgx.Conn
}

// lockSQL takes the schema's lock: one key per schema name, shared by every tool.
const lockSQL = `SELECT pg_try_advisory_lock(hashtextextended('idem.scratch:' || $1, 0))`

const unlockSQL = `SELECT pg_advisory_unlock(hashtextextended('idem.scratch:' || $1, 0))`

// inUseSQL reports whether some session holds the schema's lock.
const inUseSQL = `SELECT EXISTS (SELECT 1 FROM pg_locks
	WHERE locktype = 'advisory' AND granted AND objsubid = 1
	  AND ((classid::bigint << 32) | objid::bigint) = hashtextextended('idem.scratch:' || $1, 0))`

// dependentsSQL lists objects outside schema $1 that depend on objects inside
// it. Rules, triggers and defaults have no schema of their own; they count as
// their table's. An object of any other kind with no known schema counts as
// outside, so a dependency Claim cannot place makes it refuse rather than
// drop.
const dependentsSQL = `
WITH s AS (SELECT oid FROM pg_namespace WHERE nspname = $1),
deps AS (
	SELECT d.classid, d.objid, d.objsubid,
		(SELECT CASE d.refclassid
			WHEN 'pg_class'::regclass THEN (SELECT relnamespace FROM pg_class WHERE oid = d.refobjid)
			WHEN 'pg_type'::regclass THEN (SELECT typnamespace FROM pg_type WHERE oid = d.refobjid)
			WHEN 'pg_proc'::regclass THEN (SELECT pronamespace FROM pg_proc WHERE oid = d.refobjid)
			WHEN 'pg_constraint'::regclass THEN (SELECT connamespace FROM pg_constraint WHERE oid = d.refobjid)
		END) AS ref_ns,
		(SELECT CASE d.classid
			WHEN 'pg_class'::regclass THEN (SELECT relnamespace FROM pg_class WHERE oid = d.objid)
			WHEN 'pg_type'::regclass THEN (SELECT typnamespace FROM pg_type WHERE oid = d.objid)
			WHEN 'pg_proc'::regclass THEN (SELECT pronamespace FROM pg_proc WHERE oid = d.objid)
			WHEN 'pg_constraint'::regclass THEN (SELECT connamespace FROM pg_constraint WHERE oid = d.objid)
			WHEN 'pg_rewrite'::regclass THEN (SELECT c.relnamespace FROM pg_rewrite r JOIN pg_class c ON c.oid = r.ev_class WHERE r.oid = d.objid)
			WHEN 'pg_trigger'::regclass THEN (SELECT c.relnamespace FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid WHERE t.oid = d.objid)
			WHEN 'pg_attrdef'::regclass THEN (SELECT c.relnamespace FROM pg_attrdef a JOIN pg_class c ON c.oid = a.adrelid WHERE a.oid = d.objid)
			WHEN 'pg_policy'::regclass THEN (SELECT c.relnamespace FROM pg_policy p JOIN pg_class c ON c.oid = p.polrelid WHERE p.oid = d.objid)
		END) AS obj_ns
	FROM pg_depend d
	WHERE d.deptype IN ('n', 'a')
)
SELECT DISTINCT (pg_identify_object(classid, objid, objsubid)).identity
FROM deps, s
WHERE deps.ref_ns = s.oid AND deps.obj_ns IS DISTINCT FROM s.oid
ORDER BY 1
LIMIT 10`

// Claim locks schema for this run and makes it a fresh, empty scratch schema:
// created and marked if it does not exist, dropped and made again if it carries
// the marker, refused (*RefusedError) otherwise. ErrInUse means another run holds
// it. tool names the caller in the marker ("idem demo"). Release the schema when
// the run ends; its tables stay for inspection until the next Claim.
func Claim(ctx context.Context, databaseURL, schema, tool string) (*Schema, error) {
	if err := pgschema.Validate(schema); err != nil {
		return nil, err
	}
	switch {
	case schema == "public":
		return nil, &RefusedError{schema, "it is public, the database's default schema"}
	case schema == inbox.DefaultSchema:
		return nil, &RefusedError{schema, "it is idem's default schema, where a real deployment keeps its tables"}
	case schema == "information_schema" || strings.HasPrefix(schema, "pg_"):
		return nil, &RefusedError{schema, "it belongs to Postgres"}
	}
	cfg, err := pgx.ParseConfig(databaseURL)
	if err != nil {
		return nil, redact.Error(err, databaseURL)
	}
	cfg.RuntimeParams["application_name"] = "idem-scratch-lock:" + schema
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return nil, redact.Error(err, databaseURL)
	}
	s := &Schema{Name: schema, conn: conn}
	if err := s.claim(ctx, tool); err != nil {
		_ = conn.Close(context.WithoutCancel(ctx))
		return nil, redact.Error(err, databaseURL)
	}
	return s, nil
}

func (s *Schema) claim(ctx context.Context, tool string) error {
	var locked bool
	if err := s.conn.QueryRow(ctx, lockSQL, s.Name).Scan(&locked); err != nil {
		return fmt.Errorf("lock schema %s: %w", s.Name, err)
	}
	if !locked {
		return fmt.Errorf("%w: schema %s", ErrInUse, s.Name)
	}
	q := pgx.Identifier{s.Name}.Sanitize()
	return pgx.BeginFunc(ctx, s.conn, func(tx pgx.Tx) error {
		var comment *string
		err := tx.QueryRow(ctx, `SELECT obj_description(oid, 'pg_namespace') FROM pg_namespace WHERE nspname = $1`, s.Name).Scan(&comment)
		switch {
		case errors.Is(err, pgx.ErrNoRows):
		case err != nil:
			return err
		case comment == nil || !strings.HasPrefix(*comment, MarkerPrefix):
			return &RefusedError{s.Name, "it exists and has no idem scratch marker, so it was not made by idem demo or idem bench"}
		default:
			rows, err := tx.Query(ctx, dependentsSQL, s.Name)
			if err != nil {
				return fmt.Errorf("look for objects that depend on schema %s: %w", s.Name, err)
			}
			outside, err := pgx.CollectRows(rows, pgx.RowTo[string])
			if err != nil {
				return fmt.Errorf("look for objects that depend on schema %s: %w", s.Name, err)
			}
			if len(outside) > 0 {
				return &RefusedError{s.Name, "objects outside it depend on it and would be dropped with it: " + strings.Join(outside, ", ")}
			}
			if _, err := tx.Exec(ctx, `DROP SCHEMA `+q+` CASCADE`); err != nil {
				return fmt.Errorf("drop scratch schema %s: %w", s.Name, err)
			}
			s.Reset = true
		}
		if _, err := tx.Exec(ctx, `CREATE SCHEMA `+q); err != nil {
			return fmt.Errorf("create scratch schema %s: %w", s.Name, err)
		}
		if _, err := tx.Exec(ctx, `COMMENT ON SCHEMA `+q+` IS `+quoteLiteral(marker(tool))); err != nil {
			return fmt.Errorf("mark scratch schema %s: %w", s.Name, err)
		}
		return nil
	})
}

// Release gives up the schema's lock and closes its connection. The schema and
// its tables stay.
func (s *Schema) Release() {
	if s == nil || s.conn == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	// Unlock before closing: a closed connection's session ends a moment later on
	// the server, and the next run must not see the lock still held.
	_, _ = s.conn.Exec(ctx, unlockSQL, s.Name)
	_ = s.conn.Close(ctx)
	s.conn = nil
}

// InUse reports whether some run holds schema's lock now.
func InUse(ctx context.Context, db interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}, schema string) (bool, error) {
	var held bool
	err := db.QueryRow(ctx, inUseSQL, schema).Scan(&held)
	return held, err
}

// IsScratch reports whether schema exists and carries the scratch marker.
func IsScratch(ctx context.Context, db interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}, schema string) (bool, error) {
	var ok bool
	err := db.QueryRow(ctx, `SELECT coalesce(obj_description(oid, 'pg_namespace') LIKE $2 || '%', false)
		FROM pg_namespace WHERE nspname = $1`, schema, MarkerPrefix).Scan(&ok)
	if errors.Is(err, pgx.ErrNoRows) {
		return false, nil
	}
	return ok, err
}

// quoteLiteral quotes a constant string for SQL (COMMENT takes no parameters).
func quoteLiteral(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }
