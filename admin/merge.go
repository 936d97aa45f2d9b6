package admin

import (
	"cmp"
	"context"
	"slices"
	"strings"

	"github.com/idemkit/idem/internal/fanout"
)

// mergeGroups lists the failure groups of every shard merged by ID: a group
// whose failures are on several shards is one row, with the sum of their counts,
// the earliest first and the latest last failure, the shards that hold it (Shard)
// and each one's part (Parts). A merged group's place in the order depends on
// every shard's part, so each page reads every group of the filter on every
// shard (one aggregate a shard, all its groups held for the merge, without their
// samples), merges them and pages with the same keyset cursor as one database
// (the order's value and the ID): a group that is there for the whole paging
// appears once, on its merged count's page. (A database aggregates every failure
// for each page of groups already; one database alike.) Then each shard that
// holds some of the page's groups reads their codes, texts and sample keys, with
// one statement: the samples cost grows with the page, not with the groups.
func (a *Admin) mergeGroups(ctx context.Context, f GroupFilter, p Page, gp groupPaging) (*List[FailureGroup], error) {
	order, limit, afterValue, afterID := gp.order, gp.limit, gp.afterValue, gp.afterID
	// Every group of the filter on each shard, from one aggregate of its failures:
	// each group there once, with one count.
	all, errs := fanout.Collect(a.parts, func(_ int, p *part) ([]FailureGroup, error) { return p.groupCounts(ctx, f, gp) })
	if err := a.join(errs); err != nil {
		return nil, err
	}
	parts := map[string][]*FailureGroup{} // by ID, in map order
	var ids []string
	for i := range all {
		for j := range all[i] {
			g := &all[i][j]
			if parts[g.ID] == nil {
				ids = append(ids, g.ID)
			}
			parts[g.ID] = append(parts[g.ID], g)
		}
	}
	// The merged groups past the cursor, by their counts and times alone.
	merged := make([]FailureGroup, 0, len(ids))
	for _, id := range ids {
		g := mergeGroup(parts[id], 0)
		if p.After == "" || groupValue(*g, order) < afterValue || groupValue(*g, order) == afterValue && g.ID > afterID {
			merged = append(merged, *g)
		}
	}
	slices.SortFunc(merged, func(x, y FailureGroup) int {
		return cmp.Or(cmp.Compare(groupValue(y, order), groupValue(x, order)), cmp.Compare(x.ID, y.ID))
	})
	out := &List[FailureGroup]{Rows: merged[:min(limit, len(merged))]}
	if len(merged) > limit {
		out.Next = encodeGroupCursor(merged[limit-1], order)
	}
	// The page's groups' samples, read on the shards that hold them, then merged.
	onShard := map[string][]*FailureGroup{}
	for _, g := range out.Rows {
		for _, part := range parts[g.ID] {
			onShard[part.Shard] = append(onShard[part.Shard], part)
		}
	}
	_, errs = fanout.Collect(a.parts, func(_ int, p *part) (struct{}, error) {
		if len(onShard[p.name]) == 0 {
			return struct{}{}, nil
		}
		return struct{}{}, p.sampleGroups(ctx, onShard[p.name], f.Seen, ListSamples)
	})
	if err := a.join(errs); err != nil {
		return nil, err
	}
	for i, g := range out.Rows {
		out.Rows[i] = *mergeGroup(parts[g.ID], ListSamples)
	}
	return out, nil
}

// mergeGroup merges one group's parts, each read on the shard its Shard names, in
// map order: the sum of the counts, the earliest first and the latest last
// failure, the latest part's code, texts and sample keys first (at most samples
// keys), the shards comma-separated and each one's part. Attempts and Actions are
// left to the caller.
func mergeGroup(parts []*FailureGroup, samples int) *FailureGroup {
	out := *parts[0]
	out.Attempts, out.Actions, out.SampleKeys, out.Count = nil, nil, nil, 0
	latest := parts[0]
	names := make([]string, len(parts))
	for i, g := range parts {
		names[i] = g.Shard
		out.Count += g.Count
		out.FirstSeen = minTime(out.FirstSeen, g.FirstSeen)
		out.LastSeen = maxTime(out.LastSeen, g.LastSeen)
		if g.LastSeen.After(latest.LastSeen) {
			latest = g
		}
		if g.Shard != "" { // read on a shard of a map
			out.Parts = append(out.Parts, groupPart{Shard: g.Shard, Count: g.Count, FirstSeen: g.FirstSeen, LastSeen: g.LastSeen})
		}
	}
	out.Shard = strings.Join(names, ",")
	out.Code, out.Masked, out.Example = latest.Code, latest.Masked, latest.Example
	out.SampleKeys = slices.Clone(latest.SampleKeys)
	for _, g := range parts {
		if g != latest {
			out.SampleKeys = append(out.SampleKeys, g.SampleKeys...)
		}
	}
	out.SampleKeys = out.SampleKeys[:min(len(out.SampleKeys), samples)]
	return &out
}
