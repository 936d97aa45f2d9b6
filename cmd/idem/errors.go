package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5/pgconn"

	"cmp"

	"github.com/idemkit/idem/admin"
	"github.com/idemkit/idem/cmd/idem/internal/scratch"
	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/janitor"
)

// Exit codes, the same for every command (docs/cli.md).
const (
	exitOK      = 0
	exitFailure = 1
	exitUsage   = 2
	// exitNoPostgres: idem could not connect to Postgres (not running, not
	// reachable, login refused, no such database).
	exitNoPostgres = 3
)

// Error codes of --json errors (the "code" field). Errors of the inbox, effects and
// admin packages bring their own codes (not_found, not_dead, lease_held,
// schema_missing, janitor_busy, …).
const (
	codeUsage       = "usage"
	codeBadDSN      = "bad_database_url"
	codeNoPostgres  = "postgres_unreachable"
	codeScratchBusy = "scratch_schema_in_use"
	codeCanceled    = "canceled"
	codeFailure     = "failure"
	// codeConfirm: a dangerous command (migrate down, forget) was neither
	// confirmed on a terminal nor given --yes; nothing was changed.
	codeConfirm = "confirmation_required"
)

// exitError carries an exit code and an error code of its own.
type exitError struct {
	code    int
	errCode string
	err     error
}

func (e *exitError) Error() string { return e.err.Error() }
func (e *exitError) Unwrap() error { return e.err }

// errorJSON is an error as --json prints it on stderr.
type errorJSON struct {
	Code     string `json:"code"`
	Message  string `json:"message"`
	Hint     string `json:"hint,omitempty"`
	ExitCode int    `json:"exit_code"`
	// Plan is what a dangerous command would have done, had it been
	// confirmed (confirmation_required).
	Plan any `json:"plan,omitempty"`
}

// printErrorJSON writes one JSON object, on one line, on stderr.
func (e *env) printErrorJSON(v errorJSON) {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	// "<subcommand>", not "\u003csubcommand\u003e": this is no HTML.
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		// A plan that does not marshal: report without it.
		v.Plan = nil
		b.Reset()
		_ = enc.Encode(v)
	}
	_, _ = e.stderr.Write(b.Bytes())
}

// confirmError: a dangerous command was not confirmed, so nothing was changed.
// plan is what it would have done: printed on stderr before the question in
// text mode, and carried in the error object with --json.
type confirmError struct {
	msg  string
	plan any
}

func (e *confirmError) Error() string { return e.msg }

// confirm is the error of an unconfirmed dangerous command.
func confirm(plan any, format string, args ...any) error {
	return &confirmError{msg: fmt.Sprintf(format, args...), plan: plan}
}

// classify gives err its exit code and its stable error code.
func classify(err error) (exit int, code string) {
	var ue *usageError
	var de *dsnError
	var ce *connectError
	var ee *exitError
	var cf *confirmError
	var coded interface{ Code() string }
	switch {
	case errors.As(err, &ue):
		return exitUsage, codeUsage
	case errors.As(err, &cf):
		return exitUsage, codeConfirm
	case errors.As(err, &de):
		return exitUsage, codeBadDSN
	case errors.As(err, &ce):
		return exitNoPostgres, codeNoPostgres
	case errors.As(err, &ee):
		return ee.code, cmp.Or(ee.errCode, codeFailure)
	case errors.Is(err, scratch.ErrInUse):
		return exitFailure, codeScratchBusy
	case errors.Is(err, context.Canceled):
		return exitFailure, codeCanceled
	case errors.Is(err, admin.ErrShardUnavailable):
		return exitNoPostgres, admin.ErrShardUnavailable.Code()
	case errors.As(err, &coded) && coded.Code() != "":
		return exitFailure, coded.Code()
	}
	return exitFailure, codeFailure
}

// report prints err (nothing when nil) as text or JSON on stderr and returns the
// exit code. The password of the DSN is masked in whatever is printed: no message
// of ours quotes it, but a driver's or a server's might.
func (e *env) report(name string, err error) int {
	if err == nil {
		return exitOK
	}
	exit, code := classify(err)
	msg := e.redactAll(err.Error())
	hint := e.redactAll(explain(err, e))
	if exit == exitUsage && code == codeUsage {
		hint = fmt.Sprintf("Run 'idem %s --help' for usage and an example.", name)
	}
	if e.json {
		out := errorJSON{Code: code, Message: msg, Hint: hint, ExitCode: exit}
		var cf *confirmError
		if errors.As(err, &cf) {
			out.Plan = cf.plan
		}
		e.printErrorJSON(out)
		return exit
	}
	fmt.Fprintf(e.stderr, "idem %s: %s\n", name, msg)
	if hint != "" {
		fmt.Fprintln(e.stderr, hint)
	}
	return exit
}

// explain says what to do next about err, or "" when there is nothing useful to
// add.
func explain(err error, e *env) string {
	var de *dsnError
	if errors.As(err, &de) {
		return `A DSN looks like postgres://USER:PASSWORD@HOST:5432/DBNAME?sslmode=disable
(or key=value form: "host=HOST port=5432 user=USER dbname=DBNAME sslmode=disable").
Pass it as --database-url or set DATABASE_URL (or the PG* variables: PGHOST, PGPORT, PGUSER, PGDATABASE, ...).`
	}
	var pgErr *pgconn.PgError
	hasPg := errors.As(err, &pgErr)
	var ce *connectError
	if errors.As(err, &ce) {
		switch {
		case hasPg && (pgErr.Code == pgerrcode.InvalidPassword || pgErr.Code == pgerrcode.InvalidAuthorizationSpecification):
			return "Postgres refused the login: check the user and password in --database-url."
		case hasPg && pgErr.Code == pgerrcode.InvalidCatalogName:
			return "That database does not exist: create it (createdb NAME) or fix the database name in --database-url."
		}
		return `Is Postgres running? Start it with:
    docker compose up -d postgres
or, on a machine with a local cluster:
    pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start
or point --database-url (or DATABASE_URL, or the PG* variables) at a server you have.`
	}
	if errors.Is(err, inbox.ErrSchemaMissing) || errors.Is(err, effects.ErrSchemaMissing) ||
		(hasPg && (pgErr.Code == pgerrcode.UndefinedTable || pgErr.Code == pgerrcode.InvalidSchemaName)) {
		return fmt.Sprintf("The idem tables are not in schema %q. Create them with:\n    idem migrate up --schema %s", e.schema, e.schema)
	}
	if errors.Is(err, janitor.ErrBusy) {
		return "Another janitor (in a consumer or dispatcher process) is running a pass on this schema and is doing the work. Try again when it is done."
	}
	return ""
}

// codedError is a message of ours that carries sentinel's code (errors.Is and the
// --json code see the sentinel; the text is ours alone).
type codedError struct {
	sentinel error
	msg      string
}

func (c *codedError) Error() string { return c.msg }
func (c *codedError) Unwrap() error { return c.sentinel }

func codedf(sentinel error, format string, args ...any) error {
	return &codedError{sentinel: sentinel, msg: fmt.Sprintf(format, args...)}
}

// usageIfBad makes a bad filter or cursor a usage error (exit 2).
func usageIfBad(err error) error {
	if isBadInput(err) {
		return usagef("%v", err)
	}
	return err
}

func isBadInput(err error) bool {
	return errors.Is(err, admin.ErrBadCursor) || errors.Is(err, admin.ErrBadFilter)
}
