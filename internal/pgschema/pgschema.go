// Package pgschema is what every idem package knows about the Postgres schema that
// holds idem's tables: its default name, the rule a name must follow, how it is
// quoted into SQL, and the two errors about it (an invalid name, and tables or
// columns that are not there because the migrations have not run). It imports
// nothing public of idem (only its error type), so every package can use it.
package pgschema

import (
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/internal/errcode"
)

// Default is the schema idem uses unless told otherwise.
const Default = "idem"

var (
	// ErrInvalid is returned when a schema name is not a plain lower-case
	// identifier (^[a-z_][a-z0-9_]{0,62}$).
	ErrInvalid = errcode.Permanent("invalid_schema", "schema must match ^[a-z_][a-z0-9_]{0,62}$")
	// ErrMissing is returned when idem's tables, or a column a newer migration
	// adds, do not exist in the schema: the migrations have not run. It is not
	// permanent: a message is nacked, and works once the schema exists.
	ErrMissing = errcode.Transient("schema_missing", "idem's tables, or a newer migration of them, are missing: run `idem migrate up` (or migrate.Migrator.Up) first")
)

// Valid reports whether name follows the rule ^[a-z_][a-z0-9_]{0,62}$, without the
// cost of a regular expression (the effects' write path checks it per call).
func Valid(name string) bool {
	if len(name) == 0 || len(name) > 63 {
		return false
	}
	for i := range len(name) {
		c := name[i]
		switch {
		case 'a' <= c && c <= 'z', c == '_':
		case i > 0 && '0' <= c && c <= '9':
		default:
			return false
		}
	}
	return true
}

// Validate returns ErrInvalid, with the name, unless name is valid. idem quotes the
// name in SQL as well, but a plain identifier keeps the name the same in psql, in
// logs and in a user's own tools.
func Validate(name string) error {
	if !Valid(name) {
		return fmt.Errorf("%w: got %q", ErrInvalid, name)
	}
	return nil
}

// Quote returns name quoted as an SQL identifier.
func Quote(name string) string { return pgx.Identifier{name}.Sanitize() }

// Table returns schema.table, both quoted.
func Table(schema, table string) string { return pgx.Identifier{schema, table}.Sanitize() }

// Wrap turns the errors that mean "the migrations have not run" into ErrMissing,
// naming the schema and keeping the driver's error text: a missing table (42P01), a
// missing schema (3F000), or a missing column (42703; idem's statements name only
// idem's columns, so the schema lacks a newer migration that this binary needs).
// Other errors, and nil, come back as they are.
func Wrap(err error, schema string) error {
	switch SQLState(err) {
	case "42P01", "3F000":
		return fmt.Errorf("%w (schema %q): %v", ErrMissing, schema, err)
	case "42703":
		return fmt.Errorf("%w (schema %q lacks a column of a newer migration): %v", ErrMissing, schema, err)
	}
	return err
}

// SQLState is the SQLSTATE of a Postgres error in err's chain, or "".
func SQLState(err error) string {
	var pgErr interface{ SQLState() string }
	if errors.As(err, &pgErr) {
		return pgErr.SQLState()
	}
	return ""
}

// ValidateDB checks the database a config hands over, the same way in every idem
// package: Pool is required (its zero value, a nil pointer or interface, is
// refused) and Schema must be a valid name.
func ValidateDB[P comparable](pool P, schema string) error {
	var none P
	if pool == none {
		return errcode.InvalidConfig("Pool is required")
	}
	return Validate(schema)
}
