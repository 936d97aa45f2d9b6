package pgarray_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/pgarray"
	"github.com/idemkit/idem/internal/pgtest"
)

// TestRoundTrip: each type reaches Postgres as the array it stands for, with
// NULL elements and NULL arrays, in every pgx query mode.
func TestRoundTrip(t *testing.T) {
	t.Parallel()
	_, schema := pgtest.Setup(t, pgtest.Options{NoMigrate: true, MaxConns: 1})
	texts := pgarray.Text{"a", "", "quote'\"{},\\ x", "ünï"}
	byteas := pgarray.Bytea{[]byte{0, 1, 255}, nil, {}, []byte("x")}
	ints := pgarray.Int8{0, -1, 1 << 40}
	for _, mode := range pgtest.QueryExecModes {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			pool := pgtest.NewPoolWith(t, schema, pgtest.Options{MaxConns: 1, QueryExecMode: mode})
			ctx := context.Background()
			var gotT []string
			var gotB [][]byte
			var gotI []int64
			var nullT, nullB, nullI bool
			var lenB int
			err := pool.QueryRow(ctx, `SELECT $1::text[], $2::bytea[], $3::int8[], array_length($2::bytea[], 1),
					$4::text[] IS NULL, $5::bytea[] IS NULL, $6::int8[] IS NULL`,
				texts, byteas, ints, pgarray.Text(nil), pgarray.Bytea(nil), pgarray.Int8(nil)).
				Scan(&gotT, &gotB, &gotI, &lenB, &nullT, &nullB, &nullI)
			require.NoError(t, err)
			require.Equal(t, []string(texts), gotT)
			require.Equal(t, 4, lenB)
			require.Equal(t, []byte{0, 1, 255}, gotB[0])
			require.Nil(t, gotB[1], "a nil element is NULL")
			require.NotNil(t, gotB[2], "an empty element is not NULL")
			require.Empty(t, gotB[2])
			require.Equal(t, []int64(ints), gotI)
			require.True(t, nullT && nullB && nullI, "a nil slice is a NULL array")
		})
	}
}

// TestEncodeAllocatesPerArray: encoding in the binary format (every query mode
// but exec and simple protocol) costs a few allocations an array, not one an
// element, where a plain []string costs one an element.
func TestEncodeAllocatesPerArray(t *testing.T) {
	m := pgtype.NewMap()
	n := 256
	texts, byteas, ints := make(pgarray.Text, n), make(pgarray.Bytea, n), make(pgarray.Int8, n)
	for i := range n {
		texts[i], byteas[i], ints[i] = fmt.Sprint("key-", i), []byte{byte(i)}, int64(i)<<20
	}
	buf := make([]byte, 0, 64<<10)
	for _, c := range []struct {
		oid uint32
		v   any
	}{{pgtype.TextArrayOID, texts}, {pgtype.ByteaArrayOID, byteas}, {pgtype.Int8ArrayOID, ints}} {
		allocs := testing.AllocsPerRun(20, func() {
			_, err := m.Encode(c.oid, pgx.BinaryFormatCode, c.v, buf[:0])
			require.NoError(t, err)
		})
		require.LessOrEqual(t, allocs, 4.0, "%T", c.v)
	}
	plain := testing.AllocsPerRun(20, func() { _, _ = m.Encode(pgtype.TextArrayOID, pgx.BinaryFormatCode, []string(texts), buf[:0]) })
	require.Greater(t, plain, float64(n), "a plain []string costs an allocation an element")
}
