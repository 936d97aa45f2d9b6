package chaos

import (
	"errors"
	"fmt"
	"slices"
	"strings"
)

// Report is what the Auditor found. Lost, CommittedTwice, EffectsMissing and
// SendsMissing are failures; the rest describe the run.
type Report struct {
	Consumer string
	// Messages is the number of expected keys (or of inbox keys, without them).
	Messages             int
	Deliveries           int64
	DuplicatesSuppressed int64

	// The inbox rows of the consumer, by state.
	InboxCompleted, InboxFailed, InboxProcessing int

	// CommittedOnce and CommittedTwice count expected keys whose business
	// operation committed once, and more than once (duplicated).
	CommittedOnce, CommittedTwice int
	// Failed counts expected keys recorded as permanent failures and not
	// committed.
	Failed int
	// Lost counts expected keys with no commit and no recorded failure.
	Lost int
	// Unexpected counts keys that committed but were not expected.
	Unexpected int
	// Inconsistent counts expected keys whose parts disagree: a business commit
	// with no completed inbox row (unless AuditQuery.WithoutInbox), or an effect
	// row with no business commit. An idem consumer writes all three in one
	// transaction, so one snapshot of its database never shows either; a
	// BusinessCount read at another moment, or from a database the consumer does
	// not commit to, can. Such a report is not OK.
	Inconsistent int

	// The consumer's effects, by state.
	EffectsDone, EffectsDead, EffectsPending int
	// EffectsMissing counts expected effects with no row: lost effects.
	EffectsMissing int

	// With AuditQuery.Sends: effects received once, more than once, and never
	// (though the effect is not dead and its message not failed).
	SendsOnce, SendsRepeated, SendsMissing int
	// SendsTotal is every send counted.
	SendsTotal int

	// Up to ten keys of each failure, for the error message; InconsistentKeys
	// say which parts disagree ("k: committed 1, inbox row none").
	LostKeys, DuplicatedKeys, MissingEffectKeys, MissingSendKeys, InconsistentKeys []string

	// businessUnknown, effectsUnknown and sendsUnknown say what the audit could
	// not measure. The zero Report measured all it holds (nothing), so reports add
	// up from it.
	businessUnknown, effectsUnknown, sendsUnknown bool
}

// OK reports whether nothing was lost, nothing committed twice, no effect is
// missing and the report's parts agree.
func (r Report) OK() bool { return r.Err() == nil }

// DuplicatesDelivered is how many deliveries the consumer saw beyond one per
// message: the producer's copies that the broker passed on, the broker's
// redeliveries, injected copies. These are what the consumer had to recognise
// (it suppressed some and ran the handler again for others, whose first try did
// not commit). -1 when Deliveries was not measured.
func (r Report) DuplicatesDelivered() int64 {
	if r.Deliveries < 0 {
		return -1
	}
	return r.Deliveries - int64(r.Messages)
}

// Err describes every failure in the report, or returns nil.
func (r Report) Err() error {
	var errs []error
	if r.Lost > 0 {
		errs = append(errs, fmt.Errorf("%d lost (e.g. %s)", r.Lost, strings.Join(r.LostKeys, ", ")))
	}
	if r.CommittedTwice > 0 {
		errs = append(errs, fmt.Errorf("%d committed more than once (e.g. %s)", r.CommittedTwice, strings.Join(r.DuplicatedKeys, ", ")))
	}
	if r.EffectsMissing > 0 {
		errs = append(errs, fmt.Errorf("%d effects missing (e.g. %s)", r.EffectsMissing, strings.Join(r.MissingEffectKeys, ", ")))
	}
	if r.SendsMissing > 0 {
		errs = append(errs, fmt.Errorf("%d effects never received (e.g. %s)", r.SendsMissing, strings.Join(r.MissingSendKeys, ", ")))
	}
	if r.Inconsistent > 0 {
		errs = append(errs, fmt.Errorf("%d keys whose business commit, inbox row and effect row disagree, so they were not read at one moment (e.g. %s)",
			r.Inconsistent, strings.Join(r.InconsistentKeys, "; ")))
	}
	if len(errs) == 0 {
		return nil
	}
	return fmt.Errorf("chaos audit of %s: %w", r.Consumer, errors.Join(errs...))
}

// Settled reports whether nothing is in flight: no pending effect and no inbox row
// still processing.
func (r Report) Settled() bool { return r.EffectsPending == 0 && r.InboxProcessing == 0 }

// Add returns r with the reports more added to it: reports of disjoint key sets,
// such as the tenants of a run, or the shards of a run over several databases,
// each audited on its own. Deliveries and DuplicatesSuppressed are added where
// every report measured them, and are -1 otherwise. The result keeps r's
// Consumer; add up from the zero Report to name the sum:
//
//	total := chaos.Report{Consumer: "all shards"}.Add(perShard...)
func (r Report) Add(more ...Report) Report {
	s := r
	for _, keys := range []*[]string{&s.LostKeys, &s.DuplicatedKeys, &s.MissingEffectKeys, &s.MissingSendKeys, &s.InconsistentKeys} {
		*keys = slices.Clone(*keys)
	}
	for _, r := range more {
		s.Deliveries = addMeasured(s.Deliveries, r.Deliveries)
		s.DuplicatesSuppressed = addMeasured(s.DuplicatesSuppressed, r.DuplicatesSuppressed)
		s.Messages += r.Messages
		s.InboxCompleted += r.InboxCompleted
		s.InboxFailed += r.InboxFailed
		s.InboxProcessing += r.InboxProcessing
		s.CommittedOnce += r.CommittedOnce
		s.CommittedTwice += r.CommittedTwice
		s.Failed += r.Failed
		s.Lost += r.Lost
		s.Unexpected += r.Unexpected
		s.Inconsistent += r.Inconsistent
		s.EffectsDone += r.EffectsDone
		s.EffectsDead += r.EffectsDead
		s.EffectsPending += r.EffectsPending
		s.EffectsMissing += r.EffectsMissing
		s.SendsOnce += r.SendsOnce
		s.SendsRepeated += r.SendsRepeated
		s.SendsMissing += r.SendsMissing
		s.SendsTotal += r.SendsTotal
		for _, k := range r.LostKeys {
			s.LostKeys = sample(s.LostKeys, k)
		}
		for _, k := range r.DuplicatedKeys {
			s.DuplicatedKeys = sample(s.DuplicatedKeys, k)
		}
		for _, k := range r.MissingEffectKeys {
			s.MissingEffectKeys = sample(s.MissingEffectKeys, k)
		}
		for _, k := range r.MissingSendKeys {
			s.MissingSendKeys = sample(s.MissingSendKeys, k)
		}
		for _, k := range r.InconsistentKeys {
			s.InconsistentKeys = sample(s.InconsistentKeys, k)
		}
		s.businessUnknown = s.businessUnknown || r.businessUnknown
		s.effectsUnknown = s.effectsUnknown || r.effectsUnknown
		s.sendsUnknown = s.sendsUnknown || r.sendsUnknown
	}
	return s
}

func addMeasured(a, b int64) int64 {
	if a < 0 || b < 0 {
		return -1
	}
	return a + b
}

func sample(keys []string, k string) []string {
	if len(keys) < 10 {
		keys = append(keys, k)
	}
	return keys
}

// String prints the report as an aligned table under its Consumer. Rows marked "!"
// are failures when not zero; "-" means the figure was not measured.
func (r Report) String() string { return r.Beside() }

// Beside prints r and others side by side as String does, one column each, under
// each report's Consumer: for example idem next to a peer in the same chaos run
// (set Consumer on the copies you print to title them otherwise).
func (r Report) Beside(others ...Report) string {
	reports := append([]Report{r}, others...)
	titles := make([]string, len(reports))
	for i, rep := range reports {
		titles[i] = rep.Consumer
	}
	type row struct {
		label string
		cells []string
	}
	var rows []row
	add := func(label string, cell func(Report) string) {
		r := row{label: label}
		for _, rep := range reports {
			r.cells = append(r.cells, cell(rep))
		}
		rows = append(rows, r)
	}
	num := func(f func(Report) int) func(Report) string {
		return func(r Report) string { return fmt.Sprint(f(r)) }
	}
	given := func(f func(Report) int64) func(Report) string {
		return func(r Report) string {
			if f(r) < 0 {
				return "-"
			}
			return fmt.Sprint(f(r))
		}
	}
	known := func(ok func(Report) bool, f func(Report) int) func(Report) string {
		return func(r Report) string {
			if !ok(r) {
				return "-"
			}
			return fmt.Sprint(f(r))
		}
	}
	head := row{}
	for i := range reports {
		t := ""
		if i < len(titles) {
			t = titles[i]
		}
		head.cells = append(head.cells, t)
	}
	rows = append(rows, head)
	add("messages", num(func(r Report) int { return r.Messages }))
	add("deliveries", given(func(r Report) int64 { return r.Deliveries }))
	add("duplicates delivered", given(Report.DuplicatesDelivered))
	add("duplicates suppressed", given(func(r Report) int64 { return r.DuplicatesSuppressed }))
	add("committed once", num(func(r Report) int { return r.CommittedOnce }))
	add("committed twice (duplicated) !", num(func(r Report) int { return r.CommittedTwice }))
	add("failed (recorded)", num(func(r Report) int { return r.Failed }))
	add("lost !", num(func(r Report) int { return r.Lost }))
	add("unexpected keys", num(func(r Report) int { return r.Unexpected }))
	add("parts disagree !", num(func(r Report) int { return r.Inconsistent }))
	add("inbox completed/failed/processing", func(r Report) string {
		return fmt.Sprintf("%d/%d/%d", r.InboxCompleted, r.InboxFailed, r.InboxProcessing)
	})
	add("effects done", num(func(r Report) int { return r.EffectsDone }))
	add("effects dead", num(func(r Report) int { return r.EffectsDead }))
	add("effects pending", num(func(r Report) int { return r.EffectsPending }))
	effects := func(r Report) bool { return !r.effectsUnknown }
	sends := func(r Report) bool { return !r.sendsUnknown }
	add("effects missing (lost) !", known(effects, func(r Report) int { return r.EffectsMissing }))
	add("sends total", known(sends, func(r Report) int { return r.SendsTotal }))
	add("keys sent once", known(sends, func(r Report) int { return r.SendsOnce }))
	add("keys sent more than once", known(sends, func(r Report) int { return r.SendsRepeated }))
	add("keys never sent (lost) !", known(sends, func(r Report) int { return r.SendsMissing }))
	add("verdict", func(r Report) string {
		if r.OK() {
			return "OK"
		}
		return "FAIL"
	})
	labelW := 0
	cellW := make([]int, len(reports))
	for _, r := range rows {
		labelW = max(labelW, len(r.label))
		for i, c := range r.cells {
			cellW[i] = max(cellW[i], len(c))
		}
	}
	var b strings.Builder
	for _, r := range rows {
		fmt.Fprintf(&b, "%-*s", labelW, r.label)
		for i, c := range r.cells {
			fmt.Fprintf(&b, "  %*s", cellW[i], c)
		}
		b.WriteString("\n")
	}
	return b.String()
}
