package migrate

import (
	"regexp"
	"testing"

	"github.com/stretchr/testify/require"
)

// Every table a migration creates is dropped by its down file, named with the
// schema marker, so PlanDown can show it with its rows before anything is dropped.
func TestDownFilesNameEveryTableTheirUpCreates(t *testing.T) {
	created := regexp.MustCompile(`(?i)\bCREATE\s+TABLE\s+(?:IF\s+NOT\s+EXISTS\s+)?/\* schema \*/([a-z0-9_]+)`)
	for _, mig := range Migrations() {
		dropped := droppedTables(mig.Down)
		for _, m := range created.FindAllStringSubmatch(mig.Up, -1) {
			require.Contains(t, dropped, m[1], "migration %03d_%s: its down file does not drop table %s", mig.Version, mig.Name, m[1])
		}
	}
	require.Equal(t, []string{"a", "b", "c"}, droppedTables("DROP TABLE /* schema */a;\ndrop table if exists /* schema */b, /* schema */c;"))
}
