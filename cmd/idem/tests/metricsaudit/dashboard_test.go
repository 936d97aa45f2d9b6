package metricsaudit

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/grafana/grafana-foundation-sdk/go/cog"
	"github.com/grafana/grafana-foundation-sdk/go/cog/plugins"
	"github.com/grafana/grafana-foundation-sdk/go/dashboard"
	"github.com/grafana/grafana-foundation-sdk/go/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"
)

// repoRoot is the repository's root, from this package's folder.
const repoRoot = "../../../.."

var dashboardPath = filepath.Join(repoRoot, "docs/grafana/idem-dashboard.json")

// registerPlugins registers the SDK's panel and query schemas once: the SDK keeps
// them in a package-level runtime that it replaces without a lock, so parallel
// tests must not register them at the same moment.
var registerPlugins = sync.OnceFunc(plugins.RegisterDefaultPlugins)

// loadDashboard decodes the dashboard strictly: an unknown or mistyped field, a
// missing required one, or a panel option or query field that the panel's or the
// data source's schema does not have fails. It returns the dashboard and, by
// panel id, each panel's raw JSON.
func loadDashboard(t *testing.T) (*dashboard.Dashboard, map[uint32]json.RawMessage) {
	t.Helper()
	raw, err := os.ReadFile(dashboardPath)
	require.NoError(t, err)
	registerPlugins() // panel and query schemas, for the strict decoding
	var d dashboard.Dashboard
	require.NoError(t, d.UnmarshalJSONStrict(raw), "%s does not fit Grafana's dashboard schema", dashboardPath)
	require.NoError(t, d.Validate())

	var rawPanels []json.RawMessage
	require.NoError(t, json.Unmarshal(mustField(t, raw, "panels"), &rawPanels))
	byID := map[uint32]json.RawMessage{}
	for _, rp := range rawPanels {
		var p struct {
			ID     uint32            `json:"id"`
			Panels []json.RawMessage `json:"panels"`
		}
		require.NoError(t, json.Unmarshal(rp, &p))
		byID[p.ID] = rp
		for _, nested := range p.Panels {
			require.NoError(t, json.Unmarshal(nested, &p))
			byID[p.ID] = nested
		}
	}
	return &d, byID
}

func mustField(t *testing.T, raw []byte, name string) json.RawMessage {
	t.Helper()
	var m map[string]json.RawMessage
	require.NoError(t, json.Unmarshal(raw, &m))
	require.Contains(t, m, name)
	return m[name]
}

// panels flattens the dashboard's panels, rows' nested panels included, and
// returns the rows apart.
func panels(d *dashboard.Dashboard) (ps []*dashboard.Panel, rows []*dashboard.RowPanel) {
	for _, pr := range d.Panels {
		switch {
		case pr.Panel != nil:
			ps = append(ps, pr.Panel)
		case pr.RowPanel != nil:
			rows = append(rows, pr.RowPanel)
			for i := range pr.RowPanel.Panels {
				ps = append(ps, &pr.RowPanel.Panels[i])
			}
		}
	}
	return ps, rows
}

func TestDashboardFitsGrafanasSchema(t *testing.T) {
	t.Parallel()
	d, rawByID := loadDashboard(t)
	require.NotNil(t, d.Uid)
	require.NotNil(t, d.Title)
	ps, rows := panels(d)
	require.NotEmpty(t, ps)

	ids := map[uint32]bool{}
	type rect struct{ x, y, w, h uint32 }
	var placed []rect
	place := func(title string, g *dashboard.GridPos) {
		require.NotNil(t, g, "%s has no gridPos", title)
		require.LessOrEqual(t, g.X+g.W, uint32(24), "%s is wider than the grid", title)
		r := rect{g.X, g.Y, g.W, g.H}
		for _, o := range placed {
			overlap := r.x < o.x+o.w && o.x < r.x+r.w && r.y < o.y+o.h && o.y < r.y+r.h
			require.False(t, overlap, "%s overlaps another panel", title)
		}
		placed = append(placed, r)
	}
	for _, r := range rows {
		require.False(t, ids[r.Id], "panel id %d twice", r.Id)
		ids[r.Id] = true
		place("row "+*r.Title, r.GridPos)
	}
	for _, p := range ps {
		require.NotNil(t, p.Id)
		require.NotNil(t, p.Title)
		title := *p.Title
		require.False(t, ids[*p.Id], "panel id %d twice", *p.Id)
		ids[*p.Id] = true
		place(title, p.GridPos)
		require.NotNil(t, p.Description, "%s: say what the panel shows and which metric", title)
		require.Contains(t, []string{"timeseries", "stat"}, p.Type, "%s: a panel type this test knows", title)
		variant, ok := cog.ConfigForPanelcfgVariant(p.Type)
		require.True(t, ok && variant.StrictOptionsUnmarshaler != nil,
			"%s: the SDK has a schema for panel type %s, so its options were checked", title, p.Type)

		// The panel's decoding leaves fieldConfig's own fields loose; decode them
		// strictly too.
		var fc struct {
			FieldConfig json.RawMessage `json:"fieldConfig"`
		}
		require.NoError(t, json.Unmarshal(rawByID[*p.Id], &fc))
		if fc.FieldConfig != nil {
			var src dashboard.FieldConfigSource
			require.NoError(t, src.UnmarshalJSONStrict(fc.FieldConfig), "%s: fieldConfig", title)
		}

		require.NotEmpty(t, p.Targets, "%s has no query", title)
		refIDs := map[string]bool{}
		for _, target := range p.Targets {
			q, ok := target.(*prometheus.Dataquery)
			require.True(t, ok, "%s: every query is a Prometheus query with its data source set (got %T)", title, target)
			require.NotEmpty(t, q.Expr, title)
			require.NotNil(t, q.Datasource, "%s: the query names its data source", title)
			require.Equal(t, "${datasource}", *q.Datasource.Uid, "%s: the query uses the datasource variable", title)
			require.NotNil(t, q.RefId, title)
			require.False(t, refIDs[*q.RefId], "%s: refId %s twice", title, *q.RefId)
			refIDs[*q.RefId] = true
		}
	}
}

// TestDashboardQueriesNameOnlyRegisteredMetrics parses every PromQL expression of
// the dashboard (panel queries and variable queries) and checks it against the
// registry of every idem component: each metric family exists (a histogram's
// _bucket, _sum and _count included), each label it matches or groups by is one
// of the family's, each literal label value it matches is a series that exists
// before any work, and every template variable it uses is defined. And the other
// way round: every idem family has a panel. A family's labels are those it has on
// one database and over a shard map (the shard label).
func TestDashboardQueriesNameOnlyRegisteredMetrics(t *testing.T) {
	t.Parallel()
	d, _ := loadDashboard(t)
	w := build(t)
	sharded, _ := buildSharded(t)
	labelNames := func(mf *dto.MetricFamily) []string {
		out := labelNames(mf)
		for _, l := range labelNames(sharded.families[mf.GetName()]) {
			if !slices.Contains(out, l) {
				out = append(out, l)
			}
		}
		return out
	}

	vars := map[string]bool{"__rate_interval": true, "__interval": true, "__range": true}
	var names []string
	for _, v := range d.Templating.List {
		vars[v.Name] = true
		names = append(names, v.Name)
	}
	require.Subset(t, names, []string{"datasource", "consumer", "kind", "shard"}, "a data source variable, and consumer, kind and shard variables")
	used := map[string]bool{}

	for _, v := range d.Templating.List {
		require.NotNil(t, v.Query, "variable %s has no query", v.Name)
		require.NotNil(t, v.Query.String, "variable %s: a query as text", v.Name)
		query := *v.Query.String
		switch v.Type {
		case dashboard.VariableTypeDatasource:
			require.Equal(t, "prometheus", query)
		case dashboard.VariableTypeQuery:
			m := labelValues.FindStringSubmatch(query)
			require.NotNil(t, m, "variable %s: %q is not label_values(metric, label)", v.Name, query)
			mf := w.families[m[1]]
			require.NotNil(t, mf, "variable %s: %s is no registered family", v.Name, m[1])
			require.Contains(t, labelNames(mf), m[2], "variable %s: %s has no label %s", v.Name, m[1], m[2])
			used[m[1]] = true
		default:
			t.Fatalf("variable %s: type %s; teach this test about it", v.Name, v.Type)
		}
	}

	ps, _ := panels(d)
	for _, p := range ps {
		for _, target := range p.Targets {
			expr := target.(*prometheus.Dataquery).Expr
			where := fmt.Sprintf("panel %q, query %q", *p.Title, expr)
			for _, v := range templateVar.FindAllStringSubmatch(expr, -1) {
				require.True(t, vars[v[1]+v[2]], "%s: variable $%s is not defined", where, v[1]+v[2])
			}
			pq, err := scanPromQL(expr)
			require.NoError(t, err, where)
			require.NotEmpty(t, pq.selectors, "%s: names no metric", where)
			groupable := map[string]bool{}
			for _, sel := range pq.selectors {
				mf, bucket := w.resolve(sel.metric)
				require.NotNil(t, mf, "%s: %s is no metric an idem component registers", where, sel.metric)
				used[mf.GetName()] = true
				labels := labelNames(mf)
				if bucket {
					labels = append(labels, "le")
				}
				for _, l := range labels {
					groupable[l] = true
				}
				for _, m := range sel.matchers {
					require.Contains(t, labels, m.name, "%s: %s has no label %s", where, sel.metric, m.name)
					if strings.Contains(m.value, "$") || m.op == "!=" || m.op == "!~" {
						continue
					}
					re := regexp.QuoteMeta(m.value)
					if m.op == "=~" {
						re = m.value
					}
					matched, err := hasSeries(mf, m.name, "^(?:"+re+")$")
					require.NoError(t, err, where)
					require.True(t, matched, "%s: no series of %s has %s%s%q before any work, so the query shows no data until then", where, mf.GetName(), m.name, m.op, m.value)
				}
			}
			for _, l := range pq.grouping {
				require.True(t, groupable[l], "%s: groups by %s, which none of its metrics has", where, l)
			}
			for _, f := range pq.funcs {
				require.True(t, promFuncs[f], "%s: %s() is no PromQL function this test knows", where, f)
			}
		}
	}
	for name := range w.families {
		require.True(t, used[name], "%s has no panel in %s", name, dashboardPath)
	}
}

var (
	labelValues = regexp.MustCompile(`^label_values\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*,\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\)$`)
	templateVar = regexp.MustCompile(`\$(?:([A-Za-z_][A-Za-z0-9_]*)|\{([A-Za-z_][A-Za-z0-9_]*)(?::[a-z]+)?\})`)
)

// resolve finds the family of a metric name in a query: the family itself, or the
// histogram a _bucket, _sum or _count series belongs to (bucket is true for
// _bucket, whose series have the le label).
func (w world) resolve(name string) (mf *dto.MetricFamily, bucket bool) {
	if mf := w.families[name]; mf != nil {
		return mf, false
	}
	for _, suffix := range []string{"_bucket", "_sum", "_count"} {
		base, ok := strings.CutSuffix(name, suffix)
		if mf := w.families[base]; ok && mf != nil && mf.GetType() == dto.MetricType_HISTOGRAM {
			return mf, suffix == "_bucket"
		}
	}
	return nil, false
}

func labelNames(mf *dto.MetricFamily) []string {
	var out []string
	for _, m := range mf.GetMetric() {
		for _, lp := range m.GetLabel() {
			if !slices.Contains(out, lp.GetName()) {
				out = append(out, lp.GetName())
			}
		}
	}
	return out
}

// hasSeries reports whether a series of mf has a value of label that matches re.
func hasSeries(mf *dto.MetricFamily, label, re string) (bool, error) {
	rx, err := regexp.Compile(re)
	if err != nil {
		return false, err
	}
	for _, m := range mf.GetMetric() {
		for _, lp := range m.GetLabel() {
			if lp.GetName() == label && rx.MatchString(lp.GetValue()) {
				return true, nil
			}
		}
	}
	return false, nil
}

// shardFilter is the matcher every selector of an idem metric carries, so that the
// shard variable filters every panel.
var shardFilter = matcher{name: "shard", op: "=~", value: "$shard"}

// TestDashboardFiltersOnShard: the shard variable is a multi-select of the shard
// label's values with All, and All is ".*"; every selector of every panel query
// carries shard=~"$shard", so no panel ignores the shard chosen. On one database
// the series have no shard label, and Prometheus matches a missing label as the
// empty value: with All each selector still selects the single-database series
// (checked here against them, the missing label read as ""), and the query shows
// the same series as without the filter.
func TestDashboardFiltersOnShard(t *testing.T) {
	t.Parallel()
	d, _ := loadDashboard(t)
	w := build(t)
	var shardVar *dashboard.VariableModel
	for i, v := range d.Templating.List {
		if v.Name == "shard" {
			shardVar = &d.Templating.List[i]
		}
	}
	require.NotNil(t, shardVar, "a shard variable")
	require.Equal(t, dashboard.VariableTypeQuery, shardVar.Type)
	require.True(t, shardVar.Multi != nil && *shardVar.Multi, "the shard variable is a multi-select")
	require.True(t, shardVar.IncludeAll != nil && *shardVar.IncludeAll, "the shard variable includes All")
	require.NotNil(t, shardVar.AllValue, "All is a regex of its own, not the list of the shards (none on one database)")
	all := *shardVar.AllValue
	m := labelValues.FindStringSubmatch(*shardVar.Query.String)
	require.NotNil(t, m)
	require.Equal(t, "shard", m[2])

	ps, _ := panels(d)
	for _, p := range ps {
		for _, target := range p.Targets {
			expr := target.(*prometheus.Dataquery).Expr
			where := fmt.Sprintf("panel %q, query %q", *p.Title, expr)
			pq, err := scanPromQL(expr)
			require.NoError(t, err, where)
			for _, sel := range pq.selectors {
				require.Contains(t, sel.matchers, shardFilter, "%s: %s does not filter on the shard variable: add shard=~\"$shard\"", where, sel.metric)
				mf, _ := w.resolve(sel.metric)
				require.NotNil(t, mf, where)
				require.True(t, selectsAll(t, mf, sel.matchers, all),
					"%s: with All (%q) the selector of %s misses a single-database series (no shard label)", where, all, sel.metric)
			}
		}
	}
}

// selectsAll reports whether the matchers on the shard label, with $shard as the
// All value, select every series of mf, with Prometheus's semantics: a regex
// matcher is anchored, and a series without the label has it as "".
func selectsAll(t *testing.T, mf *dto.MetricFamily, ms []matcher, all string) bool {
	t.Helper()
	for _, one := range mf.GetMetric() {
		value := ""
		for _, lp := range one.GetLabel() {
			if lp.GetName() == "shard" {
				value = lp.GetValue()
			}
		}
		for _, m := range ms {
			if m.name != "shard" {
				continue
			}
			re := strings.ReplaceAll(m.value, "$shard", all)
			if m.op == "=" || m.op == "!=" {
				re = regexp.QuoteMeta(re)
			}
			rx, err := regexp.Compile("^(?:" + re + ")$")
			require.NoError(t, err)
			if rx.MatchString(value) == (m.op == "!=" || m.op == "!~") {
				return false
			}
		}
	}
	return true
}
