package effects

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"iter"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemkit/idem/internal/effectsdb"
	"github.com/idemkit/idem/internal/text"
)

// record writes outcomes in batches until the outcomes channel is closed: it takes
// what is waiting, up to a limit, and records it in one statement.
func (d *dispatcher) record() {
	limit := max(4*d.cfg.BatchSize, 256)
	batch := make([]outcome, 0, limit)
	for o := range d.outcomes {
		batch = append(batch[:0], o)
	drain:
		for len(batch) < limit {
			select {
			case o, ok := <-d.outcomes:
				if !ok {
					break drain
				}
				batch = append(batch, o)
			default:
				break drain
			}
		}
		d.recordBatch(batch)
		for _, o := range batch {
			o.c.lane.held.Add(-1)
			o.c.batch.recorded()
		}
		select {
		case d.freed <- struct{}{}:
		default:
		}
	}
}

func (d *dispatcher) recordBatch(batch []outcome) {
	slices.SortFunc(batch, func(a, b outcome) int {
		return cmp.Or(strings.Compare(a.c.Tenant, b.c.Tenant), strings.Compare(a.c.Kind, b.c.Kind), strings.Compare(a.c.Key, b.c.Key))
	})
	notify := false
	var soonest time.Duration = -1
	for _, o := range batch {
		if o.state == "pending" {
			if o.delay == 0 {
				notify = true
			} else if soonest < 0 || o.delay < soonest {
				soonest = o.delay
			}
		}
	}
	// On Citus an outcome write must stay on one tenant's shard: the batch (sorted
	// by tenant) is written one tenant's run at a time, with the one-tenant forms.
	status := make([]outcomeStatus, 0, len(batch))
	perTenant := d.cfg.Tenant == "" && !effectsdb.OneTenant(tenantsOf(batch)) && d.onCitus(context.Background())
	for run := range tenantRuns(batch, perTenant) {
		status = append(status, d.writeRun(run)...)
	}
	for i, o := range batch {
		switch status[i] {
		case notWritten:
			// logged where it failed
		case leaseLost:
			d.m.lostLease.WithLabelValues(o.c.Kind).Inc()
			d.log.Warn("effect lease lost: it was claimed again before this attempt's outcome was recorded",
				append(o.c.logAttrs(), "outcome", o.label)...)
		case recorded:
			o.c.lane.attempts[o.label].Inc()
			if o.state == "dead" {
				d.m.dead.WithLabelValues(o.c.Kind).Inc()
			}
		}
	}
	if notify {
		// Released claims are due now; wake every dispatcher, this one included.
		_ = retry(func(ctx context.Context) error {
			_, err := d.pool.Exec(ctx, d.q.notify, d.cfg.Schema)
			return err
		})
	}
	if soonest >= 0 && soonest < d.cfg.PollInterval {
		time.AfterFunc(soonest, d.signalWake)
	}
}

// writeRun writes a run of outcomes in one statement, or each on its own when
// one row's data breaks the statement. Outcomes it could not write are
// notWritten: their leases run out and the effects are claimed again (nothing is
// lost, though a sent effect is sent once more).
func (d *dispatcher) writeRun(run []outcome) []outcomeStatus {
	status, err := d.writeOutcomes(run)
	if err != nil && isDataError(err) {
		// One row's data broke the statement (a constraint of the user's, an
		// encoding the server cannot take). The batch is all or nothing, so write
		// each outcome on its own: one bad outcome must not cost the others theirs.
		d.log.Warn("effects dispatcher: an outcome batch was rejected for its data; writing each outcome on its own", "error", err, "outcomes", len(run))
		return d.writeOneByOne(run)
	}
	if err != nil {
		d.log.Error("effects dispatcher: recording outcomes failed; the effects will be retried after their lease", "error", err, "outcomes", len(run))
		return make([]outcomeStatus, len(run))
	}
	return status
}

// tenantsOf returns the tenant of each outcome of batch.
func tenantsOf(batch []outcome) []string {
	ts := make([]string, len(batch))
	for i, o := range batch {
		ts[i] = o.c.Tenant
	}
	return ts
}

// tenantRuns yields batch whole, or with split its runs of one tenant (batch is
// sorted by tenant), in order.
func tenantRuns(batch []outcome, split bool) iter.Seq[[]outcome] {
	return func(yield func([]outcome) bool) {
		for len(batch) > 0 {
			n := len(batch)
			if split {
				n = 1
				for n < len(batch) && batch[n].c.Tenant == batch[0].c.Tenant {
					n++
				}
			}
			if !yield(batch[:n]) {
				return
			}
			batch = batch[n:]
		}
	}
}

// outcomeStatus is what became of one outcome of a batch.
type outcomeStatus uint8

const (
	notWritten outcomeStatus = iota // the write failed
	leaseLost                       // written, but the effect had been claimed again
	recorded
)

// writeOutcomes records batch in one transaction, retried on errors that may pass
// (a cut connection, a failover) but not on a data error, which the same rows would
// hit again. It returns, for each outcome of the batch in order, recorded or
// leaseLost (the lease was lost to a newer claim).
//
// The write is retried even when its COMMIT may have gone through (a connection
// cut after COMMIT was sent): the record statement is idempotent (see queries.go),
// so the retry changes nothing that the first run changed, and still reports those
// rows as recorded.
func (d *dispatcher) writeOutcomes(batch []outcome) ([]outcomeStatus, error) {
	n := len(batch)
	tenants, kinds, keys, states, errs := make([]string, n), make([]string, n), make([]string, n), make([]string, n), make([]*string, n)
	codes, masked := make([]*string, n), make([]*string, n)
	fences, delays := make([]int64, n), make([]int64, n)
	inFlight, undo := make([]bool, n), make([]int32, n)
	for i, o := range batch {
		tenants[i], kinds[i], keys[i], fences[i], states[i] = o.c.Tenant, o.c.Kind, o.c.Key, o.c.fence, o.state
		delays[i], inFlight[i], undo[i] = o.delay.Milliseconds(), o.inFlight, int32(o.undo)
		if o.err != "" {
			errs[i] = &o.err
		}
		if o.state == "dead" {
			codes[i], masked[i] = &batch[i].code, &batch[i].masked
		}
	}
	status := make([]outcomeStatus, n)
	args := []any{tenants, kinds, keys, fences, states, delays, inFlight, undo, errs, codes, masked}
	record, recordAgain := d.q.record, d.q.recordAgain
	if effectsdb.OneTenant(tenants) {
		// One tenant's outcomes: the forms that filter on it, for a router.
		record, recordAgain = d.q.recordOne, d.q.recordAgainOne
		args = append(args, batch[0].c.Tenant)
	}
	err := retryUnless(isDataError, func(ctx context.Context) error {
		for i := range status {
			status[i] = leaseLost
		}
		// One round trip: the outcome commits without waiting for its WAL flush.
		// That is safe here, and only here: if the server crashes and loses this
		// commit, each row goes back to the claim before it, which is durable and
		// in_flight, so the effect is reconciled or sent again after its lease. The
		// claim itself always commits synchronously. recordSettings also fix the
		// plan, as for the claim.
		b := &pgx.Batch{}
		b.Queue(beginSQL)
		for _, s := range d.settings(ctx, recordSettings) {
			b.Queue(s)
		}
		q := record
		record = recordAgain // a retry may find this run committed
		b.Queue(q, args...).Query(func(rows pgx.Rows) error {
			var i int64
			_, err := pgx.ForEachRow(rows, []any{&i}, func() error {
				if i < 1 || i > int64(n) {
					return fmt.Errorf("idem: outcome write returned ordinal %d of %d", i, n)
				}
				status[i-1] = recorded
				return nil
			})
			return err
		})
		b.Queue(`COMMIT`)
		return d.pool.SendBatch(ctx, b).Close()
	})
	if err != nil {
		return nil, err
	}
	return status, nil
}

// writeOneByOne records each outcome in a transaction of its own. An outcome whose
// row is still rejected for its data is written once more without its error text;
// if even that fails, it is left to its lease (logged, and notWritten), and the
// others are kept.
func (d *dispatcher) writeOneByOne(batch []outcome) []outcomeStatus {
	status := make([]outcomeStatus, len(batch))
	for i, o := range batch {
		one, err := d.writeOutcomes([]outcome{o})
		if err != nil && isDataError(err) && o.err != "" {
			o.err = "idem: this attempt's error text could not be stored (" + text.Sanitize(err.Error(), 200) + ")"
			one, err = d.writeOutcomes([]outcome{o})
		}
		if err != nil {
			d.log.Error("effects dispatcher: recording an outcome failed; the effect will be retried after its lease",
				append(o.c.logAttrs(), "error", err, "outcome", o.label)...)
			continue
		}
		status[i] = one[0]
	}
	return status
}

// isDataError reports an error that the same rows will hit again: a data exception
// (class 22, such as 22021 invalid text) or an integrity violation (class 23, such
// as a CHECK constraint).
func isDataError(err error) bool {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return false
	}
	return strings.HasPrefix(pgErr.Code, "22") || strings.HasPrefix(pgErr.Code, "23")
}

func (d *dispatcher) signalWake() {
	select {
	case d.wake <- struct{}{}:
	default:
	}
}

// retry runs f up to three times, each with its own timeout, for writes that must
// happen even while Run's context is ending.
func retry(f func(ctx context.Context) error) error {
	return retryUnless(func(error) bool { return false }, f)
}

// retryUnless is retry that gives up at once on an error for which final is true.
func retryUnless(final func(error) bool, f func(ctx context.Context) error) error {
	var err error
	for i := range 3 {
		if i > 0 {
			time.Sleep(time.Duration(i) * 200 * time.Millisecond)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		err = f(ctx)
		cancel()
		if err == nil || final(err) {
			return err
		}
	}
	return err
}
