package metricsaudit

import (
	"context"
	"errors"
	"maps"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/admin"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/httpidem"
	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/janitor"
	"github.com/idemkit/idem/shard"
)

// The names the components are built with. The dashboard's variables select
// them, and its literal label values must match series they create.
const (
	consumerName = "payments"
	operation    = "POST /payments"
)

var kinds = []string{"email", "webhook"}

// world is every idem component, built on one registry, before any work.
type world struct {
	schema   string
	families map[string]*dto.MetricFamily
}

// build makes a consumer (with a Name), a Dispatcher (with two kinds), a janitor,
// an httpidem middleware (with a route that names its operation) and the operator
// API's failure metrics (naming the consumer and the kinds) on one
// registry, and gathers it without sending, consuming or deleting anything.
func build(t *testing.T) world {
	t.Helper()
	pool, schema := pgtest.Setup(t)
	return buildOn(t, schema, func(cfg any) {
		switch c := cfg.(type) {
		case *consumer.Config:
			c.Pool, c.Schema = pool, schema
		case *effects.Config:
			c.Pool, c.Schema = pool, schema
		case *janitor.Config:
			c.Pool, c.Schema = pool, schema
		case *httpidem.Config:
			c.Pool, c.Schema = pool, schema
		case *admin.Config:
			c.Pool, c.Schema = pool, schema
		}
	})
}

// buildSharded is build over a map of the shard clusters (one schema name on each).
func buildSharded(t *testing.T) (world, *shard.Map) {
	t.Helper()
	m := pgtest.Shards(t)
	tenant := func(*http.Request) (string, error) { return "t", nil }
	return buildOn(t, m.Shards[0].Schema, func(cfg any) {
		switch c := cfg.(type) {
		case *consumer.Config:
			c.Shards, c.Tenant = m, consumer.MetadataKey("tenant")
		case *effects.Config:
			c.Shards = m
		case *janitor.Config:
			c.Shards = m
		case *httpidem.Config:
			c.Shards, c.Tenant, c.Unscoped = m, tenant, false
		case *admin.Config:
			c.Shards = m
		}
	}), m
}

// buildOn builds every component, each config completed by where (its database).
func buildOn(t *testing.T, schema string, where func(cfg any)) world {
	t.Helper()
	reg := prometheus.NewRegistry()

	ccfg := consumer.Config{Name: consumerName, Registerer: reg}
	where(&ccfg)
	c, err := consumer.New(ccfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })

	senders := map[string]effects.Sender{}
	for _, k := range kinds {
		senders[k] = effects.SenderFunc(func(context.Context, effects.Delivery) error {
			return errors.New("the audit sends nothing")
		})
	}
	ecfg := effects.Config{Senders: senders, Registerer: reg}
	where(&ecfg)
	_, err = effects.NewDispatcher(ecfg)
	require.NoError(t, err)

	jcfg := janitor.Config{Registerer: reg}
	where(&jcfg)
	_, err = janitor.New(jcfg)
	require.NoError(t, err)

	hcfg := httpidem.Config{Unscoped: true, Registerer: reg}
	where(&hcfg)
	mw, err := httpidem.New(hcfg)
	require.NoError(t, err)
	mw.Route(httpidem.Route{Operation: operation})(http.NotFoundHandler())

	acfg := admin.Config{Registerer: reg, Consumers: []string{consumerName}, Kinds: kinds}
	where(&acfg)
	_, err = admin.New(acfg)
	require.NoError(t, err)

	mfs, err := reg.Gather()
	require.NoError(t, err)
	w := world{schema: schema, families: map[string]*dto.MetricFamily{}}
	for _, mf := range mfs {
		w.families[mf.GetName()] = mf
	}
	return w
}

// ownerLabel is the label that tells one component's series from another's, by
// family prefix, and the values the components above were built with.
func (w world) ownerLabel(family string) (string, []string) {
	switch {
	case strings.HasPrefix(family, "idem_inbox_"):
		return "consumer", []string{consumerName}
	case strings.HasPrefix(family, "idem_effects_"):
		return "kind", kinds
	case strings.HasPrefix(family, "idem_janitor_"):
		return "schema", []string{w.schema}
	case strings.HasPrefix(family, "idem_http_"):
		return "operation", []string{operation}
	case strings.HasPrefix(family, "idem_failures_"):
		return "action", []string{admin.ActionRetry, admin.ActionDiscard, admin.ActionRelease}
	}
	return "", nil
}

func TestEverySeriesExistsAtZeroBeforeAnyWork(t *testing.T) {
	t.Parallel()
	w := build(t)
	readme := readmeMetricNames(t)

	for _, name := range specMetrics {
		_, ok := w.families[name]
		require.True(t, ok, "DESIGN.md's Observability section names %s, but no component registers it before any work", name)
	}
	for _, name := range readme {
		if strings.HasPrefix(name, kafkaPrefix) {
			continue // the Kafka Subscriber's: TestKafkaSubscriberMetricsAreDocumented
		}
		_, ok := w.families[name]
		require.True(t, ok, "docs/observability.md's Metrics table names %s, but no component registers it before any work", name)
	}
	require.NotEmpty(t, w.families)
	for name, mf := range w.families {
		require.True(t, strings.HasPrefix(name, "idem_"), "%s: only idem's families are on this registry", name)
		require.Contains(t, readme, name, "%s is registered but missing from docs/observability.md's Metrics table", name)

		label, values := w.ownerLabel(name)
		require.NotEmpty(t, label, "%s: no component owns this prefix; teach ownerLabel about it", name)
		seen := map[string]bool{}
		for _, m := range mf.GetMetric() {
			requireZero(t, name, mf.GetType(), m)
			for _, lp := range m.GetLabel() {
				if lp.GetName() == label {
					seen[lp.GetValue()] = true
				}
			}
		}
		for _, v := range values {
			require.True(t, seen[v], "%s has no series with %s=%q before any work: a dashboard or an alert would see no data until the first event", name, label, v)
		}
	}
}

// Over a shard map, every family of the single-database audit is there, at 0
// before any work, and each of its series carries a shard label: every owner
// value has a series on every shard.
func TestShardedSeriesCarryTheShard(t *testing.T) {
	t.Parallel()
	single := build(t)
	w, m := buildSharded(t)
	require.Equal(t, slices.Sorted(maps.Keys(single.families)), slices.Sorted(maps.Keys(w.families)),
		"the same families over a shard map as on one database")
	for name, mf := range w.families {
		label, values := w.ownerLabel(name)
		seen := map[string]bool{}
		for _, one := range mf.GetMetric() {
			requireZero(t, name, mf.GetType(), one)
			got := map[string]string{}
			for _, lp := range one.GetLabel() {
				got[lp.GetName()] = lp.GetValue()
			}
			require.Contains(t, m.Names(), got["shard"], "%s%v: every series names its shard", name, one.GetLabel())
			seen[got["shard"]+"/"+got[label]] = true
		}
		for _, s := range m.Names() {
			for _, v := range values {
				require.True(t, seen[s+"/"+v], "%s has no series with shard=%q, %s=%q before any work", name, s, label, v)
			}
		}
	}
}

// requireZero fails unless m, a sample of family name, is at 0.
func requireZero(t *testing.T, name string, typ dto.MetricType, m *dto.Metric) {
	t.Helper()
	labels := m.GetLabel()
	switch typ {
	case dto.MetricType_COUNTER:
		require.Zero(t, m.GetCounter().GetValue(), "%s%v", name, labels)
	case dto.MetricType_GAUGE:
		require.Zero(t, m.GetGauge().GetValue(), "%s%v", name, labels)
	case dto.MetricType_HISTOGRAM:
		require.Zero(t, m.GetHistogram().GetSampleCount(), "%s%v", name, labels)
		require.Zero(t, m.GetHistogram().GetSampleSum(), "%s%v", name, labels)
	default:
		t.Fatalf("%s: type %s; teach requireZero about it", name, typ)
	}
}

var metricName = regexp.MustCompile("idem_[a-z0-9_]+")

// readmeMetricNames are the families in the first column of the table in the
// "## Metrics" section of the guide's observability page (docs/observability.md).
func readmeMetricNames(t *testing.T) []string {
	t.Helper()
	body, err := os.ReadFile(filepath.Join(repoRoot, "docs", "observability.md"))
	require.NoError(t, err)
	section := markdownSection(t, string(body), "## Metrics")
	var names []string
	for _, line := range strings.Split(section, "\n") {
		if !strings.HasPrefix(line, "| `idem_") {
			continue
		}
		first := strings.Split(line, "|")[1]
		names = append(names, metricName.FindString(first))
	}
	require.NotEmpty(t, names, "docs/observability.md's Metrics section has no table of idem_ metrics")
	sort.Strings(names)
	return slices.Compact(names)
}

// specMetrics are the families DESIGN.md's Observability section names: the spec
// lives outside the repository, so its list is kept here, and a family the spec
// asks for cannot leave the code and the docs together unnoticed.
var specMetrics = []string{
	"idem_effects_attempts_total", "idem_effects_dead_total", "idem_effects_lag_seconds",
	"idem_effects_pending", "idem_inbox_duplicate_age_seconds", "idem_inbox_duplicates_total",
	"idem_inbox_expired_retry_total", "idem_inbox_failed_total", "idem_inbox_fingerprint_mismatch_total",
	"idem_inbox_lock_wait_seconds", "idem_inbox_processed_total",
}

// markdownSection is the text under heading, up to the next heading of the same
// or a higher level.
func markdownSection(t *testing.T, doc, heading string) string {
	t.Helper()
	level := strings.Index(heading, " ") // "### Metrics" -> 3
	var out []string
	in := false
	for _, line := range strings.Split(doc, "\n") {
		if in && strings.HasPrefix(line, "#") {
			if n := len(line) - len(strings.TrimLeft(line, "#")); n <= level {
				break
			}
		}
		if line == heading {
			in = true
			continue
		}
		if in {
			out = append(out, line)
		}
	}
	require.True(t, in, "no %q heading", heading)
	return strings.Join(out, "\n")
}
