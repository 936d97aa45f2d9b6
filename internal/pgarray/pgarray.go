// Package pgarray holds array arguments that pgx encodes with no allocation per
// element, for idem's set-based statements (one array per column, hundreds of
// elements a statement). pgx encodes a []string or [][]byte element by element,
// each boxed in an interface (a string or slice header copied to the heap; a
// [][]byte goes through reflection). These types hand pgx a pointer to each
// element instead, which boxes for free, and whose pointer type implements pgx's
// TextValuer, BytesValuer or Int64Valuer, so the element codec reads it without
// boxing it again. They encode as text[], bytea[] and int8[] in every pgx query
// mode: where pgx knows no parameter types (exec and simple-protocol mode), each
// is a driver.Valuer that gives pgx's own text form of the plain slice. A nil
// slice is a NULL array.
//
// It imports nothing of idem.
package pgarray

import (
	"database/sql/driver"
	"sync"

	"github.com/jackc/pgx/v5/pgtype"
)

// textForm is the text form pgx gives v as the array type oid, for the query
// modes that send parameters as text with no type: one map, since a
// pgtype.Map is not safe for concurrent use and this is not the hot path.
func textForm(oid uint32, v any) (driver.Value, error) {
	textMu.Lock()
	defer textMu.Unlock()
	if textMap == nil {
		textMap = pgtype.NewMap()
	}
	buf, err := textMap.Encode(oid, pgtype.TextFormatCode, v, nil)
	if err != nil || buf == nil {
		return nil, err
	}
	return string(buf), nil
}

var (
	textMu  sync.Mutex
	textMap *pgtype.Map
)

// dims is the one dimension of an array of n elements.
func dims[T any](s []T) []pgtype.ArrayDimension {
	if s == nil {
		return nil
	}
	return []pgtype.ArrayDimension{{Length: int32(len(s)), LowerBound: 1}}
}

// Text is a text[] argument.
type Text []string

// Dimensions implements pgtype.ArrayGetter.
func (a Text) Dimensions() []pgtype.ArrayDimension { return dims(a) }

// Index implements pgtype.ArrayGetter.
func (a Text) Index(i int) any { return (*text)(&a[i]) }

// IndexType implements pgtype.ArrayGetter.
func (a Text) IndexType() any { return (*text)(nil) }

// Value implements driver.Valuer, for the query modes that know no types.
func (a Text) Value() (driver.Value, error) {
	if a == nil {
		return nil, nil
	}
	return textForm(pgtype.TextArrayOID, []string(a))
}

type text string

func (t *text) TextValue() (pgtype.Text, error) {
	return pgtype.Text{String: string(*t), Valid: true}, nil
}

// Bytea is a bytea[] argument; a nil element is NULL.
type Bytea [][]byte

// Dimensions implements pgtype.ArrayGetter.
func (a Bytea) Dimensions() []pgtype.ArrayDimension { return dims(a) }

// Index implements pgtype.ArrayGetter.
func (a Bytea) Index(i int) any { return (*bytea)(&a[i]) }

// IndexType implements pgtype.ArrayGetter.
func (a Bytea) IndexType() any { return (*bytea)(nil) }

// Value implements driver.Valuer, for the query modes that know no types.
func (a Bytea) Value() (driver.Value, error) {
	if a == nil {
		return nil, nil
	}
	return textForm(pgtype.ByteaArrayOID, [][]byte(a))
}

type bytea []byte

func (b *bytea) BytesValue() ([]byte, error) { return *b, nil }

// Int8 is an int8[] (bigint[]) argument.
type Int8 []int64

// Dimensions implements pgtype.ArrayGetter.
func (a Int8) Dimensions() []pgtype.ArrayDimension { return dims(a) }

// Index implements pgtype.ArrayGetter.
func (a Int8) Index(i int) any { return (*int8Elem)(&a[i]) }

// IndexType implements pgtype.ArrayGetter.
func (a Int8) IndexType() any { return (*int8Elem)(nil) }

// Value implements driver.Valuer, for the query modes that know no types.
func (a Int8) Value() (driver.Value, error) {
	if a == nil {
		return nil, nil
	}
	return textForm(pgtype.Int8ArrayOID, []int64(a))
}

type int8Elem int64

func (n *int8Elem) Int64Value() (pgtype.Int8, error) {
	return pgtype.Int8{Int64: int64(*n), Valid: true}, nil
}
