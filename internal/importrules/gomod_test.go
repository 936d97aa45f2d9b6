package importrules_test

import (
	"os"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// brokerWords name a broker client, an embedded broker server or a test broker
// in a module path (segmentio/kafka-go, nats.go, nats-server, watermill-nats,
// franz-go, kfake): modules only the adapter modules (adapters/kafka,
// adapters/nats), the tools and the examples may require.
var brokerWords = []string{"kafka", "nats", "franz-go", "kfake"}

// requires returns the module paths a go.mod requires, direct and indirect, from
// its require blocks and single-line require directives.
func requires(gomod string) []string {
	var paths []string
	block := false
	for _, line := range strings.Split(gomod, "\n") {
		line, _, _ = strings.Cut(line, "//")
		fields := strings.Fields(line)
		switch {
		case len(fields) == 0:
		case block && fields[0] == ")":
			block = false
		case block:
			paths = append(paths, fields[0])
		case fields[0] == "require" && len(fields) > 1 && fields[1] == "(":
			block = true
		case fields[0] == "require" && len(fields) > 1:
			paths = append(paths, fields[1])
		}
	}
	return paths
}

// brokerRequires returns the modules a go.mod requires whose path names a broker.
func brokerRequires(gomod string) []string {
	var bad []string
	for _, path := range requires(gomod) {
		for _, word := range brokerWords {
			if strings.Contains(path, word) {
				bad = append(bad, path)
				break
			}
		}
	}
	return bad
}

// TestCoreModuleRequiresNoBroker: the library module's go.mod (the repository's
// root) requires no broker module, so a user's module graph gets none with the
// library; the adapters are modules of their own that bring their client.
func TestCoreModuleRequiresNoBroker(t *testing.T) {
	t.Parallel()
	gomod, err := os.ReadFile("../../go.mod")
	require.NoError(t, err)
	require.Equal(t, "module "+module, strings.SplitN(string(gomod), "\n", 2)[0], "../../go.mod is the library's")
	require.Contains(t, requires(string(gomod)), "github.com/jackc/pgx/v5", "the parser reads the library's requirements")
	require.Empty(t, brokerRequires(string(gomod)),
		"the library's go.mod requires a broker module: the code that needs it belongs in adapters/kafka or adapters/nats (modules of their own); run scripts/tidy")
}

// TestBrokerRequiresCatchesEachForm: a broker module required in a block, as an
// indirect requirement or on a single require line is found.
func TestBrokerRequiresCatchesEachForm(t *testing.T) {
	t.Parallel()
	gomod := `module github.com/idemkit/idem

go 1.26.0

require (
	github.com/jackc/pgx/v5 v5.12.0
	github.com/segmentio/kafka-go v0.4.51
)

require (
	github.com/nats-io/nuid v1.0.1 // indirect
	github.com/twmb/franz-go/pkg/kfake v0.0.0-20260918054303-01f206a7e32c // indirect
)

require github.com/ThreeDotsLabs/watermill-nats/v2 v2.1.3

require github.com/twmb/franz-go v1.22.2 // kafka
`
	require.Equal(t, []string{
		"github.com/segmentio/kafka-go",
		"github.com/nats-io/nuid",
		"github.com/twmb/franz-go/pkg/kfake",
		"github.com/ThreeDotsLabs/watermill-nats/v2",
		"github.com/twmb/franz-go",
	}, brokerRequires(gomod))
	require.Empty(t, brokerRequires("module x\n\nrequire github.com/jackc/pgx/v5 v5.12.0 // kafka-go replaced\n"),
		"a comment is not a requirement")
}
